"""Shared pieces of the conversion tests: small random HuggingFace LLaMAs and the logits of our
model loaded from a converted checkpoint in a world of TP x PP gloo processes."""

from __future__ import annotations

import os

import torch

from megatron.core import parallel_state as ps
from tests.helpers.dist import run_distributed

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
VOCAB = 251  # odd: needs padding at every TP size


def make_hf(folder: str, *, tie=False, rope_scaling=None, layers=2, groups=2, vocab=VOCAB):
    """Save a random LLaMA (8 heads in ``groups`` groups, rope_theta 50000, eps 1e-6, std-0.2
    weights, random norm weights) with a stand-in tokenizer file; return the model."""
    from megatron.config import ModelConfig
    from tests.helpers.model import hf_model

    config = ModelConfig(num_layers=layers, hidden_size=64, ffn_hidden_size=96,
                         num_attention_heads=8, num_query_groups=groups, kv_channels=8,
                         padded_vocab_size=vocab, max_position_embeddings=256, norm_epsilon=1e-6,
                         rotary_base=50000.0, rope_scaling=rope_scaling,
                         untie_embeddings_and_output_weights=not tie)
    model = hf_model(config, vocab_size=vocab)
    model.save_pretrained(folder)
    with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
        f.write(b"stand-in tokenizer bytes")
    return model


# pretrain_llama.py's flags of make_hf()'s model (untied; GQA 8 heads in 2 groups).
HF_MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96",
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "8", "--max-position-embeddings", "256", "--norm-epsilon", "1e-6",
    "--rotary-base", "50000", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]


def one_document_dataset(prefix: str, seq: int, vocab: int) -> torch.Tensor:
    """Write ``prefix.bin/.idx`` holding 50 copies of one random document of ``seq`` ids below
    ``vocab - 1`` and return it: every training sample (``seq + 1`` consecutive tokens) is that
    document followed by its first token, whatever the shuffle, so a test knows each batch."""
    import numpy as np

    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    doc = torch.randint(0, vocab - 1, (seq,), generator=torch.Generator().manual_seed(0))
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(50):
        builder.add_item(doc.tolist())
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return doc


def safetensors_tensors(folder) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``folder``, by name."""
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def convert(*argv) -> str:
    from tools.checkpoint.convert import main
    return main([str(a) for a in argv])


def randomize_hf(model) -> None:
    """Weights of std 0.2 (attention and routing far from uniform), norm weights 1 +- 0.1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + ("norm" in name))


def save_random_hf(model_class, config, folder: str):
    """``model_class(config)`` in eval mode with :func:`randomize_hf`'s weights, saved with
    ``save_pretrained`` into ``folder``; returns the model."""
    model = model_class(config).eval()
    randomize_hf(model)
    model.save_pretrained(folder)
    return model


def reference_logits(model, vocab: int, b: int = 2, s: int = 32, seed: int = 3):
    """``(tokens [b, s], logits [b, s, vocab])`` of the HuggingFace ``model`` on random ids."""
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return tokens, model(tokens).logits


def tokens_batch(b=2, s=128, vocab=VOCAB, seed=3):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _logits_rank(tp, pp, load_dir, tokens, ep=1, etp=1):
    from megatron.inference import forward_logits
    from megatron.inference.model_loader import load_model_for_inference

    # the converter writes whole experts (expert-TP 1) unless asked for expert-TP = TP; the
    # groups' default would be TP
    groups = ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                          expert_tensor_parallel_size=etp)
    model, _ = load_model_for_inference(load_dir, groups)
    logits = forward_logits(model, tokens, pg_collection=groups)
    first_tp = groups.tp.rank == 0
    return logits if logits is not None and first_tp else None


def megatron_logits(load_dir: str, tp: int, pp: int, tokens, ep: int = 1,
                    etp: int = 1) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, v_padded]`` of our model loaded from ``load_dir`` in a
    world of TP x PP x EP ranks (a MoE model's experts over EP of the data-parallel ranks, split
    over ``etp`` expert-tensor-parallel ranks; every data-parallel rank's logits must agree)."""
    out = [o for o in run_distributed(tp * pp * ep, _logits_rank, tp, pp, load_dir, tokens, ep,
                                      etp) if o is not None]
    assert all(torch.equal(o, out[0]) for o in out)
    return out[0]


def assert_logits_match(ours: torch.Tensor, reference: torch.Tensor, atol=1e-4) -> None:
    """Equal within ``atol`` at every position over the true vocabulary (the comparison the
    negative tests expect to fail)."""
    assert reference.abs().max() > 1.0  # attention far from uniform: the comparison has teeth
    diff = (ours[..., :reference.shape[-1]].float() - reference.float()).abs().max().item()
    assert diff <= atol, f"logits differ by {diff:.3g} > {atol}"


def hf_logits(hf_dir: str, ids: torch.Tensor, dtype=torch.float32, round_to=None) -> torch.Tensor:
    """transformers' eager-attention logits of the HF model in ``hf_dir`` computed in ``dtype``
    (weights first rounded to ``round_to`` when given, as an fp16 checkpoint holds them)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                             torch_dtype=dtype).eval()
    with torch.no_grad():
        if round_to is not None:
            for p in model.parameters():
                p.copy_(p.to(round_to).to(dtype))
        return model(ids).logits


def assert_reproduces(ours: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor) -> float:
    """Our fp32 logits reproduce a reference's fp32 logits ``expected`` as well as fp32 allows:
    no farther from the fp64 logits ``exact`` than the reference itself is (x1.5; a different
    summation order, e.g. a tensor-parallel split, moves fp32 results by that much), within
    3e-5 of ``expected``, with the same argmax at 99% of positions. Returns max |ours-expected|."""
    ours = ours[..., :expected.shape[-1]].float()
    reference_error = (expected.double() - exact).abs().max().item()
    our_error = (ours.double() - exact).abs().max().item()
    diff = (ours - expected).abs().max().item()
    assert our_error <= 1.5 * reference_error, (our_error, reference_error)
    assert diff <= 3e-5, diff
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.99
    return diff


def megatron_lm_reference(shared_data: str) -> str:
    """The folder of Megatron-LM's genuine checkpoints (M1, M2, M3) and their HF source."""
    return os.path.join(shared_data, "megatron-lm-reference", "checkpoints")


def megatron_lm_shard(root: str, name: str, t: int = 0, p=None) -> str:
    """``root/name/iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt`` of a reference vector."""
    sub = f"mp_rank_{t:02d}" + ("" if p is None else f"_{p:03d}")
    return os.path.join(root, name, "iter_0000001", sub, "model_optim_rng.pt")

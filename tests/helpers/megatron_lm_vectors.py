"""Megatron-LM's own test vectors (``../shared/data/megatron-lm-reference/checkpoints``): the
batch and expected logits of a vector, and our model's logits after ``pretrain_llama.py``'s
``--load`` path (its flags parsed, its configuration and process groups, its model provider and
:func:`megatron.checkpointing.load_checkpoint`), in-process on gloo ranks."""

import json
import os

import torch

from tests.helpers.dist import run_distributed

# the tiny LLaMA of the dense vectors (M1-M3, V1) and the tiny Mixtral (V2)
LLAMA_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176",
               "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
               "--kv-channels", "8"]
MIXTRAL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "80",
                 "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
                 "--kv-channels", "8", "--num-experts", "8", "--moe-ffn-hidden-size", "80",
                 "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather"]
COMMON = ["--seq-length", "32", "--max-position-embeddings", "4096", "--norm-epsilon", "1e-5",
          "--rotary-base", "10000", "--untie-embeddings-and-output-weights",
          "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type",
          "rope", "--swiglu", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "1023", "--micro-batch-size", "1",
          "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--seed", "5"]


def vector(shared_data: str, name: str) -> str:
    return os.path.join(shared_data, "megatron-lm-reference", "checkpoints", name)


def batch_and_expected(folder: str):
    """``(input_ids [2, 32], expected fp32 logits [2, 32, 1024], fp64 logits or None)``."""
    with open(os.path.join(folder, "expected.json")) as f:
        ids = torch.tensor(json.load(f)["batch"]["input_ids"])
    expected = torch.load(os.path.join(folder, "expected_logits.pt"), weights_only=True)
    fp64 = os.path.join(folder, "expected_logits_fp64.pt")
    exact = torch.load(fp64, weights_only=True) if os.path.isfile(fp64) else None
    return ids, expected, exact


def _load_and_forward(argv, tokens):
    import torch.distributed as dist

    import pretrain_llama
    from megatron.checkpointing import load_checkpoint
    from megatron.config import checkpoint_args
    from megatron.core import parallel_state as ps
    from megatron.inference import forward_logits

    config, _ = pretrain_llama.configure(argv)
    p = config.parallel
    groups = ps.initialize_model_parallel(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size)
    model = pretrain_llama.model_provider(config, groups, torch.device("cpu"),
                                          pre_process=groups.is_pipeline_first_stage(),
                                          post_process=groups.is_pipeline_last_stage())
    result = load_checkpoint([model], None, None, config.checkpoint, groups,
                             run_flags=checkpoint_args(config))
    model.eval()
    with torch.no_grad():
        logits = forward_logits(model, tokens, pg_collection=groups)
    keep = logits is not None and groups.tp.rank == 0 and dist.get_rank() == min(groups.dp.ranks)
    return (logits, result["iteration"]) if keep else None


def logits_after_load(argv, world: int, tokens):
    """``(logits [b, s, v_padded], iteration)`` of our model after ``--load`` with the flags
    ``argv`` on ``world`` ranks (the last stage's first tensor rank of data-parallel rank 0)."""
    out = [o for o in run_distributed(world, _load_and_forward, list(argv), tokens, timeout=300)
           if o is not None]
    return out[0]


def _load_error(argv, tokens):
    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError

    try:
        _load_and_forward(argv, tokens)
    except CheckpointError as exc:
        return str(exc)
    return None


def load_error(argv, world: int, tokens):
    """The message of the :class:`CheckpointError` the ``--load`` with ``argv`` raises on rank
    0 (None when it loads)."""
    return run_distributed(world, _load_error, list(argv), tokens, timeout=300)[0]

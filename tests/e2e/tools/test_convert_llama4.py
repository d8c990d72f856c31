"""Llama 4's text model in and out: a tiny random ``Llama4ForCausalLM`` (fp32; MoE on every
other layer with dense layers of their own width, top-1 sigmoid routing on the expert input, a
shared expert, NoPE layers with temperature-scaled queries, chunked attention of 4 tokens on the
RoPE layers with their q/k L2 norm, interleaved RoPE with Llama-3 scaling) converted to our
layout gives transformers' logits at TP1, TP2 and PP2, and its first training loss; the
round trip is bitwise."""

import json
import shlex

import pytest
import torch

from tests.helpers.convert import (assert_logits_match, convert, megatron_logits,
                                   one_document_dataset, safetensors_tensors)
from megatron.core import parallel_state as ps
from tests.helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, E, F_EXPERT, F_DENSE, CHUNK = 256, 4, 32, 48, 4


def _randomize(model) -> None:
    """Weights of std 0.2 (attention and routing far from uniform), norm weights 1 +- 0.1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + ("norm" in name))


def llama4_config(layers: int = 4, **changes):
    from transformers import Llama4TextConfig
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=F_EXPERT,
                  intermediate_size_mlp=F_DENSE, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=1,
                  interleave_moe_layer_step=2, no_rope_layer_interval=2,
                  attention_chunk_size=CHUNK, floor_scale=4, attn_scale=0.5,
                  max_position_embeddings=128, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16})
    fields.update(changes)
    return Llama4TextConfig(**fields)


def make_llama4(folder: str, **changes):
    """A random fp32 ``Llama4ForCausalLM`` saved with ``save_pretrained`` (eager attention)."""
    from transformers import Llama4ForCausalLM

    torch.manual_seed(1)
    model = Llama4ForCausalLM(llama4_config(**changes)).eval()
    model.config._attn_implementation = "eager"
    _randomize(model)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama4"))
    model = make_llama4(folder)
    # 18 tokens: four whole chunks of 4 and a partial one; NoPE scales change at 3, 7, 11, 15
    tokens = torch.randint(0, VOCAB, (2, 18), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens).logits
    return folder, model, tokens, expected


@pytest.mark.parametrize("tp,pp,ep,etp", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1),
                                         (2, 1, 2, 1), (2, 1, 2, 2)])
def test_llama4_logits_equal_transformers(llama4, tp, pp, ep, etp, tmp_path):
    """At TP x PP x EP (``--target-expert-parallel-size``: expert rank e's shards hold its
    fused experts, every rank the shared expert and the dense layers) and expert-TP 1 or TP,
    loaded in a world of TP x PP x EP ranks, the logits are transformers'."""
    folder, _, tokens, expected = llama4
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ckpt", "--target-tensor-parallel-size", tp,
            "--target-pipeline-parallel-size", pp, "--target-expert-parallel-size", ep,
            "--target-expert-tensor-parallel-size", etp)
    logits = megatron_logits(str(tmp_path / "ckpt"), tp, pp, tokens, ep=ep, etp=etp)
    assert_logits_match(logits, expected, atol=3e-5)  # measured 1.1e-5 of logits up to 5


def test_round_trip_is_bitwise(llama4, tmp_path):
    folder, model, tokens, expected = llama4
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "a", "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "a", "--save-dir",
            tmp_path / "hf")
    original, exported = safetensors_tensors(folder), safetensors_tensors(tmp_path / "hf")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["moe_layers"], config["no_rope_layers"],
            config["attention_chunk_size"]) == ("llama4_text", [1, 3], [1, 0, 1, 0], CHUNK)
    reloaded = transformers.Llama4ForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    reloaded.config._attn_implementation = "eager"
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)


def test_round_trip_from_an_expert_parallel_checkpoint_is_bitwise(llama4, tmp_path):
    """HF -> ours at EP2 x PP2 (the MoE layers 1 and 3 one per stage; expert rank e's shards
    hold experts 2e, 2e+1 of the fused [E, 2f, h]) -> HF: every tensor bitwise."""
    from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file

    folder = llama4[0]
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "a", "--target-expert-parallel-size", 2,
            "--target-pipeline-parallel-size", 2)
    original = safetensors_tensors(folder)
    release = tmp_path / "a" / "release"
    for e in range(2):
        shard = load_torch_file(str(release / f"mp_rank_00_001_{e:03d}" / "model_optim_rng.pt"),
                                what="shard")
        w1 = shard["model"]["layers.1.mlp.experts.weight1"]  # global layer 3
        hub = original["model.layers.3.feed_forward.experts.gate_up_proj"]  # [E, h, 2f]
        assert torch.equal(w1, hub[2 * e:2 * e + 2].transpose(1, 2))
        assert torch.equal(shard["model"]["layers.1.mlp.shared_experts.linear_fc2"],
                           original["model.layers.3.feed_forward.shared_expert.down_proj.weight"])
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "a", "--save-dir",
            tmp_path / "hf")
    exported = safetensors_tensors(tmp_path / "hf")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


SEQ = 18
TRAIN_FLAGS = ["--seq-length", str(SEQ), "--tokenizer-type", "NullTokenizer",
               "--vocab-size", str(VOCAB - 1), "--micro-batch-size", "1",
               "--global-batch-size", "1", "--train-iters", "1", "--lr", "0", "--min-lr", "0",
               "--split", "100,0,0", "--log-interval", "1", "--eval-iters", "0", "--seed", "5",
               "--num-workers", "0", "--finetune"]


def _train(argv):
    import pretrain_llama
    return pretrain_llama.main(argv)


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)])
def test_first_training_loss_equals_transformers(llama4, tmp_path, capsys, tp, pp, ep):
    """Trained with the flags the converter prints (at EP 2 each data-parallel rank trains on a
    copy of the one document; TP2 x EP2 with expert-TP 2 on 4 ranks); the training checkpoint
    exports back bitwise."""
    from megatron.inference.model_loader import checkpoint_args
    from tools.checkpoint.model_flags import pretrain_flags

    folder, model, _, _ = llama4
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ours", "--target-pipeline-parallel-size", pp,
            "--target-tensor-parallel-size", tp, "--target-expert-parallel-size", ep,
            "--target-expert-tensor-parallel-size", tp)
    printed = capsys.readouterr().out
    flags = pretrain_flags(checkpoint_args(str(tmp_path / "ours")))
    for flag in ("--rotary-interleaved", "--qk-l2-norm", "--no-rope-freq [0,1,0,1]",
                 f"--attention-chunk-size {CHUNK}", "--attn-temperature-tuning",
                 "--moe-layer-freq [0,1,0,1]", "--moe-apply-probs-on-input",
                 "--moe-router-score-function sigmoid"):
        assert shlex.join(flag.split()) in printed and flag in " ".join(flags), flag
    prefix = str(tmp_path / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    tokenizer = flags.index("--tokenizer-type") if "--tokenizer-type" in flags else len(flags)
    argv = flags[:tokenizer] + TRAIN_FLAGS + [
        "--load", str(tmp_path / "ours"), "--data-path", prefix,
        "--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "run"),
        "--global-batch-size", str(ep)]
    # the last stage logs the loss
    history = run_distributed(tp * pp * ep, _train, argv, timeout=600)[-1]
    tokens, labels = doc[None], torch.cat([doc[1:], doc[:1]])
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(tokens).logits[0], labels).item()
    assert abs(history["lm loss"][0] - hf_loss) < 1e-5, (history["lm loss"], hf_loss)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "run",
            "--save-dir", tmp_path / "back")
    original, exported = safetensors_tensors(folder), safetensors_tensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    if (tp, ep) == (1, 2):  # with its optimizer to EP 1: the experts' Adam moments joined
        _optimizer_follows_the_experts(tmp_path / "run", tmp_path / "ep1")


def _optimizer_follows_the_experts(run, target):
    """``--include-optimizer`` from the EP 2 training checkpoint to EP 1: the expert part's
    moments of each MoE layer are the two expert ranks' concatenated, the dense part's (the
    shared expert, router and dense layers included) expert rank 0's."""
    from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file

    folder = convert("--loader", "megatron", "--saver", "megatron", "--load-dir", run,
                     "--save-dir", target, "--include-optimizer")
    shard = load_torch_file(f"{folder}/mp_rank_00/model_optim_rng.pt", what="shard")
    source = [load_torch_file(f"{run}/iter_0000001/mp_rank_00_{e:03d}/model_optim_rng.pt",
                              what="shard") for e in range(2)]
    dense, expert = shard["optimizer"]["chained_optimizers"]
    parts = [s["optimizer"]["chained_optimizers"] for s in source]
    assert len(expert["state"]) == 4  # weight1 and weight2 of layers 1 and 3
    for i, state in expert["state"].items():
        assert torch.equal(state["exp_avg_sq"], torch.cat([p[1]["state"][i]["exp_avg_sq"]
                                                           for p in parts]))
        assert state["exp_avg_sq"].abs().max() > 0  # the first step's gradients: not empty
    for i, state in dense["state"].items():
        assert torch.equal(state["exp_avg"], parts[0][0]["state"][i]["exp_avg"])


def _generate_rank(load_dir, prompts, new):
    from megatron.inference.generation import generate
    from megatron.inference.model_loader import load_model_for_inference

    groups = ps.initialize_model_parallel(1, 1)
    model, saved = load_model_for_inference(load_dir, groups)
    return generate(model, prompts, new, greedy=True, vocab_size=saved["true_vocab_size"],
                    pg_collection=groups)


def test_greedy_generation_with_the_kv_cache_equals_transformers(llama4, tmp_path):
    """Prompts of 6 tokens and 14 new ones: the KV-cache steps cross chunk boundaries (4, 8, 12,
    16) and NoPE temperature steps (every 4 positions)."""
    folder, model, tokens, _ = llama4
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ckpt")
    prompts, new = tokens[:, :6], 14
    got = run_distributed(1, _generate_rank, str(tmp_path / "ckpt"), prompts.tolist(), new)[0]
    with torch.no_grad():
        expected = model.generate(prompts, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == expected.tolist()
    # and transformers' greedy continuation without a cache (each step the whole sequence)
    with torch.no_grad():
        full = [list(p) for p in prompts.tolist()]
        for _ in range(new):
            logits = model(torch.tensor(full)).logits[:, -1]
            for row, t in zip(full, logits.argmax(-1).tolist()):
                row.append(t)
    assert full == got

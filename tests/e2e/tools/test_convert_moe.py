"""Mixtral checkpoints in and out: a tiny random ``MixtralForCausalLM`` (fp32) converted to our
layout gives transformers' logits at TP1, TP2 and PP2 and its first training loss; the round
trip HF -> Megatron (TP2 x PP2) -> HF is bitwise in the Hub's per-expert layout; both of the
Hub's expert layouts are read; a missing or duplicated expert stops the conversion naming it;
unsupported MoE families are refused in one line."""

import json
import math
import os

import pytest
import torch

from tests.helpers.convert import (convert, make_hf, megatron_logits, one_document_dataset,
                                   reference_logits, safetensors_tensors, save_random_hf)
from tests.helpers.dist import run_distributed
from tools.checkpoint import loader_hf, moe_layout

transformers = pytest.importorskip("transformers")

VOCAB, E, K, F = 256, 4, 2, 48


def make_mixtral(folder: str, layers: int = 2):
    """A random fp32 Mixtral (8 heads in 2 groups, 4 experts of width 48, top-2) with weights of
    std 0.2 (so attention and routing are far from uniform), saved with ``save_pretrained``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(1)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=F,
                           num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=8, num_local_experts=E, num_experts_per_tok=K,
                           max_position_embeddings=128, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    return save_random_hf(MixtralForCausalLM, config, folder)


_safetensors = safetensors_tensors


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mixtral"))
    model = make_mixtral(folder)
    return (folder, model) + reference_logits(model, VOCAB)


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 1, 2), (1, 1, 4)])
def test_mixtral_logits_equal_transformers(mixtral, tp, pp, ep, tmp_path):
    """Converted at TP x PP x EP (``--target-expert-parallel-size``) and loaded in a world of
    TP x PP x EP ranks (EP over the EP data-parallel ranks), the logits are
    transformers'."""
    folder, _, tokens, expected = mixtral
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ckpt", "--target-tensor-parallel-size", tp,
            "--target-pipeline-parallel-size", pp, "--target-expert-parallel-size", ep)
    logits = megatron_logits(str(tmp_path / "ckpt"), tp, pp, tokens, ep)[..., :VOCAB]
    assert expected.abs().max() > 1.0  # far from uniform: the comparison has teeth
    diff = (logits - expected).abs().max().item()
    assert diff <= 3e-5, diff  # measured 5.7e-6 (TP1, PP2), 6.6e-6 (TP2) of logits up to 7


def test_mixtral_checkpoint_holds_every_expert_once(mixtral, tmp_path):
    """Our shards hold weight1 = [w1; w3] and weight2 = w2 per expert, the router as is, whole
    on every tensor rank; the printed flags carry the MoE flags."""
    from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file

    folder, model, _, _ = mixtral
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ckpt", "--target-tensor-parallel-size", 2)
    hf = _safetensors(folder)
    for r in range(2):
        shard = load_torch_file(str(tmp_path / "ckpt" / "release" / f"mp_rank_0{r}" /
                                    "model_optim_rng.pt"), what="shard")
        state, args = shard["model"], shard["args"]
        for i in range(2):
            p = f"model.layers.{i}.block_sparse_moe"
            w1 = state[f"layers.{i}.mlp.experts.weight1"]
            assert w1.shape == (E, 2 * F, 64)
            for e in range(E):
                assert torch.equal(w1[e, :F], hf[f"{p}.experts.{e}.w1.weight"])
                assert torch.equal(w1[e, F:], hf[f"{p}.experts.{e}.w3.weight"])
                assert torch.equal(state[f"layers.{i}.mlp.experts.weight2"][e],
                                   hf[f"{p}.experts.{e}.w2.weight"])
            assert torch.equal(state[f"layers.{i}.mlp.router.weight"], hf[f"{p}.gate.weight"])
    assert (args["num_experts"], args["moe_router_topk"], args["moe_ffn_hidden_size"]) == (E, K, F)


def test_printed_flags_carry_the_moe_flags(mixtral, tmp_path, capsys):
    folder = mixtral[0]
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir", tmp_path / "c")
    printed = capsys.readouterr().out
    assert f"--num-experts {E} --moe-ffn-hidden-size {F} --moe-router-topk {K}" in printed
    assert "--moe-router-pre-softmax" not in printed  # Mixtral renormalises the top k


def test_round_trip_is_bitwise_in_the_hub_layout(mixtral, tmp_path):
    folder, model, tokens, expected = mixtral
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "a", "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "a", "--save-dir",
            tmp_path / "hf", "--max-shard-size", "200KB")
    original, exported = _safetensors(folder), _safetensors(tmp_path / "hf")
    assert sorted(original) == sorted(exported)
    assert any(".block_sparse_moe.experts.3.w2.weight" in k for k in exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == \
        ("mixtral", E, K)
    reloaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)


def test_round_trip_through_tp2_ep2_pp2_is_bitwise(mixtral, tmp_path, capsys):
    """HF -> ours at TP2 x EP2 x PP2 -> HF: every tensor bitwise; the shards are
    ``mp_rank_TT_PPP_EEE`` with experts 2e, 2e+1 of expert rank e, and the printed flags carry
    the expert-parallel size (with --sequence-parallel --expert-tensor-parallel-size 1, which
    training MoE at TP > 1 needs)."""
    from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file

    folder = mixtral[0]
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "a", "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2,
            "--target-expert-parallel-size", 2)
    printed = capsys.readouterr().out
    assert ("--sequence-parallel --expert-tensor-parallel-size 1 --expert-model-parallel-size 2"
            in printed), printed
    release = tmp_path / "a" / "release"
    assert sorted(os.listdir(release)) == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2)
                                           for p in range(2) for e in range(2)]
    hf = _safetensors(folder)
    for t in range(2):
        for e in range(2):
            shard = load_torch_file(str(release / f"mp_rank_{t:02d}_001_{e:03d}" /
                                        "model_optim_rng.pt"), what="shard")
            assert shard["args"]["expert_model_parallel_size"] == 2
            w2 = shard["model"]["layers.0.mlp.experts.weight2"]  # global layer 1
            assert w2.shape == (E // 2, 64, F)
            for i in range(E // 2):
                assert torch.equal(w2[i], hf[f"model.layers.1.block_sparse_moe.experts."
                                             f"{e * E // 2 + i}.w2.weight"])
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "a", "--save-dir",
            tmp_path / "hf")
    exported = _safetensors(tmp_path / "hf")
    assert sorted(hf) == sorted(exported)
    for name, tensor in hf.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_expert_parallel_shards_missing_or_disagreeing_are_refused(mixtral, tmp_path, capsys):
    """A missing expert-rank folder, or expert ranks holding different copies of a replicated
    tensor, stop the conversion naming the folder / tensor; --target-expert-parallel-size not
    dividing the experts, on a dense model, or with --saver hf is refused before writing."""
    from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file
    from megatron.checkpointing import CheckpointError

    folder = mixtral[0]
    ckpt = tmp_path / "a"
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir", ckpt,
            "--target-expert-parallel-size", 2)
    assert sorted(os.listdir(ckpt / "release")) == ["mp_rank_00_000", "mp_rank_00_001"]
    path = str(ckpt / "release" / "mp_rank_00_001" / "model_optim_rng.pt")
    shard = load_torch_file(path, what="shard")
    shard["model"]["layers.1.mlp.router.weight"] = shard["model"]["layers.1.mlp.router.weight"] + 1
    torch.save(shard, path)
    with pytest.raises(moe_layout.ExpertError, match="layers.1.mlp.router.weight differs between "
                                                     "expert-parallel ranks 0 and 1"):
        convert("--loader", "megatron", "--saver", "hf", "--load-dir", ckpt, "--save-dir",
                tmp_path / "x")
    os.remove(path)
    with pytest.raises(CheckpointError, match="no mp_rank_00_001/model_optim_rng.pt"):
        convert("--loader", "megatron", "--saver", "hf", "--load-dir", ckpt, "--save-dir",
                tmp_path / "y")
    _refused_in_one_line(capsys, "--target-expert-parallel-size 3 does not divide the 4 experts",
                         "--loader", "hf", "--saver", "megatron", "--load-dir", folder,
                         "--save-dir", tmp_path / "z", "--target-expert-parallel-size", 3)
    assert not (tmp_path / "z" / "release").exists()
    _refused_in_one_line(capsys, "drop --target-tensor/pipeline/expert/expert-tensor-parallel-size",
                         "--loader", "hf", "--saver", "hf", "--load-dir", folder, "--save-dir",
                         tmp_path / "w", "--target-expert-parallel-size", 2)
    make_hf(str(tmp_path / "dense"))
    _refused_in_one_line(capsys, "--target-expert-parallel-size 2: the model is dense",
                         "--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "dense",
                         "--save-dir", tmp_path / "d", "--target-expert-parallel-size", 2)


def _refused_in_one_line(capsys, message, *argv):
    """``convert.py argv`` exits with status 2 and one stderr line holding ``message``."""
    from tools.checkpoint.convert import command

    capsys.readouterr()
    assert command([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_torch_dist_target_loads_at_any_layout_and_exports_bitwise(mixtral, tmp_path, capsys):
    """``--target-ckpt-format torch_dist``: one layout-free release whose experts lie on the
    global expert axis; loaded at TP2 x EP2 and EP4 its logits are transformers'; the loader
    reads it back to the Hub layout bitwise; a target layout with it is refused in one line."""
    from megatron.checkpointing import torch_dist

    folder, _, tokens, expected = mixtral
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "dist", "--target-ckpt-format", "torch_dist")
    release = tmp_path / "dist" / "release"
    assert torch_dist.is_torch_dist_checkpoint(str(release))
    assert sorted(os.listdir(tmp_path / "dist")) == ["latest_checkpointed_iteration.txt", "release"]
    weight2 = torch_dist.read_tensors(str(release))["layers.1.mlp.experts.weight2"]
    hf = _safetensors(folder)
    assert weight2.shape == (E, 64, F)
    assert all(torch.equal(weight2[e], hf[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"])
               for e in range(E))
    for tp, ep in ((2, 2), (1, 4)):
        logits = megatron_logits(str(tmp_path / "dist"), tp, 1, tokens, ep)[..., :VOCAB]
        assert (logits - expected).abs().max().item() <= 3e-5
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "dist",
            "--save-dir", tmp_path / "hf")
    exported = _safetensors(tmp_path / "hf")
    assert sorted(hf) == sorted(exported)
    assert all(torch.equal(hf[k], exported[k]) for k in hf)
    _refused_in_one_line(capsys, "torch_dist is layout-free (--load reshards it to any TP / PP / "
                         "EP): drop --target-expert-parallel-size", "--loader", "hf", "--saver",
                         "megatron", "--load-dir", folder, "--save-dir", tmp_path / "x",
                         "--target-ckpt-format", "torch_dist", "--target-expert-parallel-size", 2)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"])
def test_fused_in_memory_layout_is_read(family, tmp_path):
    """transformers 5's in-memory names (``mlp.gate``, ``mlp.experts.gate_up_proj`` /
    ``down_proj``), written as they are by a plain ``safetensors`` save of the state dict,
    convert to the same Hub files as the per-expert ones ``save_pretrained`` wrote, for every
    MoE family."""
    from safetensors.torch import save_file

    folder = str(tmp_path / "hub")
    model = {"mixtral": make_mixtral, "olmoe": make_olmoe,
             "qwen3_moe": lambda f: make_qwen_moe(f, "qwen3_moe", True),
             "qwen2_moe": lambda f: make_qwen_moe(f, "qwen2_moe", False)}[family](folder)
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"))
    (fused / "config.json").write_text((open(os.path.join(folder, "config.json")).read()))
    convert("--loader", "hf", "--saver", "hf", "--load-dir", fused, "--save-dir", tmp_path / "out")
    original, exported = _safetensors(folder), _safetensors(tmp_path / "out")
    assert not any("gate_up_proj" in k for k in original)  # the Hub's files are per expert
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


def _edit(folder, target, change):
    from safetensors.torch import save_file

    tensors = _safetensors(folder)
    change(tensors)
    os.makedirs(target)
    save_file(tensors, os.path.join(target, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as src, \
            open(os.path.join(target, "config.json"), "w") as dst:
        dst.write(src.read())


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"),
     "layer 1, expert 2: block_sparse_moe.experts.2.w3.weight is missing"),
    (lambda t: t.update({"model.layers.0.block_sparse_moe.experts.4.w1.weight":
                         t["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()}),
     "layer 0: expert 4 present but config.json says 4 experts"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(E, 2 * F, 64),
                         "model.layers.0.mlp.experts.down_proj": torch.zeros(E, 64, F)}),
     "layer 0: experts stored twice"),
    (lambda t: t.update({"model.layers.1.mlp.gate.weight": torch.zeros(E, 64)}),
     "layer 1: router weight stored twice"),
])
def test_missing_or_duplicated_expert_stops_the_conversion(mixtral, tmp_path, change, message):
    _edit(mixtral[0], str(tmp_path / "bad"), change)
    with pytest.raises(moe_layout.ExpertError, match=message.replace(".", r"\.")):
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "bad",
                "--save-dir", tmp_path / "out")
    assert not (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()


def test_saver_gate_catches_an_altered_or_missing_expert(mixtral, tmp_path):
    """The savers recount what they write: an expert changed after reading (checksum) or a layer
    never streamed stops the conversion, naming layer and expert."""
    from tools.checkpoint import saver_hf

    folder = mixtral[0]

    def run(tamper):
        class Args:
            load_dir, save_dir = folder, str(tmp_path / tamper)
            target_tensor_parallel_size = target_pipeline_parallel_size = None
            target_params_dtype, max_shard_size, tokenizer_dir = None, 10**9, None
            allow_unknown_hf_fields = False
        meta, stream = loader_hf.load_checkpoint(Args)

        def altered():
            for kind, payload in stream:
                if kind == "layer" and tamper == "altered":
                    payload["experts_down"] = payload["experts_down"].clone()
                    payload["experts_down"][3, 0, 0] += 1
                if kind == "layer" and tamper == "dropped" and "dropped" not in Args.__dict__:
                    Args.dropped = True
                    continue
                yield kind, payload
        saver_hf.save_checkpoint(meta, altered(), Args)

    with pytest.raises(moe_layout.ExpertError, match="layer 0, expert 3: its weights changed"):
        run("altered")
    with pytest.raises(moe_layout.ExpertError, match="experts of layer 1 were never handled"):
        run("dropped")


@pytest.mark.parametrize("model_type,words", [
    ("deepseek_v3", "multi-latent attention"), ("gpt_oss", "MXFP4"), ("llama4", "Llama 4")])
def test_unsupported_moe_families_are_refused_in_one_line(model_type, words, tmp_path, capsys):
    """By the config reader, and by ``convert.py`` itself: status 2, one line, nothing written."""
    with pytest.raises(ValueError, match=words) as info:
        loader_hf.meta_from_hf_config({"model_type": model_type})
    assert "\n" not in str(info.value)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": model_type}))
    _refused_in_one_line(capsys, words, "--loader", "hf", "--saver", "megatron", "--load-dir",
                         tmp_path / "hf", "--save-dir", tmp_path / "out")
    assert not (tmp_path / "out").exists()


SEQ = 32
TRAIN_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", str(F),
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "8", "--max-position-embeddings", "128", "--norm-epsilon", "1e-6",
    "--rotary-base", "50000", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--num-experts", str(E), "--moe-ffn-hidden-size", str(F), "--moe-router-topk", str(K),
    "--seq-length", str(SEQ), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
    "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--split", "100,0,0", "--log-interval", "1",
    "--eval-iters", "0", "--seed", "5", "--num-workers", "0", "--finetune",
]


def _train(argv):
    import pretrain_llama
    return pretrain_llama.main(argv)


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)])
def test_first_training_loss_equals_transformers(mixtral, tmp_path, tp, pp, ep, capsys):
    """At EP 2 the two data-parallel ranks each hold two experts and train on a copy of the one
    document (global batch 2), so the mean loss is still transformers' loss on it. The layout
    flags are the ones the converter printed."""
    folder, model, _, _ = mixtral
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ours", "--target-pipeline-parallel-size", pp,
            "--target-expert-parallel-size", ep, "--target-tensor-parallel-size", tp)
    printed = capsys.readouterr().out.split()
    layout = printed[printed.index("--tensor-model-parallel-size"):printed.index("--load")]
    prefix = str(tmp_path / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    argv = TRAIN_FLAGS + ["--load", str(tmp_path / "ours"), "--data-path", prefix,
                          "--data-cache-path", str(tmp_path / "cache"),
                          "--save", str(tmp_path / "run"), "--global-batch-size", str(ep)] + layout
    history = run_distributed(tp * pp * ep, _train, argv, timeout=300)[-1]  # the last stage logs
    tokens, labels = doc[None], torch.cat([doc[1:], doc[:1]])
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(tokens).logits[0], labels).item()
    assert abs(history["lm loss"][0] - hf_loss) < 1e-5, (history["lm loss"], hf_loss)
    # The training checkpoint (its full args; lr 0 kept the weights) exports back bitwise.
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "run",
            "--save-dir", tmp_path / "back")
    original, exported = _safetensors(folder), _safetensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


@pytest.mark.parametrize("key,value", [
    ("moe_layer_freq", [1, 0]), ("expert_model_parallel_size", 2),
    ("moe_apply_probs_on_input", True), ("moe_router_score_function", "sigmoid"),
    ("moe_router_enable_expert_bias", True), ("moe_expert_capacity_factor", 1.0)])
def test_megatron_moe_settings_mixtral_lacks_are_refused(key, value):
    from megatron.checkpointing import CheckpointError
    from tools.checkpoint.loader_megatron import _check_moe_args

    _check_moe_args({"num_experts": E, "moe_layer_freq": [1, 1]})  # Mixtral's settings pass
    with pytest.raises(CheckpointError, match=key.replace("_", "-")):
        _check_moe_args({"num_experts": E, key: value})


SHARED = 40  # Qwen2-MoE's shared expert width


def make_qwen_moe(folder: str, family: str, norm_topk_prob: bool):
    """A random fp32 Qwen3-MoE (per-head q/k RMSNorm) or Qwen2-MoE (q/k/v biases, a shared expert
    of width 40 with its sigmoid gate), 4 experts of width 48, top-2, std-0.2 weights and random
    norm weights, saved with ``save_pretrained``; returns the model."""
    from transformers import (Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(2)
    config_class, model_class = ((Qwen3MoeConfig, Qwen3MoeForCausalLM) if family == "qwen3_moe"
                                 else (Qwen2MoeConfig, Qwen2MoeForCausalLM))
    extra = {} if family == "qwen3_moe" else {"shared_expert_intermediate_size": SHARED}
    config = config_class(**extra, vocab_size=VOCAB, hidden_size=64, intermediate_size=80,
                            moe_intermediate_size=F, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=8, num_experts=E,
                            num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
                            max_position_embeddings=128, rms_norm_eps=1e-6,
                            tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    return save_random_hf(model_class, config, folder)


FAMILY_FLAGS = {"qwen3_moe": ["--qk-layernorm"],
                "qwen2_moe": ["--add-qkv-bias", "--moe-shared-expert-intermediate-size", str(SHARED),
                              "--moe-shared-expert-gate"]}

FAMILY_PRINTED = {"qwen3_moe": ["--qk-layernorm"],
                  "qwen2_moe": ["--add-qkv-bias", f"--moe-shared-expert-intermediate-size {SHARED} "
                                "--moe-shared-expert-gate"]}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen_moe_logits_round_trip_and_first_loss(family, norm_topk_prob, tmp_path, capsys):
    """Qwen3-MoE and Qwen2-MoE: logits equal transformers' at TP1 and PP2 (Qwen2-MoE also TP2),
    the printed flags carry the family's flags (and --moe-router-pre-softmax for
    norm_topk_prob=False), the first loss equals transformers', and HF -> ours (PP2) -> HF is
    bitwise."""
    folder = str(tmp_path / "hf")
    model = make_qwen_moe(folder, family, norm_topk_prob)
    tokens, expected = reference_logits(model, VOCAB)
    layouts = [(1, 1), (1, 2)] + ([(2, 1)] if family == "qwen2_moe" else [])
    for tp, pp in layouts:
        out = tmp_path / f"pp{pp}" if tp == 1 else tmp_path / "tp2"
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir", out,
                "--target-pipeline-parallel-size", pp, "--target-tensor-parallel-size", tp)
        printed = capsys.readouterr().out
        assert all(f in printed for f in FAMILY_PRINTED[family]), printed
        assert ("--moe-router-pre-softmax" in printed) == (not norm_topk_prob)
        logits = megatron_logits(str(out), tp, pp, tokens)[..., :VOCAB]
        assert expected.abs().max() > 1.0
        assert (logits - expected).abs().max().item() <= 3e-5  # measured <= 5.3e-6
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "pp2", "--save-dir",
            tmp_path / "back")
    original, exported = _safetensors(folder), _safetensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    reloaded = type(model).from_pretrained(str(tmp_path / "back")).eval()
    assert reloaded.config.norm_topk_prob == norm_topk_prob
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)
    prefix = str(tmp_path / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    argv = TRAIN_FLAGS + ["--load", str(tmp_path / "pp1"), "--data-path", prefix,
                          "--data-cache-path", str(tmp_path / "cache")] + FAMILY_FLAGS[family]
    argv += [] if norm_topk_prob else ["--moe-router-pre-softmax"]
    history = run_distributed(1, _train, argv, timeout=300)[-1]
    labels = torch.cat([doc[1:], doc[:1]])
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(doc[None]).logits[0], labels).item()
    assert abs(history["lm loss"][0] - hf_loss) < 1e-5, (history["lm loss"], hf_loss)


def make_olmoe(folder: str):
    """A random fp32 OLMoE (q/k RMSNorm over the whole projection: q_norm [64], k_norm [16]),
    8 heads in 2 groups, 4 experts of width 48, top-2 without renormalisation
    (``norm_topk_prob`` False, OLMoE's), std-0.2 weights, saved with ``save_pretrained``."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(6)
    config = OlmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=F, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, num_experts=E,
                         num_experts_per_tok=K, norm_topk_prob=False, max_position_embeddings=128,
                         rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    return save_random_hf(OlmoeForCausalLM, config, folder)


def test_olmoe_logits_round_trip_and_first_loss(tmp_path, capsys):
    """OLMoE: logits equal transformers' at TP1, PP2 and EP2; the printed flags carry
    --qk-layernorm --qk-layernorm-full-width and --moe-router-pre-softmax; HF -> ours
    (PP2 x EP2) -> HF is bitwise and reloads as OLMoE; the first loss equals transformers';
    TP > 1: tests/e2e/tools/test_convert_olmoe_tp.py."""
    folder = str(tmp_path / "hf")
    model = make_olmoe(folder)
    tokens, expected = reference_logits(model, VOCAB)
    for tp, pp, ep in ((1, 1, 1), (1, 2, 1), (1, 1, 2)):
        out = tmp_path / f"pp{pp}ep{ep}"
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir", out,
                "--target-pipeline-parallel-size", pp, "--target-expert-parallel-size", ep)
        printed = capsys.readouterr().out
        assert "--qk-layernorm --qk-layernorm-full-width" in printed, printed
        assert "--moe-router-pre-softmax" in printed
        logits = megatron_logits(str(out), tp, pp, tokens, ep)[..., :VOCAB]
        assert expected.abs().max() > 1.0
        assert (logits - expected).abs().max().item() <= 3e-5
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "pp2ep2", "--target-pipeline-parallel-size", 2,
            "--target-expert-parallel-size", 2)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "pp2ep2",
            "--save-dir", tmp_path / "back")
    original, exported = _safetensors(folder), _safetensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(reloaded).__name__ == "OlmoeForCausalLM" and not reloaded.config.norm_topk_prob
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)
    prefix = str(tmp_path / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    argv = TRAIN_FLAGS + ["--load", str(tmp_path / "pp1ep1"), "--data-path", prefix,
                          "--data-cache-path", str(tmp_path / "cache"), "--qk-layernorm",
                          "--qk-layernorm-full-width", "--moe-router-pre-softmax"]
    history = run_distributed(1, _train, argv, timeout=300)[-1]
    labels = torch.cat([doc[1:], doc[:1]])
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(doc[None]).logits[0], labels).item()
    assert abs(history["lm loss"][0] - hf_loss) < 1e-5, (history["lm loss"], hf_loss)


@pytest.mark.parametrize("flags,message", [
    (dict(qk_layernorm_full_width=True), "--qk-layernorm-full-width needs --qk-layernorm")])
def test_full_width_qk_layernorm_without_qk_layernorm_is_refused_naming_the_flag(flags, message):
    from megatron.config import ModelConfig
    from megatron.model.attention import SelfAttention

    config = ModelConfig(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                         num_query_groups=2, kv_channels=8, padded_vocab_size=256,
                         max_position_embeddings=64, **flags)
    with pytest.raises(ValueError, match=message):
        SelfAttention(config, 1, pg_collection=None)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_whole_workflow_hub_to_training_at_ep2_and_back(precision, tmp_path):
    """The user's way, in fp32 and bf16: a Hub Mixtral -> convert.py at EP 2 -> pretrain_llama.py
    --load ... --finetune [--bf16] at --expert-model-parallel-size 2, three Adam steps -> export
    -> transformers' ``from_pretrained`` and greedy ``generate`` on it. In fp32 our logits of the
    trained checkpoint equal transformers' logits of the export, which moved away from the
    source's."""
    folder = str(tmp_path / "hub")
    model = make_mixtral(folder)
    tokens, before = reference_logits(model, VOCAB)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ours", "--target-expert-parallel-size", 2)
    prefix = str(tmp_path / "data")
    one_document_dataset(prefix, SEQ, VOCAB)
    argv = TRAIN_FLAGS + ["--load", str(tmp_path / "ours"), "--data-path", prefix,
                          "--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "run"),
                          "--expert-model-parallel-size", "2", "--global-batch-size", "2",
                          "--train-iters", "3", "--lr", "0.001", "--min-lr", "0.001"]
    argv += ["--bf16"] if precision == "bf16" else []
    history = run_distributed(2, _train, argv, timeout=600)[-1]
    losses = history["lm loss"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "run", "--save-dir",
            tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert type(exported).__name__ == "MixtralForCausalLM"
    expected_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert exported.model.embed_tokens.weight.dtype == expected_dtype
    with torch.no_grad():
        out = exported.generate(tokens[:1, :8], max_new_tokens=8, do_sample=False)
        after = exported(tokens).logits.float()
    assert out.shape == (1, 16) and torch.equal(out[:, :8], tokens[:1, :8])
    assert int(out.max()) < VOCAB
    assert (after - before).abs().max() > 1e-3  # the three steps changed the model
    if precision == "fp32":
        ours = megatron_logits(str(tmp_path / "run"), 1, 1, tokens, 2)[..., :VOCAB]
        assert (ours - after).abs().max().item() <= 3e-5

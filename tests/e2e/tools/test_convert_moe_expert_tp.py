"""``--target-expert-tensor-parallel-size``: MoE checkpoints whose experts are split over the
tensor ranks (expert-TP = TP, Megatron-Core's default), as the training code splits them:
tensor rank t's ``weight1 [E/EP, 2f/TP, h]`` = ``[gate rows t; up rows t]`` and ``weight2
[E/EP, h, f/TP]`` = columns t. Checked against transformers (logits, first training loss), the
Hub's own tensors (each shard's slices) and the round trip (bitwise)."""

import os

import pytest
import torch

from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file
from tests.e2e.tools.test_convert_moe import (E, F, SEQ, TRAIN_FLAGS, VOCAB, _train,
                                              make_mixtral, make_qwen_moe)
from tests.helpers.convert import (convert, megatron_logits, one_document_dataset,
                                   reference_logits, safetensors_tensors)
from tests.helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mixtral_etp"))
    model = make_mixtral(folder)
    return (folder, model) + reference_logits(model, VOCAB)


def _to_etp2(folder, out, capsys, pp=1):
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir", out,
            "--target-tensor-parallel-size", 2, "--target-expert-parallel-size", 2,
            "--target-pipeline-parallel-size", pp, "--target-expert-tensor-parallel-size", 2)
    return capsys.readouterr().out


def test_shards_hold_the_training_split_and_logits_equal_transformers(mixtral, tmp_path, capsys):
    """TP2 x EP2 at expert-TP 2: shard (t, e) holds experts 2e, 2e+1 with rows t of gate and of
    up and columns t of down (the Hub's tensors sliced here); loaded in a TP2 x EP2 x expert-TP 2
    world, the logits equal transformers'."""
    folder, _, tokens, expected = mixtral
    printed = _to_etp2(folder, tmp_path / "ckpt", capsys)
    assert "--sequence-parallel --expert-tensor-parallel-size 2 --expert-model-parallel-size 2" \
        in printed, printed
    hf = safetensors_tensors(folder)
    release = tmp_path / "ckpt" / "release"
    half = F // 2
    for t in range(2):
        for e in range(2):
            shard = load_torch_file(str(release / f"mp_rank_{t:02d}_{e:03d}" /
                                        "model_optim_rng.pt"), what="shard")
            assert shard["args"]["expert_tensor_parallel_size"] == 2
            w1 = shard["model"]["layers.1.mlp.experts.weight1"]
            w2 = shard["model"]["layers.1.mlp.experts.weight2"]
            assert w1.shape == (E // 2, F, 64) and w2.shape == (E // 2, 64, half)
            for i in range(E // 2):
                name = f"model.layers.1.block_sparse_moe.experts.{e * E // 2 + i}."
                rows = slice(t * half, (t + 1) * half)
                assert torch.equal(w1[i, :half], hf[name + "w1.weight"][rows])
                assert torch.equal(w1[i, half:], hf[name + "w3.weight"][rows])
                assert torch.equal(w2[i], hf[name + "w2.weight"][:, rows])
    logits = megatron_logits(str(tmp_path / "ckpt"), 2, 1, tokens, ep=2, etp=2)[..., :VOCAB]
    assert expected.abs().max() > 1.0
    diff = (logits - expected).abs().max().item()
    assert diff <= 3e-5, diff  # measured 7.3e-6 of logits up to 7


def test_round_trip_through_tp2_ep2_pp2_expert_tp2_is_bitwise(mixtral, tmp_path, capsys):
    folder = mixtral[0]
    _to_etp2(folder, tmp_path / "a", capsys, pp=2)
    assert len(os.listdir(tmp_path / "a" / "release")) == 8
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "a", "--save-dir",
            tmp_path / "hf")
    hf, exported = safetensors_tensors(folder), safetensors_tensors(tmp_path / "hf")
    assert sorted(hf) == sorted(exported)
    for name, tensor in hf.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_first_training_loss_equals_transformers_and_training_checkpoint_exports(
        mixtral, tmp_path, capsys):
    """pretrain_llama.py --load at the printed TP2 x EP2 x expert-TP 2 layout (4 ranks: the two
    data-parallel pairs each hold two experts, every rank a half of each): the first loss is
    transformers' on the same document; the training run's own checkpoint (which the training
    code writes at expert-TP 2) exports back bitwise through --loader megatron."""
    folder, model, _, _ = mixtral
    printed = _to_etp2(folder, tmp_path / "ours", capsys).split()
    layout = printed[printed.index("--tensor-model-parallel-size"):printed.index("--load")]
    prefix = str(tmp_path / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    argv = TRAIN_FLAGS + ["--load", str(tmp_path / "ours"), "--data-path", prefix,
                          "--data-cache-path", str(tmp_path / "cache"),
                          "--save", str(tmp_path / "run"), "--global-batch-size", "2"] + layout
    history = run_distributed(4, _train, argv, timeout=600)[-1]
    labels = torch.cat([doc[1:], doc[:1]])
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(doc[None]).logits[0], labels).item()
    assert abs(history["lm loss"][0] - hf_loss) < 1e-5, (history["lm loss"], hf_loss)
    saved = load_torch_file(str(tmp_path / "run" / "iter_0000001" / "mp_rank_01_001" /
                                "model_optim_rng.pt"), what="shard")
    assert saved["model"]["layers.0.mlp.experts.weight2"].shape == (E // 2, 64, F // 2)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "run",
            "--save-dir", tmp_path / "back")
    original, exported = safetensors_tensors(folder), safetensors_tensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_qwen3_moe_logits_at_tp2_ep2_expert_tp2(tmp_path, capsys):
    """Qwen3-MoE (q/k norm per head) at TP2 x EP2 x expert-TP 2: transformers' logits, and the
    round trip bitwise."""
    folder = str(tmp_path / "hf")
    model = make_qwen_moe(folder, "qwen3_moe", True)
    tokens, expected = reference_logits(model, VOCAB)
    _to_etp2(folder, tmp_path / "ckpt", capsys)
    logits = megatron_logits(str(tmp_path / "ckpt"), 2, 1, tokens, ep=2, etp=2)[..., :VOCAB]
    assert expected.abs().max() > 1.0
    assert (logits - expected).abs().max().item() <= 3e-5
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "ckpt",
            "--save-dir", tmp_path / "back")
    original, exported = safetensors_tensors(folder), safetensors_tensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


@pytest.mark.parametrize("flags,message", [
    (["--target-tensor-parallel-size", 2, "--target-expert-tensor-parallel-size", 4],
     "only 1 or the target tensor-parallel size"),
    (["--target-expert-tensor-parallel-size", 2], "only 1 or the target tensor-parallel size"),
    (["--target-tensor-parallel-size", 2, "--target-expert-tensor-parallel-size", 2,
      "--target-ckpt-format", "torch_dist"], "drop --target-tensor-parallel-size, "
                                             "--target-expert-tensor-parallel-size"),
])
def test_unsupported_expert_tp_is_refused_in_one_line(mixtral, tmp_path, capsys, flags, message):
    from tools.checkpoint.convert import command

    assert command(["--loader", "hf", "--saver", "megatron", "--load-dir", mixtral[0],
                    "--save-dir", str(tmp_path / "x")] + [str(f) for f in flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not os.path.exists(tmp_path / "x" / "release")


def test_missing_expert_tp_folder_is_refused_naming_it(mixtral, tmp_path, capsys):
    """At expert-TP 2 another tensor rank's folder holds other slices: a missing (t, e) folder
    stops the loader, naming it."""
    import shutil

    from megatron.checkpointing import CheckpointError

    _to_etp2(mixtral[0], tmp_path / "a", capsys)
    shutil.rmtree(tmp_path / "a" / "release" / "mp_rank_01_000")
    with pytest.raises(CheckpointError, match="mp_rank_01_000"):
        convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "a",
                "--save-dir", tmp_path / "hf")


def test_loader_refuses_a_recorded_expert_tp_other_than_1_and_tp(mixtral, tmp_path, capsys):
    """Shards whose args record expert-TP 4 at TP 2 (not a split the legacy format holds) stop
    the loader in one line naming the recorded flag."""
    from tools.checkpoint.convert import command

    _to_etp2(mixtral[0], tmp_path / "a", capsys)
    for shard in (tmp_path / "a" / "release").glob("mp_rank_*/model_optim_rng.pt"):
        state = load_torch_file(str(shard), what="shard")
        state["args"]["expert_tensor_parallel_size"] = 4
        torch.save(state, shard)
    assert command(["--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / "a"),
                    "--save-dir", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--expert-tensor-parallel-size 4" in err[0], err


def test_a_training_checkpoint_of_whole_experts_at_another_expert_tp_exports(
        mixtral, tmp_path, capsys):
    """A run at expert-TP 2 with TP 1 (two data-parallel ranks, each half of every expert) saves
    whole experts in the legacy format (gathered over expert-TP, recorded as
    ``expert_tensor_slice [0, 1]``); the converter reads them as expert-TP 1 and exports them
    bitwise (lr 0). Before: refused as "expert-TP 2 at TP 1"."""
    folder = mixtral[0]
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ours")
    capsys.readouterr()
    prefix = str(tmp_path / "data")
    one_document_dataset(prefix, SEQ, VOCAB)
    argv = TRAIN_FLAGS + ["--load", str(tmp_path / "ours"), "--data-path", prefix,
                          "--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "run"),
                          "--global-batch-size", "2", "--expert-tensor-parallel-size", "2",
                          "--use-distributed-optimizer"]
    run_distributed(2, _train, argv, timeout=600)
    saved = load_torch_file(str(tmp_path / "run" / "iter_0000001" / "mp_rank_00" /
                                "model_optim_rng.pt"), what="shard")
    assert saved["args"]["expert_tensor_parallel_size"] == 2 and saved["expert_tensor_slice"] == [0, 1]
    assert saved["model"]["layers.0.mlp.experts.weight2"].shape == (E, 64, F)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "run",
            "--save-dir", tmp_path / "back")
    original, exported = safetensors_tensors(folder), safetensors_tensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)

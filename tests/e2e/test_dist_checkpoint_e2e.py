"""``--ckpt-format torch_dist`` end to end: pretrain_llama.main() in CPU worlds.

A checkpoint saved at iteration 5 at TP=2 PP=2 DP=2 with the distributed optimizer continues at
TP=1 PP=4 DP=2, TP=2 PP=1 DP=4 (plain optimizer), with virtual stages, and in one process: every
resumed loss, grad norm and validation loss equals the run at that layout trained from the start
(losses rtol 1e-6, grad norms 1e-5, dropout 0; the Adam moments carried over, or the losses
would differ). Legacy and
torch_dist checkpoints load into each other (directly, and with --ckpt-convert-format); the HF
export of a torch_dist checkpoint is the legacy one's; --async-save and bf16 resume exactly; a
reader of the latest checkpoint is unaffected by a newer one half written.
"""

import os
import threading
import time

import numpy as np
import pytest
import torch

from megatron import checkpointing as ckpt
from megatron.checkpointing import torch_dist
from megatron.core.dist_checkpointing import read_metadata, tensor_shapes
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import UNTIED, e2e_argv, layout_args, run_many

TORCH_DIST = ["--ckpt-format", "torch_dist"]
DISTOPT = ["--use-distributed-optimizer"]
VP2 = ["--num-layers-per-virtual-pipeline-stage", "1"]
FIRST_HALF = ["--save-interval", "5", "--exit-interval", "5"]


def _argv(data_prefix, cache, *extra):
    """The small model's 10 iterations, validation at 5 and 10 on one batch (its losses are
    compared, not averaged over more)."""
    return e2e_argv(data_prefix, cache, "--eval-iters", "1", *extra)


# New layouts (8 ranks) for the checkpoint saved at TP=2 PP=2 DP=2 with the distributed optimizer.
NEW_LAYOUTS = {"TP=1 PP=4 DP=2": [*layout_args(1, 4), *DISTOPT],
               "TP=2 PP=1 DP=4 plain optimizer": layout_args(2, 1),
               "TP=2 PP=2 x2 virtual DP=2": [*layout_args(2, 2), *VP2, *DISTOPT]}


def assert_resumed_like_uninterrupted(resumed, whole, name, rtol=1e-6):
    """Losses at ``rtol``; grad norms (a sum of squares over every element, more sensitive to
    the order of fp32 sums that differs between layouts) at the layout tests' 1e-5."""
    assert resumed["iteration"] == [6, 7, 8, 9, 10], name
    np.testing.assert_allclose(resumed["lm loss"], whole["lm loss"][5:], rtol=rtol,
                               err_msg=f"{name}: lm loss")
    np.testing.assert_allclose(resumed["grad norm"], whole["grad norm"][5:], rtol=1e-5,
                               err_msg=f"{name}: grad norm")
    np.testing.assert_allclose([v for it, v in resumed["valid"]],
                               [v for it, v in whole["valid"] if it > 5], rtol=rtol,
                               err_msg=f"{name}: validation loss")


@pytest.fixture(scope="module")
def saved_at_2x2x2(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("dist_cache"))
    save = str(tmp_path_factory.mktemp("dist_ckpt") / "ckpt")
    runs = [("first half", _argv(data_prefix, cache, *UNTIED, *layout_args(2, 2), *DISTOPT,
                                    *TORCH_DIST, "--save", save, *FIRST_HALF))]
    for name, layout in NEW_LAYOUTS.items():
        runs.append((f"{name} resumed", _argv(data_prefix, cache, *UNTIED, *layout, "--load", save)))
        runs.append((f"{name} whole", _argv(data_prefix, cache, *UNTIED, *layout)))
    return run_distributed(8, run_many, runs, timeout=600)[7], save, cache


def test_saved_at_2x2x2_resumes_at_other_layouts_as_uninterrupted(saved_at_2x2x2):
    out, save, _ = saved_at_2x2x2
    folder = os.path.join(save, "iter_0000005")
    assert sorted(os.listdir(folder)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(8)] + [
        "common.pt", "metadata.json"]
    common = torch_dist.read_common(folder)
    assert common["iteration"] == 5 and common["layout"] == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "data_parallel_size": 2, "virtual_pipeline_model_parallel_size": None,
        "use_distributed_optimizer": True}
    assert common["optimizer"]["step"] == 5 and common["true_vocab_size"] == 128
    for name in NEW_LAYOUTS:
        assert_resumed_like_uninterrupted(out[f"{name} resumed"], out[f"{name} whole"], name)


def test_resumes_in_one_process_and_converts_to_legacy_and_hf(saved_at_2x2x2, data_prefix,
                                                              tmp_path):
    _, save, cache = saved_at_2x2x2
    converted = str(tmp_path / "converted")
    runs = [("resumed", _argv(data_prefix, cache, *UNTIED, "--load", save)),
            ("whole", _argv(data_prefix, cache, *UNTIED)),
            ("convert", _argv(data_prefix, cache, *UNTIED, "--load", save,
                                 "--ckpt-convert-format", "torch",
                                 "--ckpt-convert-save", converted)),
            ("legacy resumed", _argv(data_prefix, cache, *UNTIED, "--load",
                                        os.path.join(converted, "torch")))]
    out = run_distributed(1, run_many, runs, timeout=600)[0]
    assert_resumed_like_uninterrupted(out["resumed"], out["whole"], "TP=1 PP=1 DP=1")
    assert out["convert"]["iteration"] == []  # converted and stopped without training
    assert sorted(os.listdir(os.path.join(converted, "torch", "iter_0000005"))) == ["mp_rank_00"]
    # Converted in one process from the distributed optimizer's state: the same training.
    assert out["legacy resumed"]["lm loss"] == out["resumed"]["lm loss"]
    assert out["legacy resumed"]["grad norm"] == out["resumed"]["grad norm"]

    from safetensors.torch import load_file
    from tests.helpers.convert import convert

    for source, name in ((save, "hf_dist"), (os.path.join(converted, "torch"), "hf_legacy")):
        convert("--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
                source, "--save-dir", tmp_path / name)
    dist_hf = load_file(str(tmp_path / "hf_dist" / "model.safetensors"))
    legacy_hf = load_file(str(tmp_path / "hf_legacy" / "model.safetensors"))
    assert sorted(dist_hf) == sorted(legacy_hf) and len(dist_hf) == 3 + 4 * 9
    assert all(dist_hf[k].equal(legacy_hf[k]) for k in dist_hf)
    assert dist_hf["model.embed_tokens.weight"].shape[0] == 128  # the true vocabulary

    # Inference (tools/generate.py's loader) reads torch_dist at a layout it was not saved at.
    from tests.helpers.convert import megatron_logits, tokens_batch

    tokens = tokens_batch(b=1, s=16, vocab=127)
    at_tp2 = megatron_logits(save, 2, 1, tokens)
    legacy = megatron_logits(os.path.join(converted, "torch"), 1, 1, tokens)
    torch.testing.assert_close(at_tp2, legacy, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def two_ranks(data_prefix, tmp_path_factory):
    """Legacy <-> torch_dist, --async-save and bf16 runs in one 2-rank world."""
    cache = str(tmp_path_factory.mktemp("dist2_cache"))
    root = tmp_path_factory.mktemp("dist2")
    legacy, to_dist = str(root / "legacy"), str(root / "to_dist")
    asynchronous, bf16 = str(root / "async"), str(root / "bf16")
    tp2, pp2 = [*UNTIED, *layout_args(2, 1)], [*UNTIED, *layout_args(1, 2)]
    runs = [
        ("TP2 whole", _argv(data_prefix, cache, *tp2)),
        ("PP2 whole", _argv(data_prefix, cache, *pp2)),
        ("legacy first half", _argv(data_prefix, cache, *tp2, "--save", legacy, *FIRST_HALF)),
        # A legacy checkpoint into a torch_dist run (same layout), which then saves torch_dist.
        ("legacy into torch_dist", _argv(data_prefix, cache, *tp2, *TORCH_DIST, "--load",
                                            legacy, "--save", to_dist)),
        ("convert to torch_dist", _argv(data_prefix, cache, *tp2, "--load", legacy,
                                           "--ckpt-convert-format", "torch_dist",
                                           "--ckpt-convert-save", str(root / "converted"))),
        ("converted at PP2", _argv(data_prefix, cache, *pp2, "--load",
                                      str(root / "converted" / "torch_dist"))),
        # Saves at 2 and 4 (published at a later iteration), 5 (at the exit).
        ("async first half", _argv(data_prefix, cache, *tp2, *TORCH_DIST, "--async-save",
                                      "--save", asynchronous, "--save-interval", "2",
                                      "--exit-interval", "5", "--keep-last-checkpoints", "2")),
        ("async second half", _argv(data_prefix, cache, *tp2, "--load", asynchronous)),
        ("bf16 whole", _argv(data_prefix, cache, *UNTIED, *DISTOPT, "--bf16")),
        ("bf16 first half", _argv(data_prefix, cache, *UNTIED, *DISTOPT, "--bf16", *TORCH_DIST,
                                     "--save", bf16, *FIRST_HALF)),
        ("bf16 second half", _argv(data_prefix, cache, *UNTIED, *DISTOPT, "--bf16", "--load",
                                      bf16)),
    ]
    return run_distributed(2, run_many, runs, timeout=600)[1], root


def test_legacy_and_torch_dist_load_into_each_other(two_ranks):
    out, root = two_ranks
    whole = out["TP2 whole"]
    first, continued = out["legacy first half"], out["legacy into torch_dist"]
    assert first["lm loss"] + continued["lm loss"] == whole["lm loss"]  # same layout: exactly
    assert ckpt.find_checkpoint(str(root / "to_dist")) == (10, False)
    assert torch_dist.is_torch_dist_checkpoint(str(root / "to_dist" / "iter_0000010"))
    assert out["convert to torch_dist"]["iteration"] == []
    assert_resumed_like_uninterrupted(out["converted at PP2"], out["PP2 whole"],
                                      "legacy TP=2 -> torch_dist -> PP=2")


def test_async_save_resumes_exactly_and_publishes_every_save(two_ranks):
    out, root = two_ranks
    whole = out["TP2 whole"]
    first, second = out["async first half"], out["async second half"]
    assert first["lm loss"] + second["lm loss"] == whole["lm loss"]
    assert first["grad norm"] + second["grad norm"] == whole["grad norm"]
    saved = str(root / "async")
    assert ckpt.find_checkpoint(saved) == (5, False)
    # --keep-last-checkpoints 2 after iterations 2, 4 and 5; nothing left staged
    assert sorted(os.listdir(saved)) == ["iter_0000004", "iter_0000005", ckpt.TRACKER_FILENAME]
    assert all(torch_dist.looks_complete(d) for d in ckpt.complete_checkpoints(saved))


def test_bf16_distributed_optimizer_resumes_exactly(two_ranks):
    out, root = two_ranks
    first, second, whole = out["bf16 first half"], out["bf16 second half"], out["bf16 whole"]
    assert first["lm loss"] + second["lm loss"] == whole["lm loss"]  # fp32 main params saved
    assert first["grad norm"] + second["grad norm"] == whole["grad norm"]
    shapes = tensor_shapes(read_metadata(str(root / "bf16" / "iter_0000005")))
    assert shapes["model.layers.0.self_attention.query.weight"] == ((32, 32), torch.bfloat16)
    assert shapes["optimizer.state.fp32_param.layers.0.self_attention.query.weight"] == (
        (32, 32), torch.float32)
    assert torch_dist.read_common(str(root / "bf16" / "iter_0000005"))["layout"][
        "data_parallel_size"] == 2


# Reading the latest checkpoint while a newer one is being written --------------------------------

def _train_with_a_held_write(argv, gate, marker, save):
    """Train; each rank's background write of the second checkpoint stops after its first record
    until ``gate`` exists (``marker.<rank>`` says that rank's write is held)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    import pretrain_llama

    real = fs._write_item

    def held(*args, **kwargs):
        result = real(*args, **kwargs)
        # a write after the first checkpoint is published (the tracker names it): under load
        # the reader thread may not have looked yet, so the writer decides by the tracker itself
        if os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt")):
            open(f"{marker}.{dist.get_rank()}", "w").close()
            while not os.path.exists(gate):
                time.sleep(0.05)
        return result

    fs._write_item = held
    history = pretrain_llama.main(argv)
    fs._write_item = real
    return history["iteration"]


def test_latest_checkpoint_reads_while_a_newer_one_is_written(data_prefix, tmp_path):
    save, gate, marker = str(tmp_path / "ckpt"), str(tmp_path / "gate"), str(tmp_path / "held")
    argv = e2e_argv(data_prefix, str(tmp_path / "cache"), *UNTIED, *TORCH_DIST, "--async-save",
                    "--save", save, "--save-interval", "3", "--train-iters", "6")
    seen = {}

    def reader():  # another job reading --save while the training world writes
        while not all(os.path.exists(f"{marker}.{rank}") for rank in range(2)):
            time.sleep(0.05)  # both ranks hold their writes: under load one may start late
        seen["tracker"] = ckpt.find_checkpoint(save)
        seen["staged"] = sorted(os.listdir(os.path.join(save, "iter_0000006.tmp")))
        seen["weights"] = torch_dist.read_tensors(os.path.join(save, "iter_0000003"))
        seen["complete"] = torch_dist.looks_complete(os.path.join(save, "iter_0000003"))
        open(gate, "w").close()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    iterations = run_distributed(2, _train_with_a_held_write, argv, gate, marker, save,
                                 timeout=300)
    thread.join(timeout=5)
    assert iterations[0] == [1, 2, 3, 4, 5, 6]
    assert seen["tracker"] == (3, False) and seen["complete"]
    assert seen["staged"] == ["__0_0.distcp", "__1_0.distcp"]  # no .metadata, no common.pt yet
    assert seen["weights"]["word_embeddings.weight"].shape == (128, 32)
    assert ckpt.find_checkpoint(save) == (6, False)
    assert torch_dist.looks_complete(os.path.join(save, "iter_0000006"))
    assert not os.path.exists(os.path.join(save, "iter_0000006.tmp"))

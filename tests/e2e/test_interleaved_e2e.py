"""End to end: the interleaved 1F1B schedule through pretrain_llama.main() in CPU process worlds.

With virtual pipeline stages (8 layers, tied embeddings across the first and the last chunk) the
losses and grad norms must equal the non-interleaved run of the same layout (rtol 1e-5); saving
with virtual stages writes Megatron's ``model0``/``model1`` keys and resuming reproduces the
uninterrupted run; a checkpoint of another virtual layout is refused with a clear error; the
argument rules are Megatron-LM's.
"""

import os

import pytest
import torch

from megatron.arguments import parse_args, validate_args
from megatron.model import get_virtual_layer_numbers
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import BASE, e2e_argv, assert_close_history, layout_args, run_many

LAYERS8 = ["--num-layers", "8"]


def _run_many_catching(runs, failing):
    """``run_many`` where the runs named in ``failing`` must raise: their message is returned."""
    import torch.distributed as dist

    import pretrain_llama

    out = {}
    for name, argv in runs:
        if name in failing:
            try:
                pretrain_llama.main(argv)
                out[name] = None
            except Exception as exc:  # noqa: BLE001 - the message is the result under test
                out[name] = str(exc)
                from megatron.core import parallel_state as ps
                ps.destroy_model_parallel()
        else:
            out[name] = pretrain_llama.main(argv)
        dist.barrier()
    if dist.get_rank() == dist.get_world_size() - 1:
        return out
    return {name: out[name] for name in failing}  # the other ranks: their messages only


def test_pp2_interleaved_equals_1f1b_and_resumes(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache_vp2"))
    ckpt = str(tmp_path_factory.mktemp("ckpt_vp2"))
    plain_ckpt = str(tmp_path_factory.mktemp("ckpt_plain2"))
    plain = e2e_argv(data_prefix, cache, *LAYERS8, *layout_args(1, 2))
    runs = [("pp2", plain),
            ("pp2 v2", plain + ["--num-layers-per-virtual-pipeline-stage", "2"]),
            ("first half", plain + ["--virtual-pipeline-model-parallel-size", "2", "--save", ckpt,
                                    "--save-interval", "5", "--exit-interval", "5"]),
            ("second half", plain + ["--virtual-pipeline-model-parallel-size", "2",
                                     "--load", ckpt]),
            ("other layout", plain + ["--load", ckpt]),
            ("plain half", plain + ["--save", plain_ckpt, "--save-interval", "5",
                                    "--exit-interval", "5"])]
    results = run_distributed(2, _run_many_catching, runs, {"other layout"}, timeout=600)
    out = results[1]
    assert_close_history(out["pp2 v2"], out["pp2"], "PP=2 v=2 (tied) vs PP=2")

    first, second, whole = out["first half"], out["second half"], out["pp2 v2"]
    assert first["iteration"] == [1, 2, 3, 4, 5] and second["iteration"] == [6, 7, 8, 9, 10]
    assert first["lm loss"] + second["lm loss"] == whole["lm loss"]  # exactly
    assert first["grad norm"] + second["grad norm"] == whole["grad norm"]
    path = os.path.join(ckpt, "iter_0000005", "mp_rank_00_001", "model_optim_rng.pt")
    last = torch.load(path, weights_only=True)
    assert "model" not in last and sorted(k for k in last if k.startswith("model")) == [
        "model0", "model1"]
    # Stage 1 holds virtual stages 1 and 3: layers 3-4 and 7-8 (local indices 0, 1 in each).
    assert sorted({k.split(".")[1] for k in last["model0"] if k.startswith("layers.")}) == ["0", "1"]
    assert "word_embeddings_for_head.weight" in last["model1"]  # the tied copy, last chunk only
    assert "word_embeddings_for_head.weight" not in last["model0"]

    # The lowest rank that found the mismatch prints the one line; the others exit with it.
    message = results[0]["other layout"]
    assert message is not None and "has no 'model' entry" in message
    assert "saved with --virtual-pipeline-model-parallel-size 2" in message and "convert.py" in message
    assert "this run has no virtual pipeline stages" in message and "None" not in message

    # The converter's loader reads model0/model1 in virtual-stage order: the same logical
    # tensors as the 1F1B run's checkpoint of the same iteration.
    virtual, plain_stream = _logical_tensors(ckpt), _logical_tensors(plain_ckpt)
    assert len(virtual) == len(plain_stream) == 1 + 8 + 1  # embeddings, 8 layers, final
    for (kind_v, tensors_v), (kind_p, tensors_p) in zip(virtual, plain_stream):
        assert kind_v == kind_p and tensors_v.keys() == tensors_p.keys()
        for key in tensors_v:
            torch.testing.assert_close(tensors_v[key], tensors_p[key], rtol=1e-5, atol=1e-6,
                                       msg=f"{kind_v} {key}")


def _logical_tensors(load_dir):
    """``[(kind, {name: tensor})]`` streamed by ``tools/checkpoint/loader_megatron.py``."""
    import argparse

    from tools.checkpoint.loader_megatron import load_checkpoint

    _, stream = load_checkpoint(argparse.Namespace(load_dir=load_dir, true_vocab_size=None))
    return [(kind, {k: v for k, v in payload.items() if v is not None})
            for kind, payload in stream]


def test_pp4_interleaved_equals_1f1b(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache_vp4"))
    pp4 = e2e_argv(data_prefix, cache, *LAYERS8, *layout_args(1, 4))
    runs = [("pp4", pp4), ("pp4 v2", pp4 + ["--virtual-pipeline-model-parallel-size", "2"])]
    out = run_distributed(4, run_many, runs, timeout=900)[3]
    assert_close_history(out["pp4 v2"], out["pp4"], "PP=4 v=2 vs PP=4")


@pytest.mark.slow
def test_distributed_optimizer_and_overlaps_interleaved_equal_1f1b(data_prefix,
                                                                   tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache_vp2dp2"))
    dp2 = e2e_argv(data_prefix, cache, *LAYERS8, *layout_args(1, 2), "--use-distributed-optimizer")
    vp = ["--num-layers-per-virtual-pipeline-stage", "2"]
    runs = [("pp2 dp2", dp2), ("pp2 v2 dp2", dp2 + vp),
            ("pp2 v2 dp2 overlap", dp2 + vp + ["--overlap-grad-reduce", "--overlap-param-gather"])]
    out = run_distributed(4, run_many, runs, timeout=900)[3]
    assert_close_history(out["pp2 v2 dp2"], out["pp2 dp2"], "PP=2 v=2 DP=2 distributed optimizer vs PP=2 DP=2")
    assert_close_history(out["pp2 v2 dp2 overlap"], out["pp2 dp2"], "PP=2 v=2 DP=2 with both overlaps")


def test_virtual_layer_numbers_are_megatrons_non_contiguous_assignment():
    # 8 layers, PP=4, v=2: virtual stage v * PP + p holds one contiguous block of 1 layer.
    assert [[get_virtual_layer_numbers(8, 4, p, 2, v) for v in range(2)] for p in range(4)] == [
        [[1], [5]], [[2], [6]], [[3], [7]], [[4], [8]]]
    assert get_virtual_layer_numbers(12, 2, 1, 3, 2) == [11, 12]
    with pytest.raises(ValueError, match=r"--num-layers \(8\) must be divisible by .* x "
                                         r"--virtual-pipeline-model-parallel-size \(3\)"):
        get_virtual_layer_numbers(8, 2, 0, 3, 0)


def _validate(*extra, world_size=2):
    argv = BASE + ["--data-path", "unused", "--num-layers", "8", "--pipeline-model-parallel-size",
                   "2"] + list(extra)
    return validate_args(parse_args(argv), world_size, check_files=False)


def test_virtual_size_is_derived_as_megatron_does():
    args = _validate("--num-layers-per-virtual-pipeline-stage", "2")
    assert args.virtual_pipeline_model_parallel_size == 2
    args = _validate("--virtual-pipeline-model-parallel-size", "4")
    assert args.num_layers_per_virtual_pipeline_stage == 1
    args = _validate("--num-layers-per-virtual-pipeline-stage", "1",
                     "--virtual-pipeline-model-parallel-size", "4")
    assert args.virtual_pipeline_model_parallel_size == 4
    # One chunk per stage is the plain 1F1B schedule.
    args = _validate("--num-layers-per-virtual-pipeline-stage", "4")
    assert args.virtual_pipeline_model_parallel_size is None


@pytest.mark.parametrize("extra, world_size, pattern", [
    (["--num-layers-per-virtual-pipeline-stage", "3"], 2,
     r"--num-layers-per-virtual-pipeline-stage \(3\) must divide the layers of a pipeline stage, "
     r"--num-layers \(8\) / --pipeline-model-parallel-size \(2\) = 4"),
    (["--virtual-pipeline-model-parallel-size", "3"], 2,
     r"--num-layers \(8\) must be divisible by --pipeline-model-parallel-size \(2\) x "
     r"--virtual-pipeline-model-parallel-size \(3\) = 6"),
    (["--virtual-pipeline-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"], 1,
     r"needs --pipeline-model-parallel-size > 1"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--virtual-pipeline-model-parallel-size",
      "4"], 2, r"gives 2 virtual stages per pipeline rank, but "
               r"--virtual-pipeline-model-parallel-size is 4"),
    (["--virtual-pipeline-model-parallel-size", "0"], 2,
     r"--virtual-pipeline-model-parallel-size \(0\) must be positive"),
    # 8 / (2 x DP 2) = 2 micro-batches at PP=2 is fine; 6 / (2 x 1) = 3 is not.
    (["--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "6"], 2,
     r"number of micro-batches \(3: --global-batch-size \(6\) / \(--micro-batch-size \(2\) x "
     r"data-parallel size \(1\)\)\) must be divisible by --pipeline-model-parallel-size \(2\)"),
])
def test_impossible_interleaving_is_refused_clearly(extra, world_size, pattern):
    with pytest.raises(ValueError, match=pattern):
        _validate(*extra, world_size=world_size)


def test_every_ramp_up_step_must_give_micro_batches_divisible_by_pp():
    argv = BASE + ["--data-path", "unused", "--num-layers", "8", "--pipeline-model-parallel-size",
                   "2", "--virtual-pipeline-model-parallel-size", "2"]
    for flag in ("--train-iters", "--lr-warmup-iters"):  # sample-based, as ramp-up requires
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2:]
    argv += ["--train-samples", "64", "--rampup-batch-size", "2", "2", "32"]
    with pytest.raises(ValueError, match=r"number of micro-batches \(1: the --rampup-batch-size "
                                         r"START \(2\) / .* must be divisible by "
                                         r"--pipeline-model-parallel-size \(2\)"):
        validate_args(parse_args(argv), 2, check_files=False)
    argv[-3:] = ["4", "2", "32"]  # 2, 3, 4 micro-batches: INCR gives odd counts
    with pytest.raises(ValueError, match=r"number of micro-batches \(1: the --rampup-batch-size "
                                         r"INCR \(2\)"):
        validate_args(parse_args(argv), 2, check_files=False)
    argv[-3:] = ["4", "4", "32"]
    assert validate_args(parse_args(argv), 2, check_files=False).rampup_batch_size == [4, 4, 32]

"""End to end through pretrain_llama.main() with --overlapped-distributed-optimizer and several
buckets per stage: TP=2 x DP=2 (untied) and PP=2 x DP=2 (tied embedding across stages), each with 1
and 4 micro-batches, and DP=4, equal one process with the plain optimizer (same global batch;
losses, grad norms and validation losses, rtol 1e-5; tests/e2e/test_pretrain_e2e.py proves one process
equals plain single-process math). A checkpoint saved at DP=4 resumes at DP=2 (same global batch)
and continues as the uninterrupted DP=4 run."""

import numpy as np
import pytest

from megatron.checkpointing import TRACKER_FILENAME
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import e2e_argv, assert_close_history, layout_args, run_many

ITERS = 4
SHORT = ["--train-iters", str(ITERS), "--eval-iters", "1", "--eval-interval", "2",
         "--reduce-bucket-size", "3000"]  # several buckets per stage
DISTOPT = ["--overlapped-distributed-optimizer"]
UNTIED = ["--untie-embeddings-and-output-weights"]
# global batch -> micro-batch size giving 1 (GBS 4) or 4 (GBS 8) micro-batches at DP=2.
BATCHES = {1: ["--global-batch-size", "4", "--micro-batch-size", "2"],
           4: ["--global-batch-size", "8", "--micro-batch-size", "1"]}


@pytest.fixture(scope="module")
def runs(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("distopt_cache"))
    save = tmp_path_factory.mktemp("distopt_ckpt")
    single = [(f"{tie} {mb}", e2e_argv(data_prefix, cache, *SHORT, *BATCHES[mb], *extra))
              for tie, extra in (("untied", UNTIED), ("tied", [])) for mb in (1, 4)]
    layouts = [(f"tp2 {mb}", e2e_argv(data_prefix, cache, *SHORT, *BATCHES[mb], *UNTIED, *DISTOPT,
                                   *layout_args(2, 1), "--save", str(save / f"tp2_{mb}")))
               for mb in (1, 4)]
    layouts += [(f"pp2 {mb}", e2e_argv(data_prefix, cache, *SHORT, *BATCHES[mb], *DISTOPT,
                                    *layout_args(1, 2), "--save", str(save / f"pp2_{mb}")))
                for mb in (1, 4)]
    # DP=4, 2 micro-batches; saves at iterations 2 and 4.
    layouts.append(("dp4", e2e_argv(data_prefix, cache, *SHORT, *BATCHES[4], *UNTIED, *DISTOPT,
                                 "--save", str(save / "dp4"), "--save-interval", "2")))
    out = run_distributed(1, run_many, single, timeout=600)[0]
    out.update(run_distributed(4, run_many, layouts, timeout=600)[3])
    return out, save, cache


def test_layouts_equal_one_process_with_plain_adamw(runs):
    out, save, _ = runs
    for layout, tie in (("tp2", "untied"), ("pp2", "tied")):
        for mb in (1, 4):
            assert len(out[f"{layout} {mb}"]["lm loss"]) == ITERS
            assert_close_history(out[f"{layout} {mb}"], out[f"{tie} {mb}"], f"{layout} DP=2, {mb} micro-batches")
    assert_close_history(out["dp4"], out["untied 4"], "DP=4")
    # the training loop saved one optimizer shard per data-parallel rank in every mp_rank folder
    for layout, folders in (("tp2_4", ["mp_rank_00", "mp_rank_01"]),
                            ("pp2_4", ["mp_rank_00_000", "mp_rank_00_001"])):
        for folder in folders:
            files = sorted(p.name for p in (save / layout / f"iter_{ITERS:07d}" / folder).iterdir())
            assert files == ["distrib_optim_dp_000.pt", "distrib_optim_dp_001.pt",
                             "model_optim_rng.pt"], (layout, folder, files)


def test_save_at_dp4_resume_at_dp2(runs, data_prefix):
    out, save, cache = runs
    ckpt = save / "dp4"
    assert len(list((ckpt / "iter_0000002" / "mp_rank_00").glob("distrib_optim_dp_*.pt"))) == 4
    (ckpt / TRACKER_FILENAME).write_text("2")  # resume from iteration 2, not the last save
    argv = e2e_argv(data_prefix, cache, *SHORT, *BATCHES[4], *UNTIED, *DISTOPT, "--load", str(ckpt))
    resumed = run_distributed(2, run_many, [("dp2", argv)], timeout=600)[1]["dp2"]
    whole = out["dp4"]
    assert resumed["iteration"] == [3, 4]
    np.testing.assert_allclose(resumed["lm loss"], whole["lm loss"][2:], rtol=1e-5)
    np.testing.assert_allclose(resumed["grad norm"], whole["grad norm"][2:], rtol=1e-5)

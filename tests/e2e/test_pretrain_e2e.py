"""End to end: pretrain_llama.main() on a small self-made dataset, in CPU process worlds.

Every layout (TP x PP x DP) at the same global batch must give the losses and grad norms of one
process over 20 iterations with gradient clipping active on every one of them (rtol 1e-6, dropout
0), with and without --eod-mask-loss / --calculate-per-token-loss and document masks, tied and
untied embeddings; saving at iteration 10 and resuming must reproduce the uninterrupted run's
losses exactly. Worlds are shared: each world runs several layouts in turn. Global batch 4: two
micro-batches per rank in every layout (the fewest that accumulate gradients and take 1F1B at
PP = 2 to its steady state; 1 sequence per micro-batch at DP = 2), half the work of 8.
"""

import os

import numpy as np
import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import (CLIP, LAYOUT_ITERS, LAYOUT_LR, MASKED, UNTIED,
                                    assert_close_history, e2e_argv, layout_args, one_process,
                                    run_many)

ITERS = LAYOUT_ITERS
HALF = ITERS // 2


def _argv(data_prefix, cache, *extra):
    # one validation batch per evaluation: validation losses are compared, not averaged over more
    return e2e_argv(data_prefix, cache, "--train-iters", str(ITERS), *LAYOUT_LR, "--eval-iters",
                    "1", "--global-batch-size", "4", *extra)


def _per_rank(tp, pp, world):
    """``layout_args`` and, at DP = 2, one sequence per micro-batch (two micro-batches per rank)."""
    return [*layout_args(tp, pp), *(["--micro-batch-size", "1"] if world // (tp * pp) == 2 else [])]


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache1"))
    runs = [("untied", _argv(data_prefix, cache, *UNTIED)),
            ("masked", _argv(data_prefix, cache, *UNTIED, *MASKED)),
            ("tied", _argv(data_prefix, cache))]
    return one_process(runs, timeout=600)


def test_single_process_trains(single):
    losses = single["untied"]["lm loss"]
    assert len(losses) == ITERS and all(np.isfinite(losses))
    assert abs(losses[0] - np.log(128)) < 0.3, losses[0]  # starts near uniform over the vocabulary
    assert losses[-1] < losses[0]
    valid = single["untied"]["valid"]  # every 5 iterations, then the final evaluation
    assert [it for it, _ in valid] == [5, 10, 15, 20, 20]
    assert valid[-1][1] == single["untied"]["final valid"]["lm loss"]
    assert len({v for _, v in valid}) == 5  # the validation stream moves on between evaluations
    assert single["masked"]["lm loss"] != single["untied"]["lm loss"]
    for name in ("untied", "masked", "tied"):  # clipping is active on every iteration
        assert min(single[name]["grad norm"]) > CLIP, (name, single[name]["grad norm"])


def test_two_rank_layouts_match_one_process(single, data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache2"))
    ckpt = str(tmp_path_factory.mktemp("ckpt2"))
    runs = []
    for tp, pp in ((2, 1), (1, 2), (1, 1)):  # (1, 1) on 2 ranks is DP=2
        runs.append((f"untied {tp}{pp}", _argv(data_prefix, cache, *UNTIED, *_per_rank(tp, pp, 2))))
        runs.append((f"masked {tp}{pp}", _argv(data_prefix, cache, *UNTIED, *MASKED,
                                               *_per_rank(tp, pp, 2))))
    runs.append(("tied 12", _argv(data_prefix, cache, *layout_args(1, 2))))
    runs.append(("sp selective 21", _argv(data_prefix, cache, *UNTIED, *layout_args(2, 1),
                                          "--sequence-parallel", "--recompute-activations")))
    runs.append(("full recompute 12", _argv(data_prefix, cache, *UNTIED, *layout_args(1, 2),
                                            "--recompute-granularity", "full", "--recompute-method",
                                            "block", "--recompute-num-layers", "1")))
    # Save half-way and stop, then resume from the checkpoint to the end.
    runs.append(("first half", _argv(data_prefix, cache, *UNTIED, *layout_args(1, 2), "--save", ckpt,
                                     "--save-interval", str(HALF), "--exit-interval", str(HALF))))
    runs.append(("second half", _argv(data_prefix, cache, *UNTIED, *layout_args(1, 2), "--load", ckpt)))
    out = run_distributed(2, run_many, runs, timeout=600)[1]
    for tp, pp in ((2, 1), (1, 2), (1, 1)):
        assert_close_history(out[f"untied {tp}{pp}"], single["untied"], f"TP={tp} PP={pp} DP={2 // (tp * pp)}")
        assert_close_history(out[f"masked {tp}{pp}"], single["masked"], f"masked TP={tp} PP={pp}")
    assert_close_history(out["tied 12"], single["tied"], "tied embeddings PP=2")
    assert_close_history(out["sp selective 21"], single["untied"], "TP=2 --sequence-parallel --recompute-activations")
    assert_close_history(out["full recompute 12"], single["untied"], "PP=2 full block recompute")

    first, second, whole = out["first half"], out["second half"], out["untied 12"]
    assert first["iteration"] == list(range(1, HALF + 1))
    assert second["iteration"] == list(range(HALF + 1, ITERS + 1))
    assert first["lm loss"] + second["lm loss"] == whole["lm loss"]  # exactly
    assert first["grad norm"] + second["grad norm"] == whole["grad norm"]
    assert sorted(os.listdir(os.path.join(ckpt, f"iter_{HALF:07d}"))) == ["mp_rank_00_000", "mp_rank_00_001"]


def test_tp2_pp2_dp2_matches_one_process(single, data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache8"))
    runs = [("untied", _argv(data_prefix, cache, *UNTIED, *_per_rank(2, 2, 8))),
            ("masked", _argv(data_prefix, cache, *UNTIED, *MASKED, *_per_rank(2, 2, 8)))]
    out = run_distributed(8, run_many, runs, timeout=600)[7]
    assert_close_history(out["untied"], single["untied"], "TP=2 PP=2 DP=2")
    assert_close_history(out["masked"], single["masked"], "masked TP=2 PP=2 DP=2")

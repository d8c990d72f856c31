"""End to end: the router losses' gradient scale per iteration (megatron/training/moe_loss_scale.py)
with ``--calculate-per-token-loss`` and with ``--rampup-batch-size``, each equal to one process
(losses, grad norms, validation losses and the logged router losses within rtol 1e-6; the same
tokens per expert and dropped tokens; fp32, dropout 0, clipping on every iteration) on the MoE
model of tests/e2e/test_moe_e2e.py (4 experts, top-2, load-balancing and z losses):

- per-token loss with end-of-document loss masks and document attention (``MASKED``): EP = 2
  (over DP = 2) and DP = 2 with the distributed optimizer, plain ``aux_loss`` and
  ``global_aux_loss``;
- ramp-up (2, 4, then 8 sequences per iteration: 2, 4, 8 micro-batches at DP = 1, half as many
  at DP = 2) at DP = 2 and EP = 2, with ``aux_loss`` and ``global_aux_loss``.

The per-micro-batch scale rule itself is checked against the written-out single-process gradient
in tests/unit/training/test_moe_loss_scale.py.
"""

import pytest

from tests.e2e.test_moe_e2e import MOE
from tests.e2e.test_moe_layouts_e2e import ep
from tests.e2e.test_moe_layouts_more_e2e import GLOBAL, _assert_equal_runs
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import LAYOUT_LR, MASKED, UNTIED, e2e_argv, layout_args, run_many

# 4 micro-batches of 1 sequence at DP = 1: their loss tokens differ (end-of-document masks), so
# per-token loss weighs them otherwise than the mean
SHORT = ["--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "1",
         "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "1"]
# Batches of 2, 4, then 8 sequences (one increment per 4/3 consumed samples; Megatron's
# update_train_iters: 2 ramp iterations consume 6, then (28 - 6) // 8 = 2 full batches).
RAMPUP = ["--rampup-batch-size", "2", "2", "4", "--global-batch-size", "8",
          "--train-samples", "28", "--lr-warmup-samples", "4", "--lr-decay-samples", "24",
          "--micro-batch-size", "1", "--eval-interval", "3", "--eval-iters", "1",
          "--log-interval", "1"]


def _argv(data_prefix, cache, *extra):
    return e2e_argv(data_prefix, cache, *LAYOUT_LR, *UNTIED, *MOE, *SHORT, *extra)


def _ramp_argv(data_prefix, cache, *extra):
    argv = e2e_argv(data_prefix, cache, *LAYOUT_LR, *UNTIED, *MOE)
    for flag in ("--train-iters", "--lr-warmup-iters", "--global-batch-size"):
        while flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
    return argv + RAMPUP + list(extra)


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_scale_cache1"))
    runs = [("per token", _argv(data_prefix, cache, *MASKED)),
            ("per token global", _argv(data_prefix, cache, *MASKED, *GLOBAL)),
            ("mean", _argv(data_prefix, cache, *MASKED[:1], *MASKED[2:])),
            ("ramp", _ramp_argv(data_prefix, cache)),
            ("ramp global", _ramp_argv(data_prefix, cache, *GLOBAL)),
            ("fixed 2", e2e_argv(data_prefix, cache, *LAYOUT_LR, *UNTIED, *MOE,
                                 "--train-iters", "1", "--lr-decay-iters", "4", "--global-batch-size", "2",
                                 "--micro-batch-size", "1", "--eval-iters", "0")),
            ("fixed 2 global", e2e_argv(data_prefix, cache, *LAYOUT_LR, *UNTIED, *MOE, *GLOBAL,
                                        "--train-iters", "1", "--lr-decay-iters", "4", "--global-batch-size", "2",
                                        "--micro-batch-size", "1", "--eval-iters", "0"))]
    return run_distributed(1, run_many, runs, timeout=1200)[0]


def test_per_token_loss_and_rampup_change_the_run(single):
    """The flags take effect: per-token loss weighs the micro-batches by their tokens, and the
    ramp runs 4 iterations of 2, 4, 8 and 8 sequences."""
    assert single["per token"]["lm loss"] != single["mean"]["lm loss"]
    assert "global_load_balancing_loss" in single["per token global"]
    assert single["ramp"]["iteration"] == list(range(1, 5))
    assert single["ramp"]["consumed samples"] == [2, 6, 14, 22]


def test_the_ramp_scales_the_router_losses_by_the_iterations_micro_batches(single):
    """The ramp's first iteration (2 micro-batches, the run's last ones have 8) has the gradient
    of a run whose every batch is those 2 micro-batches: the router losses' scale is the
    iteration's 1 / M, not the full batch's (else the router losses weigh 4 times less)."""
    for name in ("ramp", "ramp global"):
        ramp, fixed = single[name], single["fixed 2" if name == "ramp" else "fixed 2 global"]
        assert ramp["lm loss"][0] == fixed["lm loss"][0]
        assert abs(ramp["grad norm"][0] / fixed["grad norm"][0] - 1) < 1e-6, name


def test_per_token_loss_and_rampup_at_two_ranks_match_one_process(single, data_prefix,
                                                                  tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_scale_cache2"))
    runs = [("per token ep2", _argv(data_prefix, cache, *MASKED, *ep(2))),
            ("per token dp2 distopt", _argv(data_prefix, cache, *MASKED, *layout_args(1, 1),
                                            "--use-distributed-optimizer")),
            ("per token global ep2", _argv(data_prefix, cache, *MASKED, *GLOBAL, *ep(2))),
            ("ramp dp2", _ramp_argv(data_prefix, cache)),
            ("ramp ep2", _ramp_argv(data_prefix, cache, *ep(2))),
            ("ramp global ep2", _ramp_argv(data_prefix, cache, *GLOBAL, *ep(2)))]
    got = run_distributed(2, run_many, runs, timeout=1500)[-1]
    want = {"per token ep2": "per token", "per token dp2 distopt": "per token",
            "per token global ep2": "per token global", "ramp dp2": "ramp",
            "ramp ep2": "ramp", "ramp global ep2": "ramp global"}
    for name, _ in runs:
        _assert_equal_runs(got[name], single[want[name]], name)


def test_per_token_loss_at_ep2_over_dp4_with_the_distributed_optimizer(single, data_prefix,
                                                                       tmp_path_factory):
    """EP = 2 folded over DP = 4 (expert-DP 2) with the distributed optimizer, per-token loss
    with its masks: one micro-batch of one sequence per DP rank, each with its own loss tokens."""
    cache = str(tmp_path_factory.mktemp("moe_scale_cache4"))
    runs = [("per token ep2 dp4 distopt", _argv(data_prefix, cache, *MASKED, *ep(2),
                                                "--use-distributed-optimizer"))]
    got = run_distributed(4, run_many, runs, timeout=1200)[-1]
    _assert_equal_runs(got[runs[0][0]], single["per token"], runs[0][0])

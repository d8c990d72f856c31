"""ZeRO-2 and ZeRO-3 (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads |
optim_grads_params``) with mixture-of-experts layers (tests/e2e/test_moe_e2e.py's model: 4
experts, top-2, load-balancing and z losses, grouped GEMM). 20 iterations (fp32, dropout 0,
clipping on every iteration): losses, grad norms, validation losses and the logged router losses
equal one process within rtol 1e-6.

Default tier: at EP=2 over DP=4 under ZeRO-2 the dense gradients and optimizer state are sharded
over DP=4 and the experts' over their expert-DP of 2 (the ranks holding the same experts); a
ZeRO-3 run at that layout saved half-way with ``--ckpt-format torch_dist`` and resumed at EP=4
with the distributed optimizer continues it (the joined run equals one process). ZeRO-3 at EP=2
for 20 iterations: tests/e2e/test_llama4_layouts_e2e.py (Llama 4's MoE layers).

Slow tier (cross products whose factors the default tier covers apiece): ZeRO-3 at EP=2 over
DP=4 for 20 iterations; TP=2 (SP, expert-TP 1) x EP=2 x DP=2 under ZeRO-3 (the dense state over
DP=2, the experts' over an expert-DP of 2 that spans the tensor ranks); PP=2 x EP=2 x DP=2 and
EP=2 over CP=2 x DP=2 under ZeRO-3; ZeRO-2 with --overlap-grad-reduce."""

import numpy as np
import pytest

from tests.e2e.test_moe_layouts_e2e import HALF, SP, _argv, ep
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import (LAYOUT_ITERS, assert_close_history, cp_args, layout_args,
                                    one_process, run_many)

FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
ZERO2, ZERO3 = FSDP + ["optim_grads"], FSDP + ["optim_grads_params"]


def _assert_router_losses_match(got, one, name):
    assert_close_history(got, one, f"MoE EP=2 {name}")
    for key in ("load_balancing_loss", "z_loss"):
        np.testing.assert_allclose(got[key], one[key], rtol=1e-6, err_msg=name)


def test_moe_zero2_ep2_and_zero3_resumed_at_ep4_match_one_process(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_zero_cache"))
    ckpt = str(tmp_path_factory.mktemp("moe_zero3_ckpt"))
    one = one_process([("one", _argv(data_prefix, cache))])["one"]
    runs = [("zero2", _argv(data_prefix, cache, *ep(2), *ZERO2)),
            ("zero3 first", _argv(data_prefix, cache, *ep(2), *ZERO3, "--ckpt-format",
                                  "torch_dist", "--save", ckpt, "--save-interval", str(HALF),
                                  "--exit-interval", str(HALF))),
            ("ep4 second", _argv(data_prefix, cache, *ep(4), "--use-distributed-optimizer",
                                 "--load", ckpt))]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    _assert_router_losses_match(got["zero2"], one, "zero2")
    first, second = got["zero3 first"], got["ep4 second"]
    assert first["iteration"] == list(range(1, HALF + 1))
    assert second["iteration"] == list(range(HALF + 1, LAYOUT_ITERS + 1))
    joined = {key: first[key] + second[key] for key in ("lm loss", "grad norm", "valid")}
    assert_close_history(joined, one, "MoE ZeRO-3 EP=2 saved, resumed at EP=4")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_moe_zero3_cross_products_match_one_process(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_zero_cache"))
    one = one_process([("one", _argv(data_prefix, cache))])["one"]
    runs = [("zero3", _argv(data_prefix, cache, *ep(2), *ZERO3)),
            ("tp2 zero3", _argv(data_prefix, cache, *layout_args(2, 1), *SP, *ep(2), *ZERO3)),
            ("pp2 zero3", _argv(data_prefix, cache, *layout_args(1, 2), *ep(2), *ZERO3)),
            ("cp2 zero3", _argv(data_prefix, cache, *cp_args(2), *ep(2), *ZERO3)),
            ("zero2 overlap", _argv(data_prefix, cache, *ep(2), *ZERO2, "--overlap-grad-reduce"))]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    for name, _ in runs:
        _assert_router_losses_match(got[name], one, name)

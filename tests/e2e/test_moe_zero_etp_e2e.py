"""ZeRO-2 and ZeRO-3 (``--use-megatron-fsdp``) with the experts split over expert-TP
(``--expert-tensor-parallel-size 2``), tests/e2e/test_moe_e2e.py's mixture-of-experts model (4
experts, top-2, load-balancing and z losses, grouped GEMM), 20 iterations (fp32, dropout 0,
clipping on every iteration): losses, grad norms, validation losses and the logged router losses
equal one process within rtol 1e-6. The expert buffers hold expert-TP slices and shard over
expert-DP = TP x CP x DP / (EP x expert-TP). Layouts (4 ranks):

- TP=2 (SP) x EP=2 with expert-TP 2 (expert-DP 1) under ZeRO-3;
- TP=2 (SP), expert-TP 2, EP=1 x DP=2 (expert-DP 2: the expert state sharded) under ZeRO-2;
- TP=1 x DP=4 with expert-TP 2 (an expert-TP group across two micro-batches), EP=1 (expert-DP 2)
  under ZeRO-3, and with EP=2 (expert-DP 1) under ZeRO-2.

A ZeRO-3 run at TP=2 x EP=2 x expert-TP 2 saved half-way (``--ckpt-format torch_dist``: whole
experts on a global axis) and resumed at TP=1 x DP=4 x expert-TP 2 under ZeRO-3 continues it
(the joined run equals one process)."""

import numpy as np
import pytest

from tests.e2e.test_moe_layouts_e2e import HALF, _argv, ep
from tests.e2e.test_moe_legacy_ckpt_e2e import _joined
from tests.e2e.test_moe_zero_e2e import ZERO2, ZERO3
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import assert_close_history, layout_args, one_process, run_many

ETP2 = ["--expert-tensor-parallel-size", "2"]
TP2 = [*layout_args(2, 1), "--sequence-parallel", *ETP2]


# Slow tier: a cross product (ZeRO-2/3 x expert-TP 2, 42 to 49 s of the default suite's 4-rank
# time) whose factors the default tier covers apiece (tests/e2e/test_moe_zero_e2e.py: ZeRO-2/3
# with experts; tests/e2e/test_moe_etp_ckpt_e2e.py and test_moe_layouts_more_e2e.py: expert-TP 2).
@pytest.mark.slow
@pytest.mark.timeout(1800)  # 7 runs of 10 or 20 iterations: minutes on a loaded machine
def test_moe_zero2_zero3_at_expert_tp2_match_one_process(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_zero_etp_cache"))
    ckpt = str(tmp_path_factory.mktemp("moe_zero_etp_ckpt"))
    one = one_process([("one", _argv(data_prefix, cache))])
    one = one["one"]
    runs = [("tp2 ep2 etp2 zero3", _argv(data_prefix, cache, *TP2, *ep(2), *ZERO3)),
            ("tp2 etp2 dp2 zero2", _argv(data_prefix, cache, *TP2, *ZERO2)),
            ("tp1 etp2 dp4 zero3", _argv(data_prefix, cache, *ETP2, *ZERO3)),
            ("tp1 etp2 ep2 zero2", _argv(data_prefix, cache, *ETP2, *ep(2), *ZERO2)),
            ("zero3 first", _argv(data_prefix, cache, *TP2, *ep(2), *ZERO3, "--ckpt-format",
                                  "torch_dist", "--save", ckpt, "--save-interval", str(HALF),
                                  "--exit-interval", str(HALF))),
            ("zero3 second", _argv(data_prefix, cache, *ETP2, *ZERO3, "--ckpt-format",
                                   "torch_dist", "--load", ckpt))]
    got = run_distributed(4, run_many, runs, timeout=2400)[-1]
    for name, _ in runs[:4]:
        assert_close_history(got[name], one, f"MoE expert-TP 2 {name}")
        for key in ("load_balancing_loss", "z_loss"):
            np.testing.assert_allclose(got[name][key], one[key], rtol=1e-6, err_msg=name)
    assert_close_history(_joined(got["zero3 first"], got["zero3 second"]), one,
                         "MoE ZeRO-3 TP=2 x EP=2 x expert-TP 2 saved, resumed at TP=1 x DP=4 x "
                         "expert-TP 2")

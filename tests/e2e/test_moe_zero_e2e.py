"""ZeRO-2 and ZeRO-3 (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads |
optim_grads_params``) with mixture-of-experts layers (tests/e2e/test_moe_e2e.py's model: 4
experts, top-2, load-balancing and z losses, grouped GEMM): at EP=2 over DP=4 the dense
parameters, gradients and optimizer state are sharded over DP=4 and the experts' over their
expert-DP of 2 (the ranks holding the same experts); at TP=2 (SP, expert-TP 1) x EP=2 x DP=2
under ZeRO-3 the dense state over DP=2 and the experts' over an expert-DP of 2 that spans the
tensor ranks; PP=2 x EP=2 x DP=2 and EP=2 over CP=2 x DP=2 under ZeRO-3; ZeRO-2 with --overlap-grad-reduce. 20 iterations (fp32, dropout 0, clipping on every iteration): losses, grad norms,
validation losses and the logged router losses equal one process within rtol 1e-6. A ZeRO-3 run
saved half-way with ``--ckpt-format torch_dist`` and resumed at EP=4 with the distributed
optimizer continues it (the joined run equals one process)."""

import numpy as np

from tests.e2e.test_moe_layouts_e2e import HALF, SP, _argv, ep
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import (LAYOUT_ITERS, assert_close_history, cp_args, layout_args,
                                    one_process, run_many)

FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
ZERO2, ZERO3 = FSDP + ["optim_grads"], FSDP + ["optim_grads_params"]


def test_moe_zero2_zero3_ep2_match_one_process(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_zero_cache"))
    ckpt = str(tmp_path_factory.mktemp("moe_zero3_ckpt"))
    one = one_process([("one", _argv(data_prefix, cache))])
    one = one["one"]
    runs = [("zero2", _argv(data_prefix, cache, *ep(2), *ZERO2)),
            ("zero3", _argv(data_prefix, cache, *ep(2), *ZERO3)),
            ("tp2 zero3", _argv(data_prefix, cache, *layout_args(2, 1), *SP, *ep(2), *ZERO3)),
            ("pp2 zero3", _argv(data_prefix, cache, *layout_args(1, 2), *ep(2), *ZERO3)),
            ("cp2 zero3", _argv(data_prefix, cache, *cp_args(2), *ep(2), *ZERO3)),
            ("zero2 overlap", _argv(data_prefix, cache, *ep(2), *ZERO2, "--overlap-grad-reduce")),
            ("zero3 first", _argv(data_prefix, cache, *ep(2), *ZERO3, "--ckpt-format",
                                  "torch_dist", "--save", ckpt, "--save-interval", str(HALF),
                                  "--exit-interval", str(HALF))),
            ("ep4 second", _argv(data_prefix, cache, *ep(4), "--use-distributed-optimizer",
                                 "--load", ckpt))]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    for name in ("zero2", "zero3", "tp2 zero3", "pp2 zero3", "cp2 zero3", "zero2 overlap"):
        assert_close_history(got[name], one, f"MoE EP=2 {name}")
        for key in ("load_balancing_loss", "z_loss"):
            np.testing.assert_allclose(got[name][key], one[key], rtol=1e-6, err_msg=name)
    first, second = got["zero3 first"], got["ep4 second"]
    assert second["iteration"] == list(range(HALF + 1, LAYOUT_ITERS + 1))
    joined = {key: first[key] + second[key] for key in ("lm loss", "grad norm", "valid")}
    assert_close_history(joined, one, "MoE ZeRO-3 EP=2 saved, resumed at EP=4")

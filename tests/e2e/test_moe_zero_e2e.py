"""ZeRO-2 and ZeRO-3 (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads |
optim_grads_params``) with mixture-of-experts layers (tests/e2e/test_moe_e2e.py's model: 4
experts, top-2, load-balancing and z losses, grouped GEMM): at EP=2 over DP=4 the dense
parameters, gradients and optimizer state are sharded over DP=4 and the experts' over their
expert-DP of 2 (the ranks holding the same experts). 20 iterations (fp32, dropout 0, clipping on
every iteration): losses, grad norms, validation losses and the logged router losses equal one
process within rtol 1e-6."""

import numpy as np

from tests.e2e.test_moe_layouts_e2e import _argv, ep
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import assert_close_history, run_many

FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]


def test_moe_zero2_zero3_ep2_match_one_process(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_zero_cache"))
    one = run_distributed(1, run_many, [("one", _argv(data_prefix, cache))], timeout=900)[0]
    runs = [(name, _argv(data_prefix, cache, *ep(2), *FSDP, strategy))
            for name, strategy in (("zero2", "optim_grads"), ("zero3", "optim_grads_params"))]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    for name, _ in runs:
        assert_close_history(got[name], one["one"], f"MoE EP=2 x DP=4 {name}")
        for key in ("load_balancing_loss", "z_loss"):
            np.testing.assert_allclose(got[name][key], one["one"][key], rtol=1e-6, err_msg=name)

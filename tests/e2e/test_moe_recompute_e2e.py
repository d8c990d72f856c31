"""End to end: selective recompute inside the MoE layers (``--recompute-modules moe_act
shared_experts``, and ``moe``; Megatron-Core's names) trains as without recompute: one process
and EP = 2 (over DP = 2) give the plain one-process run's losses, grad norms, validation losses,
logged router losses and routing counts (3 iterations of 2 micro-batches, the model of
tests/e2e/test_moe_e2e.py with a gated shared expert; the bitwise and byte-exact checks of each
module are in tests/unit/core/transformer/moe/test_moe_recompute.py)."""

import pytest

from tests.e2e.test_moe_layouts_e2e import ep
from tests.e2e.test_moe_layouts_more_e2e import SELECTIVE, _argv, _assert_equal_runs
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import run_many

SHARED = ["--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate"]
RUNS = {"moe_act shared_experts": [*SELECTIVE, "--recompute-modules", "moe_act",
                                   "shared_experts", "core_attn"],
        "moe": [*SELECTIVE, "--recompute-modules", "moe", "layernorm"]}


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_recompute_cache1"))
    runs = [("plain", _argv(data_prefix, cache, *SHARED))]
    runs += [(name, _argv(data_prefix, cache, *SHARED, *flags)) for name, flags in RUNS.items()]
    return run_distributed(1, run_many, runs, timeout=900)[0]


def test_moe_recompute_modules_equal_no_recompute(single, data_prefix, tmp_path_factory):
    for name in RUNS:
        _assert_equal_runs(single[name], single["plain"], name)
    cache = str(tmp_path_factory.mktemp("moe_recompute_cache2"))
    runs = [(f"ep2 {name}", _argv(data_prefix, cache, *SHARED, *flags, *ep(2)))
            for name, flags in RUNS.items()]
    got = run_distributed(2, run_many, runs, timeout=900)[-1]
    for name, _ in runs:
        _assert_equal_runs(got[name], single["plain"], name)

"""End to end: legacy checkpoints (``--ckpt-format torch``) of tests/e2e/test_moe_e2e.py's
mixture-of-experts model with the experts split over expert-TP (``--expert-tensor-parallel-size``
2 = TP, tensor rank t's ``mp_rank_TT[_EEE]`` folder holding expert-TP slice t), saved half-way and
resumed: the whole run (first half + resumed half) equals one process's 20 iterations within
rtol 1e-6 (losses, grad norms, validation losses; clipping on). Layouts: TP=2 x EP=2 x DP=2 with
the distributed optimizer resumed at TP=2 x EP=1 (experts joined from the two EP folders of each
tensor rank), and TP=2 x EP=1 x DP=2 with the plain optimizer resumed at its own layout.
Resumed at another expert-TP (distributed optimizer; ZeRO-3 saves its shards alike): TP=2 x EP=2
x expert-TP 2 at expert-TP 1; TP=1 x EP=2 x expert-TP 2 x DP=4 (whole experts in the files) at
EP=4; TP=1 x expert-TP 2 x DP=4 under ZeRO-3 at EP=2 x expert-TP 2; TP=2 x EP=2 x expert-TP 1 at
expert-TP 2. Weights and Adam moments bitwise across expert-TP:
tests/unit/model/test_legacy_expert_tp_checkpoint.py. The legacy runs are slow-tier tests; the
default tier runs the torch_dist one.

torch_dist (whole experts on a global axis, independent of expert-TP): saved at TP=2 x EP=2 x
expert-TP 2 with the distributed optimizer and resumed at TP=2 x expert-TP 1, at TP=1 x EP=2 and
at EP=4 (each a new expert-TP, EP and DP): every resumed run equals one process, the run at the
new layout (weights and Adam moments bitwise: tests/unit/model/test_expert_checkpoint.py)."""

import pytest

from tests.e2e.test_moe_layouts_e2e import HALF, ep
from tests.e2e.test_moe_legacy_ckpt_e2e import DISTOPT, _first_half, _joined, _second_half
from tests.e2e.test_moe_layouts_e2e import _argv
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import assert_close_history, layout_args, one_process, run_many

TP2_ETP2 = [*layout_args(2, 1), "--sequence-parallel", "--expert-tensor-parallel-size", "2"]


# Slow tier: a cross product (legacy checkpoint x expert-TP 2, 20 s of the default suite's
# four-rank time) whose factors the default tier covers apiece: MoE legacy checkpoints resumed at
# another EP (tests/e2e/test_moe_legacy_ckpt_e2e.py), a legacy checkpoint at TP=2 x expert-TP 2
# loaded and trained on (tests/e2e/tools/test_convert_moe_optimizer.py), the bitwise re-cut of
# weights and moments across expert-TP (tests/unit/model/test_legacy_expert_tp_checkpoint.py) and
# torch_dist across expert-TP (below).
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_moe_legacy_checkpoint_at_expert_tp2_resumes(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_etp_cache"))
    one = one_process([("one", _argv(data_prefix, cache))])["one"]
    ckpt = {name: str(tmp_path_factory.mktemp(f"moe_etp_{name}")) for name in ("ep2", "ep1")}
    runs = [
        ("tp2 ep2 etp2", _first_half(data_prefix, cache, ckpt["ep2"], *TP2_ETP2, *ep(2),
                                     *DISTOPT)),
        ("tp2 ep1 etp2", _second_half(data_prefix, cache, ckpt["ep2"], *TP2_ETP2, *ep(1),
                                      *DISTOPT)),
        ("tp2 etp2 plain", _first_half(data_prefix, cache, ckpt["ep1"], *TP2_ETP2)),
        ("tp2 etp2 plain resumed", _second_half(data_prefix, cache, ckpt["ep1"], *TP2_ETP2)),
    ]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    for first, second in (("tp2 ep2 etp2", "tp2 ep1 etp2"),
                          ("tp2 etp2 plain", "tp2 etp2 plain resumed")):
        assert_close_history(_joined(got[first], got[second]), one,
                             f"MoE legacy expert-TP 2 {first} -> {second}")


# Slow tier: 9 four-rank runs (21 to 36 s); the default tier keeps torch_dist across expert-TP
# (below) and the bitwise re-cut of weights and moments across expert-TP
# (tests/unit/model/test_legacy_expert_tp_checkpoint.py).
@pytest.mark.slow
@pytest.mark.timeout(1800)  # 9 runs of 10 or 20 iterations: minutes on a loaded machine
def test_moe_legacy_checkpoint_resumes_at_another_expert_tp(data_prefix, tmp_path_factory):
    """Legacy checkpoints with the distributed optimizer saved at one expert-TP and resumed at
    another (and another EP): slices of expert-TP = TP merged into whole experts and cut again,
    whole experts (saved at expert-TP other than TP) cut, the optimizer's expert records re-cut."""
    cache = str(tmp_path_factory.mktemp("moe_etp_other_cache"))
    one = one_process([("one", _argv(data_prefix, cache))])["one"]
    ckpt = {n: str(tmp_path_factory.mktemp(f"moe_etp_other_{n}")) for n in "abcd"}
    tp2_etp1 = [*layout_args(2, 1), "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    etp2 = ["--expert-tensor-parallel-size", "2"]
    zero3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    pairs = [
        ("a", "tp2 ep2 etp2", [*TP2_ETP2, *ep(2), *DISTOPT], "tp2 ep2 etp1",
         [*tp2_etp1, *ep(2), *DISTOPT]),
        ("b", "tp1 ep2 etp2 dp4", [*etp2, *ep(2), *DISTOPT], "tp1 ep4", [*ep(4), *DISTOPT]),
        ("c", "tp1 etp2 dp4 zero3", [*etp2, *zero3], "tp1 ep2 etp2", [*etp2, *ep(2), *DISTOPT]),
        ("d", "tp2 ep2 etp1", [*tp2_etp1, *ep(2), *DISTOPT], "tp2 etp2",
         [*TP2_ETP2, *DISTOPT]),
    ]
    runs = []
    for folder, first, first_flags, second, second_flags in pairs:
        runs += [(first, _first_half(data_prefix, cache, ckpt[folder], *first_flags)),
                 (f"{second} from {first}", _second_half(data_prefix, cache, ckpt[folder],
                                                          *second_flags))]
    got = run_distributed(4, run_many, runs, timeout=2400)[-1]
    for _, first, _, second, _ in pairs:
        assert_close_history(_joined(got[first], got[f"{second} from {first}"]), one,
                             f"MoE legacy {first} -> {second}")


@pytest.mark.slow
def test_moe_legacy_checkpoint_with_pipeline_resumes_at_another_expert_tp(data_prefix,
                                                                          tmp_path_factory):
    """8 ranks, mp_rank_TT_PPP_EEE folders: TP=2 (SP) x PP=2 x EP=2 x expert-TP 2 (DP=2) with
    the distributed optimizer saved half-way, resumed at TP=2 x PP=2 x EP=4 x expert-TP 1; and
    ZeRO-3 at TP=2 x PP=2 x EP=2 x expert-TP 1 resumed at expert-TP 2."""
    cache = str(tmp_path_factory.mktemp("moe_etp_pp_cache"))
    one = one_process([("one", _argv(data_prefix, cache))])["one"]
    ckpt = {n: str(tmp_path_factory.mktemp(f"moe_etp_pp_{n}")) for n in "ab"}
    etp1 = [*layout_args(2, 2), "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    etp2 = [*layout_args(2, 2), "--sequence-parallel", "--expert-tensor-parallel-size", "2"]
    zero3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    runs = [("etp2", _first_half(data_prefix, cache, ckpt["a"], *etp2, *ep(2), *DISTOPT)),
            ("ep4 etp1", _second_half(data_prefix, cache, ckpt["a"], *etp1, *ep(4), *DISTOPT)),
            ("etp1 zero3", _first_half(data_prefix, cache, ckpt["b"], *etp1, *ep(2), *zero3)),
            ("etp2 from zero3", _second_half(data_prefix, cache, ckpt["b"], *etp2, *ep(2),
                                             *DISTOPT))]
    got = run_distributed(8, run_many, runs, timeout=2400)[-1]
    for first, second in (("etp2", "ep4 etp1"), ("etp1 zero3", "etp2 from zero3")):
        assert_close_history(_joined(got[first], got[second]), one,
                             f"MoE legacy TP=2 x PP=2 {first} -> {second}")


def _dist_half(data_prefix, cache, ckpt, first, *extra):
    where = (["--save", ckpt, "--save-interval", str(HALF), "--exit-interval", str(HALF)]
             if first else ["--load", ckpt])
    return _argv(data_prefix, cache, "--ckpt-format", "torch_dist", *where, *extra)


def test_moe_torch_dist_at_expert_tp2_resumes_at_other_layouts(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_etp_dist_cache"))
    one = one_process([("one", _argv(data_prefix, cache))])["one"]
    ckpt = str(tmp_path_factory.mktemp("moe_etp_dist"))
    tp2_etp1 = [*layout_args(2, 1), "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    runs = [
        ("tp2 ep2 etp2", _dist_half(data_prefix, cache, ckpt, True, *TP2_ETP2, *ep(2), *DISTOPT)),
        ("tp2 etp1", _dist_half(data_prefix, cache, ckpt, False, *tp2_etp1, *DISTOPT)),
        ("tp1 ep2", _dist_half(data_prefix, cache, ckpt, False, *ep(2), *DISTOPT)),
        ("ep4", _dist_half(data_prefix, cache, ckpt, False, *ep(4), *DISTOPT)),
    ]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    for second in ("tp2 etp1", "tp1 ep2", "ep4"):
        assert_close_history(_joined(got["tp2 ep2 etp2"], got[second]), one,
                             f"MoE torch_dist expert-TP 2 -> {second}")

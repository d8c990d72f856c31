"""End to end: legacy checkpoints (``--ckpt-format torch``) of tests/e2e/test_moe_e2e.py's
mixture-of-experts model with the distributed optimizer at EP > 1, saved half-way at one
(TP, EP, DP) layout and resumed at another (the legacy format keeps TP and PP): the whole run
(first half + resumed half) equals one process's 20 iterations within rtol 1e-6 (losses, grad
norms, validation losses; clipping on every iteration). Layouts: TP=2 (SP, expert-TP 1) x EP=2
(EP over the TP group) x DP=2 resumed at TP=2 x EP=1 x DP=2; EP=2 x DP=4 under ZeRO-3 resumed at
EP=4 x DP=4 with the distributed optimizer (ZeRO-1); EP=4 x DP=4 resumed at EP=2 x DP=4. Weights
and Adam moments bitwise across EP layouts: tests/unit/model/test_expert_checkpoint.py."""

from tests.e2e.test_moe_layouts_e2e import HALF, SP, _argv, ep
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import LAYOUT_ITERS, assert_close_history, layout_args, one_process, run_many

DISTOPT = ["--use-distributed-optimizer"]
ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def _first_half(data_prefix, cache, ckpt, *extra):
    return _argv(data_prefix, cache, "--ckpt-format", "torch", "--save", ckpt,
                 "--save-interval", str(HALF), "--exit-interval", str(HALF), *extra)


def _second_half(data_prefix, cache, ckpt, *extra):
    return _argv(data_prefix, cache, "--ckpt-format", "torch", "--load", ckpt, *extra)


def _joined(first, second):
    out = {key: first[key] + second[key] for key in ("lm loss", "grad norm", "valid")}
    assert second["iteration"] == list(range(HALF + 1, LAYOUT_ITERS + 1))
    return out


def test_moe_legacy_distributed_optimizer_resumes_at_another_ep(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("moe_legacy_cache"))
    one = one_process([("one", _argv(data_prefix, cache))])["one"]
    ckpt = {name: str(tmp_path_factory.mktemp(f"moe_legacy_{name}"))
            for name in ("tp2ep2", "zero3", "ep4")}
    tp2 = [*layout_args(2, 1), *SP]
    runs = [
        ("tp2 ep2 dp2", _first_half(data_prefix, cache, ckpt["tp2ep2"], *tp2, *ep(2), *DISTOPT)),
        ("tp2 ep1 dp2", _second_half(data_prefix, cache, ckpt["tp2ep2"], *tp2, *ep(1),
                                     *DISTOPT)),
        ("ep2 dp4 zero3", _first_half(data_prefix, cache, ckpt["zero3"], *ep(2), *ZERO3)),
        ("ep4 dp4", _second_half(data_prefix, cache, ckpt["zero3"], *ep(4), *DISTOPT)),
        ("ep4 dp4 first", _first_half(data_prefix, cache, ckpt["ep4"], *ep(4), *DISTOPT)),
        ("ep2 dp4", _second_half(data_prefix, cache, ckpt["ep4"], *ep(2), *DISTOPT)),
    ]
    got = run_distributed(4, run_many, runs, timeout=1500)[-1]
    for first, second in (("tp2 ep2 dp2", "tp2 ep1 dp2"), ("ep2 dp4 zero3", "ep4 dp4"),
                          ("ep4 dp4 first", "ep2 dp4")):
        joined = _joined(got[first], got[second])
        assert_close_history(joined, one, f"MoE legacy {first} -> {second}")

"""End to end: pretrain_llama.main() with --overlapped-distributed-optimizer equals the plain
optimizer (same layout, same global batch; losses, grad norms and validation losses, rtol 1e-5) at
TP=2 x DP=2 with 4 micro-batches and PP=2 x DP=2 (tied embedding across stages) with 1."""

from tests.dist import run_distributed
from tests.test_pretrain_e2e import _argv, _close, _layout, _run_many, data_prefix  # noqa: F401

SHORT = ["--train-iters", "4", "--eval-iters", "1", "--micro-batch-size", "1",
         "--reduce-bucket-size", "3000"]  # several buckets per stage
DISTOPT = ["--overlapped-distributed-optimizer"]


def test_tp2_dp2_and_pp2_dp2_equal_plain_optimizer(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("distopt_cache"))
    tp2 = [*SHORT, "--global-batch-size", "8", "--untie-embeddings-and-output-weights",
           *_layout(2, 1)]
    pp2 = [*SHORT, "--global-batch-size", "2", *_layout(1, 2)]
    save = tmp_path_factory.mktemp("distopt_ckpt")
    runs = [("tp2 plain", _argv(data_prefix, cache, *tp2)),
            ("tp2 distopt", _argv(data_prefix, cache, *tp2, *DISTOPT, "--save", str(save / "tp2"))),
            ("pp2 plain", _argv(data_prefix, cache, *pp2)),
            ("pp2 distopt", _argv(data_prefix, cache, *pp2, *DISTOPT, "--save", str(save / "pp2")))]
    out = run_distributed(4, _run_many, runs, timeout=600)[3]
    for layout in ("tp2", "pp2"):
        plain, distopt = out[f"{layout} plain"], out[f"{layout} distopt"]
        assert len(distopt["lm loss"]) == 4 and distopt["final valid"]
        _close(distopt, plain, layout)
    # the training loop saved one optimizer shard per data-parallel rank in every mp_rank folder
    for layout, folders in (("tp2", ["mp_rank_00", "mp_rank_01"]),
                            ("pp2", ["mp_rank_00_000", "mp_rank_00_001"])):
        for folder in folders:
            files = sorted(p.name for p in (save / layout / "iter_0000004" / folder).iterdir())
            assert files == ["distrib_optim_dp_000.pt", "distrib_optim_dp_001.pt",
                             "model_optim_rng.pt"], (layout, folder, files)

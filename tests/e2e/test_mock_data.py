"""--mock-data end to end: pretrain_llama.main() with no dataset and no tokenizer file.

The same seed gives the same tokens at every layout (TP=2 and DP=2 read the samples differently:
both give the losses of one another within fp32 rounding), validation runs on its own synthetic
split, and a run saved after 2 iterations and resumed to 4 has bitwise the losses, grad norms and
validation losses of an uninterrupted 4-iteration run.
"""

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import BASE, MASKED, UNTIED, assert_close_history, layout_args, run_many

ITERS = 4


def _argv(*extra):
    return BASE + ["--mock-data", "--train-iters", str(ITERS), "--eval-interval", "2",
                   "--eval-iters", "1", "--log-interval", "1", *UNTIED, *MASKED, *extra]


def test_mock_data_is_layout_free_and_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    runs = [("dp2", _argv()),
            ("tp2", _argv(*layout_args(2, 1))),
            ("first", _argv("--save", ckpt, "--save-interval", "2", "--exit-interval", "2")),
            ("second", _argv("--load", ckpt))]
    out = run_distributed(2, run_many, runs, timeout=600)[1]
    dp2, tp2, first, second = (out[k] for k in ("dp2", "tp2", "first", "second"))
    assert dp2["iteration"] == list(range(1, ITERS + 1))
    assert [it for it, _ in dp2["valid"]][:2] == [2, 4]  # validation on the mock valid split
    assert_close_history(tp2, dp2, "mock data TP=2 against DP=2", clip=None)
    assert dp2["lm loss"][-1] < dp2["lm loss"][0]  # the counting documents are learnable
    assert first["iteration"] == [1, 2] and second["iteration"] == [3, 4]
    assert first["lm loss"] + second["lm loss"] == dp2["lm loss"]  # bitwise
    assert first["grad norm"] + second["grad norm"] == dp2["grad norm"]
    assert first["valid"][0] == dp2["valid"][0]
    assert second["valid"] == [v for v in dp2["valid"] if v[0] > 2]

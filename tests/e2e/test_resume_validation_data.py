"""A run resumed with more iterations or another ``--eval-interval`` than the run that saved
(the CPU demo's "run it again with a larger ITERS") still has validation data for every evaluation
it plans: the validation split is built for the samples already consumed plus those still to come
(Megatron-LM sizes it for the new run's plan alone and stops when the earlier evaluations have
consumed more). A resume with the saving run's own flags builds the same split as the
uninterrupted run, so it stays exact."""

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import e2e_argv, run_many


def test_a_continued_run_with_another_eval_interval_validates_to_its_end(data_prefix, tmp_path):
    ckpt, cache = str(tmp_path / "ckpt"), str(tmp_path / "cache")
    first = e2e_argv(data_prefix, cache, "--train-iters", "6", "--eval-interval", "2",
                     "--save", ckpt)
    longer = e2e_argv(data_prefix, cache, "--train-iters", "12", "--eval-interval", "4",
                      "--load", ckpt, "--save", ckpt, "--override-opt_param-scheduler")
    got = run_distributed(1, run_many, [("first", first), ("longer", longer)])[0]
    assert got["longer"]["iteration"] == list(range(7, 13))
    # evaluations at 8 and 12, then the final one (Megatron's "end of training"): the new run's
    # plan counts 4 evaluations' data (12 // 4 + 1), which the first run's 4 (at 2, 4, 6 and its
    # end) used up; before, the final evaluation here stopped the run with StopIteration
    assert [it for it, _ in got["longer"]["valid"]] == [8, 12, 12]
    assert all(loss is not None for _, loss in got["longer"]["valid"])


def test_a_continued_run_without_evaluations_builds_no_validation_split(data_prefix, tmp_path):
    """``--eval-iters 0`` after a run that evaluated: no validation data is asked for (a split
    without validation documents stays usable)."""
    ckpt, cache = str(tmp_path / "ckpt"), str(tmp_path / "cache")
    first = e2e_argv(data_prefix, cache, "--train-iters", "4", "--eval-interval", "2",
                     "--save", ckpt)
    no_eval = e2e_argv(data_prefix, cache, "--train-iters", "6", "--eval-iters", "0",
                       "--split", "100,0,0", "--load", ckpt, "--override-opt_param-scheduler")
    got = run_distributed(1, run_many, [("first", first), ("no eval", no_eval)])[0]
    assert got["first"]["valid"] and got["no eval"]["iteration"] == [5, 6]
    assert got["no eval"]["valid"] == []

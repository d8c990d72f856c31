"""megatron.usage_error: one line on one rank, status 2; a usage error found by some ranks only
is agreed on by all of them (no rank left waiting in a collective)."""

import pytest

from megatron.usage_error import (UsageError, agree_on_usage_error, one_line, prints_here,
                                  run_command)
from tests.helpers.dist import run_distributed


def _agree(found_by):
    import torch.distributed as dist

    rank = dist.get_rank()
    error = UsageError(f"--save (x): found by rank {rank}") if rank in found_by else None
    try:
        agree_on_usage_error(error, "cpu")
    except UsageError as exc:
        return [str(exc), exc.reporter, exc.silent, prints_here(exc, rank)]
    return None


def test_the_lowest_rank_that_found_it_reports_and_every_rank_leaves():
    out = run_distributed(3, _agree, (1, 2), timeout=120)
    assert out[1] == ["--save (x): found by rank 1", 1, False, True]
    for rank in (0, 2):
        assert out[rank] == ["rank 1 found a usage error (see its line)", 1, True, False]


def _agree_in_command(found_by):
    import contextlib
    import io

    import torch.distributed as dist

    def main(argv):
        error = UsageError("x") if dist.get_rank() in found_by else None
        agree_on_usage_error(error, "cpu")

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = run_command("prog.py", main)
    return [status, err.getvalue()]


def test_under_a_command_the_reporter_says_it_before_any_rank_leaves_and_only_once():
    out = run_distributed(3, _agree_in_command, (2,), timeout=120)
    assert out == [[2, ""], [2, ""], [2, "prog.py: error: x\n"]]


def test_no_error_anywhere_passes():
    assert run_distributed(2, _agree, (), timeout=120) == [None, None]


def _raise(message):
    def main(argv):
        raise UsageError(message)
    return main


@pytest.mark.parametrize("rank, printed", [("0", True), ("3", False)])
def test_run_command_prints_one_line_on_rank_0_and_returns_2(monkeypatch, capsys, rank, printed):
    monkeypatch.setenv("RANK", rank)
    assert run_command("prog.py", _raise("--lr (nan) must be\n  finite")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("prog.py: error: --lr (nan) must be finite\n" if printed else "")


def test_run_command_keeps_other_errors_as_crashes_and_takes_a_tool_s_input_errors(capsys):
    with pytest.raises(KeyError):
        run_command("prog.py", lambda argv: {}["x"])

    def bad_input(argv):
        raise FileNotFoundError("data.idx: no such file")
    assert run_command("tool.py", bad_input, usage_errors=(UsageError, FileNotFoundError)) == 2
    assert capsys.readouterr().err == "tool.py: error: data.idx: no such file\n"
    assert run_command("prog.py", lambda argv: None) == 0


def test_one_line_folds_whitespace():
    assert one_line(" a\n\tb  c \n") == "a b c"


@pytest.mark.parametrize("rank, torchrun, silent, waits", [
    ("3", True, False, True), ("0", True, False, False), ("3", False, False, False),
    ("3", True, True, False)])
def test_under_torchrun_a_silent_rank_leaves_rank_0_time_to_say_it(monkeypatch, capsys, rank,
                                                                   torchrun, silent, waits):
    """The agent stops every worker once one has exited: rank 3 quicker than rank 0 took the line
    with it (the slow tier's 4-rank torchrun test, under load). A rank that only learned of
    another's error through the collective (silent) has passed the barrier: nothing to wait for."""
    import megatron.usage_error as usage_error

    slept = []
    monkeypatch.setattr(usage_error.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", rank)
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    def main(argv):
        raise UsageError("--lr (nan) must be finite", reporter=0 if silent else None,
                         silent=silent)
    assert run_command("prog.py", main) == 2
    assert slept == ([usage_error.RANK_0_GRACE_S] if waits else [])
    assert capsys.readouterr().err == ("prog.py: error: --lr (nan) must be finite\n"
                                       if rank == "0" else "")


@pytest.mark.parametrize("error, group_rank, waits", [
    (UsageError("--lr (nan) must be finite"), "1", False),
    (FileNotFoundError("data.idx: no such file"), "0", False),
    (UsageError("--lr (nan) must be finite"), "0", True)])
def test_the_wait_is_for_usage_errors_on_rank_0_s_node_only(monkeypatch, capsys, error,
                                                             group_rank, waits):
    """A tool's other input errors (a missing file) may be one rank's alone, rank 0 then waiting
    in a collective; another node's agent is not stopped by rank 0's exit: no wait there."""
    import megatron.usage_error as usage_error

    slept = []
    monkeypatch.setattr(usage_error.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("GROUP_RANK", group_rank)

    def main(argv):
        raise error
    assert run_command("tool.py", main, usage_errors=(UsageError, FileNotFoundError)) == 2
    assert slept == ([usage_error.RANK_0_GRACE_S] if waits else [])
    assert capsys.readouterr().err == ""

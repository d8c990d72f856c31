"""The training command line: a data file damaged under the running job is one line naming it
and status 1, also when a DataLoader worker met it (torch folds the worker's traceback into the
message it re-raises in the rank)."""

import sys

import pytest

from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.training.command import data_error_line, run_training_command

MESSAGE = ("corpus_text_document.bin: 100 bytes now, 4096 when it was opened; the index needs "
           "4096: the file was truncated under the running job; restore it and resume")


def _as_a_worker_raises_it():
    """The exception a rank sees when worker 1 of its DataLoader raised ``MESSAGE``."""
    from torch._utils import ExceptionWrapper

    try:
        raise IndexedDatasetError(MESSAGE)
    except IndexedDatasetError:
        wrapper = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 1")
    try:
        wrapper.reraise()
    except IndexedDatasetError as exc:
        return exc
    raise AssertionError("reraise did not raise")


def test_the_worker_s_message_is_taken_out_of_torch_s_wrapping():
    exc = _as_a_worker_raises_it()
    assert "Original Traceback" in str(exc)  # what torch gives the rank
    assert data_error_line(exc) == MESSAGE
    assert data_error_line(IndexedDatasetError(MESSAGE + "\n")) == MESSAGE


@pytest.mark.parametrize("where", ["worker", "rank"])
def test_a_data_error_is_one_line_and_status_1(capsys, where):
    def main(argv):
        raise _as_a_worker_raises_it() if where == "worker" else IndexedDatasetError(MESSAGE)

    assert run_training_command("pretrain_llama.py", main, []) == 1
    err = capsys.readouterr().err
    assert err == f"pretrain_llama.py: error: {MESSAGE}\n"


def test_any_other_error_keeps_its_traceback():
    def main(argv):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_training_command("pretrain_llama.py", main, [])

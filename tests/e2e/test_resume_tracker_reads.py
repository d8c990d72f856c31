"""A resume reads ``--load``'s tracker file once per phase and passes the answer down: once when
the flags are validated (before any process group exists) and once in ``pretrain`` (initial
weights, the load and the checkpoints ``--keep-last-checkpoints`` keeps all take that answer;
before, ``pretrain`` read it three times). Counted by wrapping the one reader,
:func:`megatron.checkpointing.checkpoint_folder.read_metadata`, for both formats."""

import contextlib
import io
import traceback

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.reliability import tiny_argv, write_dataset


def _resume_counting_reads(prefix, cache, folder, ckpt_format):
    import pretrain_llama
    from megatron.checkpointing import checkpoint_folder

    common = ("--save", folder, "--load", folder, "--save-interval", "2",
              "--ckpt-format", ckpt_format)
    with contextlib.redirect_stdout(io.StringIO()):
        first = pretrain_llama.main(tiny_argv(prefix, cache, 2, *common))
    real, reads = checkpoint_folder.read_metadata, []

    def counting(tracker_filename):
        stack = traceback.extract_stack()
        phase = ("validation" if any(f.name == "_validate_resume" for f in stack) else "pretrain")
        reads.append((phase, tracker_filename))
        return real(tracker_filename)

    checkpoint_folder.read_metadata = counting
    with contextlib.redirect_stdout(io.StringIO()):
        resumed = pretrain_llama.main(tiny_argv(prefix, cache, 4, *common,
                                                "--override-opt_param-scheduler"))
    return first["iteration"], resumed["iteration"], reads


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_resume_reads_the_tracker_once_per_phase(tmp_path, ckpt_format):
    prefix = write_dataset(str(tmp_path / "text_document"))
    folder = str(tmp_path / "checkpoints")
    first, resumed, reads = run_distributed(1, _resume_counting_reads, prefix,
                                            str(tmp_path / "cache"), folder, ckpt_format)[0]
    assert first == [1, 2] and resumed == [3, 4]  # the second run did resume from iteration 2
    tracker = f"{folder}/latest_checkpointed_iteration.txt"
    assert reads == [("validation", tracker), ("pretrain", tracker)], reads

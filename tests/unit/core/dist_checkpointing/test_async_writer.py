"""The asynchronous writer's pieces: host copies of the written boxes only (compact, independent
of the live tensors), and the background save's phases (the copy awaited before the next
optimizer step, then the write; failures of either kept for the caller)."""

import threading

import torch

from megatron.core.dist_checkpointing.async_writer import (DONE, FAILED, RUNNING, BackgroundWrite,
                                                           stage_to_host)
from megatron.core.dist_checkpointing.mapping import ShardedTensor


def test_host_copies_of_written_boxes_only():
    flat = torch.arange(12.)
    boxes = [ShardedTensor("a", flat[2:6], (12,), (2,)),
             ShardedTensor("b", flat[6:].view(2, 3), (2, 3), (0, 0)),
             ShardedTensor("c", flat[:2], (2,), (0,), replica_id=1)]
    staged = stage_to_host(boxes)
    assert [s.key for s in staged] == ["a", "b"]
    flat.zero_()  # the training loop goes on changing the live tensors
    assert torch.equal(staged[0].data, torch.arange(2., 6.))
    assert torch.equal(staged[1].data, torch.arange(6., 12.).view(2, 3))
    assert staged[0].data.untyped_storage().nbytes() == 4 * 4  # compact: not the whole flat


def test_the_copy_then_the_write_and_their_failures():
    release, written = threading.Event(), []

    def stage():
        release.wait()
        return ["copy"]

    save = BackgroundWrite(stage, written.append)
    assert save.state() == RUNNING and not save._staged.is_set()
    release.set()
    assert save.wait_staged() >= 0 and save.wait() == DONE and written == [["copy"]]
    assert save.seconds >= save.staged_seconds >= 0

    def full_disk(staged):
        raise OSError(28, "No space left on device")

    failed = BackgroundWrite(lambda: [], full_disk)
    assert failed.wait() == FAILED and isinstance(failed.error, OSError)

    def broken_copy():
        raise RuntimeError("copy failed")

    broken = BackgroundWrite(broken_copy, written.append)
    broken.wait_staged()  # returns: the loop is never left waiting
    assert broken.wait() == FAILED and str(broken.error) == "copy failed" and len(written) == 1

"""``--ckpt-format torch_dist`` when something is wrong: a partial, truncated or refused
checkpoint names the file and the last complete checkpoint; a model of another shape names the
tensor; another vocabulary padding loads the rows both have and says so; a full disk during an
asynchronous write stops every rank and keeps the previous checkpoint; ``--finetune`` of a bf16
checkpoint (either format) trains from the loaded weights, not the optimizer's stale copies."""

import os
import shutil

import pytest

from megatron import checkpointing as ckpt
from megatron.checkpointing import torch_dist
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import UNTIED, e2e_argv, run_many

TORCH_DIST = ["--ckpt-format", "torch_dist"]
BF16 = [*UNTIED, "--bf16", "--train-iters", "6"]
STILL = ["--lr", "0", "--min-lr", "0", "--train-iters", "3"]  # weights stay as loaded


def _outcomes(runs):
    """Run each ``(name, argv)``; ``{name: history, or "ExceptionType: message"}``."""
    import torch.distributed as dist

    import pretrain_llama

    out = {}
    for name, argv in runs:
        try:
            out[name] = pretrain_llama.main(argv)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def saved(data_prefix, tmp_path_factory):
    """bf16 checkpoints of iterations 3 and 6 in both formats, and the finetune runs."""
    cache = str(tmp_path_factory.mktemp("fail_cache"))
    root = tmp_path_factory.mktemp("fail")
    dist_dir, legacy_dir = str(root / "dist"), str(root / "legacy")
    runs = [("dist", e2e_argv(data_prefix, cache, *BF16, *TORCH_DIST, "--save", dist_dir,
                              "--save-interval", "3")),
            ("legacy", e2e_argv(data_prefix, cache, *BF16, "--save", legacy_dir)),
            ("finetune dist", e2e_argv(data_prefix, cache, *BF16, *STILL, "--load", dist_dir,
                                       "--finetune")),
            ("finetune legacy", e2e_argv(data_prefix, cache, *BF16, *STILL, "--load", legacy_dir,
                                         "--finetune")),
            ("fresh", e2e_argv(data_prefix, cache, *BF16, *STILL))]
    return run_distributed(1, run_many, runs, timeout=300)[0], root, cache


def test_finetune_of_bf16_checkpoints_trains_from_the_loaded_weights(saved):
    out, _, _ = saved
    dist, legacy, fresh = (out[k]["lm loss"] for k in ("finetune dist", "finetune legacy", "fresh"))
    assert dist == legacy  # the same weights, both formats
    # lr 0: every iteration sees the loaded weights; before the fix the legacy path's first
    # step copied the optimizer's fp32 copies of the *initial* weights back (== fresh from then).
    assert len(set(dist)) == 3 and all(a != b for a, b in zip(dist, fresh))
    assert max(dist) < min(fresh)


def _broken_copy(root, name, damage):
    """A copy of the torch_dist checkpoint folder with iteration 6 damaged by ``damage(folder)``."""
    target = str(root / name)
    shutil.copytree(str(root / "dist"), target)
    damage(os.path.join(target, "iter_0000006"))
    return target


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))


def _refused_common(path):
    import torch
    torch.save({"format_version": 1, "x": _RunsCode()}, path)


def _flip(path):
    """One bit inside the tensor bytes of the last record (its archive's data, not a header)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        at = data.rfind(b"PK\x03\x04", 0, data.rfind(b"PK\x05\x06") - 100) - 200
        data[at] ^= 0x10
        f.seek(0)
        f.write(data)


def _from_iteration_3(folder, name):
    shutil.copy(os.path.join(os.path.dirname(folder), "iter_0000003", name),
                os.path.join(folder, name))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_bad_checkpoints_name_the_file_and_the_last_complete_one(saved, data_prefix):
    out, root, cache = saved
    cases = {
        "no .metadata": (lambda d: os.remove(os.path.join(d, ".metadata")),
                         r"\.metadata does not exist: .* is not a complete distributed checkpoint"),
        "truncated data": (lambda d: _truncate(os.path.join(d, "__0_0.distcp")),
                           r"__0_0\.distcp ends before the record of .* \(byte \d+\): truncated\."),
        "refused common.pt": (lambda d: _refused_common(os.path.join(d, "common.pt")),
                              r"refused to load torch_dist common state .*common\.pt: its pickle "
                              r"asks for posix\.system"),
        "flipped bit": (lambda d: _flip(os.path.join(d, "__0_0.distcp")),
                        r"__0_0\.distcp \(the record of .* at byte \d+\): record .* fails its "
                        r"CRC-32 check"),
        # Issue 31: files of the save of iteration 3 copied into iteration 6 (same layout, same
        # offsets, valid CRCs): the data file loaded silently before the save ids.
        "data of another save": (lambda d: _from_iteration_3(d, "__0_0.distcp"),
                                 r"iter_0000006/__0_0\.distcp comes from another save than "
                                 r".*iter_0000006/\.metadata \(save id [0-9a-f]{32}, expected"),
        "common.pt of another save": (lambda d: _from_iteration_3(d, "common.pt"),
                                      r"iter_0000006/common\.pt and .*iter_0000006/\.metadata "
                                      r"come from different saves"),
    }
    runs = []
    for name, (damage, _) in cases.items():
        folder = _broken_copy(root, name.replace(" ", "_"), damage)
        runs.append((name, e2e_argv(data_prefix, cache, *BF16, "--load", folder)))
    runs.append(("other shape", e2e_argv(data_prefix, cache, *BF16, "--ffn-hidden-size", "48",
                                         "--load", str(root / "dist"))))
    runs.append(("other padding", e2e_argv(data_prefix, cache, *BF16, *STILL, "--finetune",
                                           "--make-vocab-size-divisible-by", "96",
                                           "--load", str(root / "dist"))))
    got = run_distributed(1, _outcomes, runs, timeout=300)[0]
    import re
    for name, (_, pattern) in cases.items():
        message = got[name]
        # the one usage line (every load error is one, exit 2), still a CheckpointError
        assert isinstance(message, str) and message.startswith("CheckpointUsageError"), \
            (name, message)
        assert re.search(pattern, message), (name, message)
        assert "weights_only" not in message  # never advise running the file's code
        assert re.search(r"The last complete checkpoint is .*iter_0000003: to resume from it, "
                         r"write 3 into .*latest_checkpointed_iteration\.txt", message), message
    assert re.search(r"tensor model\.layers\.0\.mlp\.gate\.weight has global shape \[64, 32\] in "
                     r"the checkpoint but \[48, 32\] in the model", got["other shape"])
    # the flags are wrong, not the checkpoint: no advice to resume from another one
    assert "last complete checkpoint" not in got["other shape"], got["other shape"]
    padded = got["other padding"]
    assert not isinstance(padded, str), padded
    # 192 rows now, 128 saved: the 128 loaded, the rest as initialised (rows clipped and kept:
    # tests/unit/core/dist_checkpointing/test_storage.py), said in the log; it trains
    assert padded["iteration"] == [1, 2, 3] and all(0 < v < 10 for v in padded["lm loss"])


def _full_disk_on_rank_1(argv):
    import errno

    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item

    def full(*args, **kwargs):
        if dist.get_rank() == 1 and os.path.isdir(os.path.join(argv[argv.index("--save") + 1],
                                                               "iter_0000002")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    fs._write_item = full
    try:
        return _outcomes([("run", argv)])["run"]
    finally:
        fs._write_item = real


def test_full_disk_during_an_async_write_stops_every_rank_and_keeps_the_previous(
        data_prefix, tmp_path):
    save = str(tmp_path / "ckpt")
    argv = e2e_argv(data_prefix, str(tmp_path / "cache"), *UNTIED, *TORCH_DIST, "--async-save",
                    "--save", save, "--save-interval", "2", "--train-iters", "6",
                    "--tensor-model-parallel-size", "2")
    messages = run_distributed(2, _full_disk_on_rank_1, argv, timeout=300)
    for message in messages:
        assert isinstance(message, str) and message.startswith("CheckpointSaveError"), message
        assert "the background write of iteration 4 failed" in message or \
            "failed on another rank" in message, message
        assert "the previous checkpoint and latest_checkpointed_iteration.txt are intact" in message
    assert "No space left on device" in messages[1]
    assert ckpt.find_checkpoint(save) == (2, False)
    assert sorted(os.listdir(save)) == ["iter_0000002", ckpt.TRACKER_FILENAME]
    assert torch_dist.looks_complete(os.path.join(save, "iter_0000002"))

"""A full disk during a save, from the command line (issue 29, hostile review): the one agreed line
on stderr (the file, the OS's reason, the previous checkpoint intact), status 1, no traceback, the
tracker and the previous checkpoint untouched, in the legacy format and in torch_dist with
--async-save (the background writer's failure). A file-size limit (RLIMIT_FSIZE) of the child
stands in for the full disk; Python ignores SIGXFSZ, so the write fails with EFBIG."""

import os
import resource
import subprocess
import sys

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.pretrain import run_many
from tests.helpers.reliability import tiny_argv, write_dataset

LIMIT = 64 << 10  # above the dataset index cache's files, below a checkpoint of the tiny model


def _run(argv, limit=None):
    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(
            resource.RLIMIT_FSIZE)[1]))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_llama.py"), *argv],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
                          preexec_fn=cap if limit else None)


@pytest.mark.parametrize("fmt, extra, written", [
    ("torch", [], "iter_0000004.tmp/mp_rank_00/model_optim_rng.pt"),
    ("torch_dist", ["--async-save"], "iter_0000004.tmp/__0_0.distcp")])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous(tmp_path, fmt, extra,
                                                                       written):
    data = write_dataset(str(tmp_path / "text_document"))
    save = str(tmp_path / fmt)
    # the checkpoint to keep, written in a warm world of one (the full disk needs a process of
    # its own: its file-size limit)
    run_distributed(1, run_many, [("first", tiny_argv(data, str(tmp_path / "cache"), 2, "--save",
                                                      save, "--ckpt-format", fmt))], timeout=600)
    before = sorted(os.listdir(os.path.join(save, "iter_0000002")))
    full = _run(tiny_argv(data, str(tmp_path / "cache"), 4, "--load", save, "--save", save,
                          "--ckpt-format", fmt, "--save-interval", "2",
                          "--override-opt_param-scheduler", *extra), limit=LIMIT)
    lines = full.stderr.splitlines()
    assert full.returncode == 1 and len(lines) == 1, full.stderr
    assert "Traceback" not in full.stderr and "File too large" in lines[0], lines
    assert lines[0].startswith("pretrain_llama.py: error: ") and written in lines[0], lines
    assert lines[0].endswith("the previous checkpoint and latest_checkpointed_iteration.txt are "
                             "intact (free space under --save, then restart with --load)"), lines
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "2"
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(os.path.join(save, "iter_0000002"))) == before

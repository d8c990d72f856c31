"""The README's first command, in its short variant (ITERS=40): it must keep working."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_cpu_demo_short_variant(tmp_path):
    env = dict(os.environ, ITERS="40", OUT_DIR=str(tmp_path / "run"), PYTHON=sys.executable)
    env.pop("MASTER_PORT", None)  # torchrun --standalone: a free port of its own
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "pretrain_llama_cpu_demo.sh")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    valid = [float(v) for v in re.findall(r"validation loss at .*? lm loss value: ([0-9.E+-]+)", log)]
    assert len(valid) >= 2, log[-3000:]
    # From about ln(32000) = 10.4 at initialisation; 40 iterations bring it well below.
    assert valid[-1] < 7.5 and valid[-1] < valid[0], valid
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "40"
    assert sorted(os.listdir(ckpt / "iter_0000040")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "run" / "tensorboard"))
    png = (tmp_path / "run" / "training.png").read_bytes()  # tools/plot_training.py at the end
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

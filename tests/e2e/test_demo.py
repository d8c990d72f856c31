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


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_cpu_demo_continues_with_a_larger_iters(tmp_path):
    """Run again with a larger ITERS, the demo resumes from its checkpoint on the schedule of its
    own settings; an ITERS not above the checkpoint trains nothing and says so; FRESH=1 starts
    afresh."""
    out = tmp_path / "run"

    def demo(iters, **extra):
        env = dict(os.environ, ITERS=str(iters), EVAL_INTERVAL="2", OUT_DIR=str(out),
                   PYTHON=sys.executable, **extra)
        env.pop("MASTER_PORT", None)
        proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "pretrain_llama_cpu_demo.sh")],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-5000:]
        return log

    first = demo(4)
    assert "continuing from" not in first and " training from iteration 0 to 4" in first
    second = demo(8)
    assert "continuing from the checkpoint of iteration 4" in second
    assert " training from iteration 4 to 8" in second and "loaded checkpoint" in second
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "8"
    # The schedule is the demo's (warmup 15, decay over 300), not ITERS's: iteration 5 continues
    # the warmup: lr 2e-3 x 5 / 15.
    lrs = dict(re.findall(r"iteration +(\d+)/ +8 \|.*? learning rate: ([0-9.E+-]+)", second))
    assert float(lrs["5"]) == pytest.approx(2e-3 * 5 / 15, rel=1e-6), lrs
    third = demo(8)
    assert "nothing to train" in third and " training from iteration" not in third
    fresh = demo(2, FRESH="1")
    assert " training from iteration 0 to 2" in fresh
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"

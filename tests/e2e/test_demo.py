"""The README's first command, in its short variant (ITERS=40): it must keep working."""

import math
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


def _demo(out, iters, **extra):
    env = dict(os.environ, ITERS=str(iters), OUT_DIR=str(out), PYTHON=sys.executable, **extra)
    env.pop("MASTER_PORT", None)  # torchrun --standalone: a free port of its own
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "pretrain_llama_cpu_demo.sh")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return log


def _interrupted_demo(out, iters, after_save, **extra):
    """The demo stopped as Ctrl-C stops it (SIGINT to its whole process group) once it printed the
    save of iteration ``after_save``; its output."""
    env = dict(os.environ, ITERS=str(iters), OUT_DIR=str(out), PYTHON=sys.executable, **extra)
    env.pop("MASTER_PORT", None)
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "examples", "pretrain_llama_cpu_demo.sh")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(rf"successfully saved checkpoint at iteration +{after_save} ", line):
                os.killpg(proc.pid, signal.SIGINT)
                break
        lines.append(proc.communicate(timeout=180)[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = "".join(lines)
    assert proc.returncode != 0, "the demo ran to its end: it was not interrupted\n" + log[-3000:]
    return log


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_cpu_demo_short_variant_then_continued(tmp_path):
    """The short variant (ITERS=40) trains, saves, logs and plots. Run again with a larger ITERS,
    the demo resumes from its checkpoint on the schedule of its own settings (warmup 15, cosine
    decay over 300: not ITERS's); stopped by Ctrl-C, it continues from its last periodic save;
    an ITERS not above the checkpoint trains nothing and says so; FRESH=1 starts afresh. (One
    test: the continuation starts from the short variant's run.)"""
    out = tmp_path / "run"
    log = _demo(out, 40, SAVE_INTERVAL="20")  # saved at 20, then 40 (20 deleted: keep the newest)
    assert "continuing from" not in log and " training from iteration 0 to 40" in log
    valid = [float(v) for v in re.findall(r"validation loss at .*? lm loss value: ([0-9.E+-]+)", log)]
    assert len(valid) >= 2, log[-3000:]
    # From about ln(32000) = 10.4 at initialisation; 40 iterations bring it well below.
    assert valid[-1] < 7.5 and valid[-1] < valid[0], valid
    ckpt = out / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "40"
    saved = [int(i) for i in re.findall(r"successfully saved checkpoint at iteration +(\d+)", log)]
    assert saved == [20, 40], log[-3000:]
    assert [f for f in os.listdir(ckpt) if f.startswith("iter_")] == ["iter_0000040"]
    assert sorted(os.listdir(ckpt / "iter_0000040")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    png = (out / "training.png").read_bytes()  # tools/plot_training.py at the end
    assert png.startswith(b"\x89PNG") and len(png) > 10_000

    second = _demo(out, 42, EVAL_INTERVAL="2")
    assert "continuing from the checkpoint of iteration 40" in second
    assert " training from iteration 40 to 42" in second and "loaded checkpoint" in second
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "42"
    # Iteration 41 (the resumed run's first, always logged) is on the demo's cosine schedule:
    # 2e-4 + (2e-3 - 2e-4) (1 + cos(pi (41 - 15) / (300 - 15))) / 2.
    lrs = dict(re.findall(r"iteration +(\d+)/ +42 \|.*? learning rate: ([0-9.E+-]+)", second))
    expected = 2e-4 + 1.8e-3 * 0.5 * (1 + math.cos(math.pi * 26 / 285))
    assert float(lrs["41"]) == pytest.approx(expected, rel=1e-5), lrs
    # Ctrl-C after a periodic save: the next run continues from that save (the dead run's
    # save lock and staging folders are no obstacle)
    stopped = _interrupted_demo(out, 60, after_save=44, EVAL_INTERVAL="30", SAVE_INTERVAL="2")
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 44 <= latest < 60, stopped[-3000:]
    resumed = _demo(out, latest + 2, EVAL_INTERVAL="30", SAVE_INTERVAL="2")
    assert f"continuing from the checkpoint of iteration {latest}" in resumed
    assert f" training from iteration {latest} to {latest + 2}" in resumed
    third = _demo(out, 42, EVAL_INTERVAL="2")
    assert "nothing to train" in third and " training from iteration" not in third
    fresh = _demo(out, 2, EVAL_INTERVAL="2", FRESH="1")
    assert " training from iteration 0 to 2" in fresh
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"

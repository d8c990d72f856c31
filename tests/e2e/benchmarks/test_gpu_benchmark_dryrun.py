"""benchmarks/gpu.sh on a machine without CUDA: the dry run of the same code path, said so."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real benchmark")
def test_gpu_sh_dry_run_on_cpu():
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run([os.path.join(ROOT, "benchmarks", "gpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "DRY RUN" in out and "not GPU performance" in out
    rows = [line for line in out.splitlines() if line.startswith("dry-run tiny mbs=")]
    assert len(rows) == 2
    for line in rows:
        tokens, ratio = re.search(r"(\d+) tokens/s .* ours/transformers ([0-9.]+)", line).groups()
        assert int(tokens) > 0 and float(ratio) > 0


def test_peak_table_and_override():
    from benchmarks.gpu_step import PEAK_BF16_TFLOPS, peak_tflops
    assert peak_tflops(torch.device("cpu"), None) is None
    assert peak_tflops(torch.device("cpu"), 500.0) == 500.0
    # more specific names first, so an "H100 PCIe" is not read as an SXM H100
    names = [k for k, _ in PEAK_BF16_TFLOPS]
    assert names.index("H100 PCIe") < names.index("H100")
    assert dict(PEAK_BF16_TFLOPS)["H200"] == 989.0

"""Model FLOP utilisation (MFU) of the log line: the peak it is measured against.

MFU = model FLOPs per iteration (:func:`megatron.model.flops.num_floating_point_operations`,
Megatron-LM's formula; for a mixture-of-experts model the active FLOPs: the top-k experts a token
is routed to and the shared expert, not all E) / iteration time / number of devices / peak FLOP/s of one device
(Chowdhery et al. 2022, "PaLM", appendix B). The peak is given (``--peak-tflops``, e.g. the
datasheet's dense bf16 number) or measured at start-up (``--measure-peak``) as the best rate of a
square matrix product in the training dtype on this process's device and threads.
"""

from __future__ import annotations

import time
from typing import Optional

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_tflops(device: torch.device, dtype: torch.dtype = torch.float32,
                        size: Optional[int] = None, repeats: int = 5) -> float:
    """Best TFLOP/s of ``size x size @ size x size`` matrix products on ``device``.

    Args:
        device: where to run (CPU: the process's torch threads).
        dtype: the training dtype (fp32, bf16 or fp16).
        size: matrix side (default 8192 on CUDA, 1024 on CPU: a fraction of a second each).
        repeats: timed products; the fastest counts (others are slowed by neighbours).

    Returns:
        TFLOP/s (1e12 floating-point operations per second; a multiply-add counts as 2).
    """
    n = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: kernel selection, thread pool
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best / 1e12


def resolve_peak_tflops(peak_tflops: Optional[float], measure_peak: bool, dtype: torch.dtype,
                        device: torch.device) -> Optional[float]:
    """The per-device peak for MFU: ``--peak-tflops``, else measured in ``dtype`` with
    ``--measure-peak``, else None (the log line then shows no MFU).

    Raises:
        ValueError: ``--peak-tflops`` not positive, or given together with ``--measure-peak``.
    """
    if peak_tflops is not None:
        if peak_tflops <= 0:
            raise ValueError(f"--peak-tflops ({peak_tflops}) must be positive: the dense peak of "
                             "one device in TFLOP/s in the training dtype")
        if measure_peak:
            raise ValueError("--peak-tflops and --measure-peak both given: keep one")
        return float(peak_tflops)
    if measure_peak:
        return measure_peak_tflops(device, dtype)
    return None


def model_flops_utilization(flops_per_iteration: float, seconds_per_iteration: float,
                            num_devices: int, peak_tflops: float) -> float:
    """MFU as a fraction: ``flops / seconds / devices / (peak_tflops * 1e12)``.

    Raises:
        ValueError: a non-positive time, device count or peak.
    """
    if seconds_per_iteration <= 0 or num_devices <= 0 or peak_tflops <= 0:
        raise ValueError(f"MFU needs positive time ({seconds_per_iteration}), devices "
                         f"({num_devices}) and peak ({peak_tflops} TFLOP/s)")
    return flops_per_iteration / seconds_per_iteration / num_devices / (peak_tflops * 1e12)

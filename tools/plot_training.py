"""Plot loss, learning rate, grad norm and throughput of a training run into one PNG.

Reads either a TensorBoard directory written by ``--tensorboard-dir`` (scalars ``lm loss``,
``lm loss validation``, ``learning-rate``, ``grad-norm``, ``iteration-time``, ``batch-size``; read
with tensorboard's ``EventAccumulator``) or a log file with Megatron's iteration lines. Usage::

    python tools/plot_training.py RUN_DIR_OR_LOG --output training.png [--seq-length 256]

Throughput is tokens/s from the log line, or from TensorBoard ``batch-size * seq-length /
iteration-time`` (samples/s when ``--seq-length`` is not given).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List, Tuple

Series = Dict[str, List[Tuple[float, float]]]

_LOG_FIELDS = {"lm loss": r"lm loss: ([-+0-9.eEnaif]+)", "learning-rate": r"learning rate: ([-+0-9.eE]+)",
               "grad-norm": r"grad norm: ([-+0-9.eEnaif]+)", "throughput": r"tokens/s: ([-+0-9.eE]+)"}
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+")
_VALIDATION = re.compile(r"validation loss at iteration (\d+).*?lm loss value: ([-+0-9.eE]+)")


def read_log(path: str) -> Series:
    """Series ``{name: [(iteration, value)]}`` from Megatron iteration and validation lines."""
    series: Series = {name: [] for name in list(_LOG_FIELDS) + ["lm loss validation"]}
    with open(path, errors="replace") as f:
        for line in f:
            it = _ITERATION.search(line)
            if it:
                for name, pattern in _LOG_FIELDS.items():
                    m = re.search(pattern, line)
                    if m:
                        series[name].append((int(it.group(1)), float(m.group(1))))
            val = _VALIDATION.search(line)
            if val:
                series["lm loss validation"].append((int(val.group(1)), float(val.group(2))))
    return {k: v for k, v in series.items() if v}


def read_tensorboard(path: str, seq_length: int = 0) -> Series:
    """Series from a TensorBoard event directory (or one event file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags().get("scalars", []))
    series: Series = {}
    for tag in ("lm loss", "lm loss validation", "learning-rate", "grad-norm"):
        if tag in tags:
            series[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    if "iteration-time" in tags and "batch-size" in tags:
        batch = {e.step: e.value for e in acc.Scalars("batch-size")}
        scale = seq_length or 1
        series["throughput"] = [(e.step, batch[e.step] * scale / e.value)
                                for e in acc.Scalars("iteration-time") if e.step in batch and e.value > 0]
    return series


def plot(series: Series, output: str, title: str = "", throughput_unit: str = "tokens/s") -> None:
    """Write a 2 x 2 PNG: loss (train and validation), learning rate, grad norm, throughput.

    Raises:
        ValueError: when ``series`` holds none of the four quantities.
    """
    if not series:
        raise ValueError("no training scalars found: expected Megatron iteration lines or TensorBoard "
                         "scalars 'lm loss', 'learning-rate', 'grad-norm', 'iteration-time'")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [("loss", ["lm loss", "lm loss validation"]), ("learning rate", ["learning-rate"]),
              ("grad norm", ["grad-norm"]), (f"throughput ({throughput_unit})", ["throughput"])]
    for ax, (label, names) in zip(axes.flat, panels):
        for name in names:
            if name in series:
                xs, ys = zip(*series[name])
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=name)
        ax.set_xlabel("iteration")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(names) > 1:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="TensorBoard directory / event file, or a training log file")
    p.add_argument("--output", default="training.png", help="PNG to write")
    p.add_argument("--seq-length", type=int, default=0,
                   help="tokens per sample, to turn TensorBoard samples/s into tokens/s")
    args = p.parse_args(argv)
    if not os.path.exists(args.source):
        print(f"error: {args.source} does not exist; give a --tensorboard-dir folder or a log file",
              file=sys.stderr)
        return 2
    is_events = os.path.isdir(args.source) or "tfevents" in os.path.basename(args.source)
    series = read_tensorboard(args.source, args.seq_length) if is_events else read_log(args.source)
    unit = "samples/s" if is_events and not args.seq_length else "tokens/s"
    try:
        # The run's folder and the source inside it (a TensorBoard folder alone says little).
        title = os.path.join(*os.path.normpath(os.path.abspath(args.source)).split(os.sep)[-2:])
        plot(series, args.output, title=title, throughput_unit=unit)
    except ValueError as err:
        print(f"error: {args.source}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

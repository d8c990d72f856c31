"""Plot loss, learning rate, grad norm and throughput of a training run into one PNG.

Reads either a TensorBoard directory written by ``--tensorboard-dir`` (scalars ``lm loss``,
``lm loss validation``, ``learning-rate``, ``grad-norm``, ``iteration-time``, ``batch-size``; read
with tensorboard's ``EventAccumulator``) or a log file with Megatron's iteration lines. Usage::

    python tools/plot_training.py RUN_DIR_OR_LOG --output training.png [--seq-length 256] \
        [--title "LLaMA 19M, TP=2 x PP=2"]

Throughput is tokens/s from the log line, or from TensorBoard ``batch-size * seq-length /
iteration-time`` (samples/s when ``--seq-length`` is not given). The grad norm is drawn on a
logarithmic axis, so one spike (an outlier batch, an fp16 overflow) does not flatten the rest of
the curve; non-finite values are left out and counted in the legend. The title names the run
(``--title``, else the model size and layout read from the log's start-up report), the
iterations drawn and the source.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Dict, List, Tuple

Series = Dict[str, List[Tuple[float, float]]]

_LOG_FIELDS = {"lm loss": r"lm loss: ([-+0-9.eEnaif]+)", "learning-rate": r"learning rate: ([-+0-9.eE]+)",
               "grad-norm": r"grad norm: ([-+0-9.eEnaif]+)", "throughput": r"tokens/s: ([-+0-9.eE]+)"}
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+")
_PARAMETERS = re.compile(r"total number of parameters: \d+ \(([0-9.]+ [MB])\)")
_LAYOUT = re.compile(r"tensor \(TP\) (\d+) x pipeline \(PP\) (\d+) x data \(DP\) (\d+)"
                     r"(?: x context \(CP\) (\d+))?")


def describe_log(path: str) -> str:
    """``"0.045 M parameters, TP=1 x PP=1 x DP=2"`` from the start-up report lines of a training
    log (megatron.training.startup_report); the parts not found are left out."""
    size = layout = None
    with open(path, errors="replace") as f:
        for line in f:
            size = size or _PARAMETERS.search(line)
            layout = layout or _LAYOUT.search(line)
            if size and layout:
                break
    parts = [f"{size.group(1)} parameters"] if size else []
    if layout:
        tp, pp, dp, cp = layout.groups()
        parts.append(f"TP={tp} x PP={pp} x DP={dp}" + (f" x CP={cp}" if cp and cp != "1" else ""))
    return ", ".join(parts)
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


def plot_title(series: Series, run: str = "", source: str = "") -> str:
    """Two lines: the run (model size, layout) and the iterations drawn, then the source."""
    iterations = [it for points in series.values() for it, _ in points]
    span = f"iterations {int(min(iterations))}-{int(max(iterations))}" if iterations else ""
    first = ", ".join(part for part in (run, span) if part)
    return "\n".join(part for part in (first, source) if part)


def plot(series: Series, output: str, title: str = "", throughput_unit: str = "tokens/s"):
    """Write a 2 x 2 PNG: loss (train and validation), learning rate, grad norm (log axis),
    throughput. Returns the (closed) matplotlib figure, for its axes.

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
        legend = len(names) > 1
        for name in (n for n in names if n in series):
            points = series[name]
            if name == "grad-norm":  # a log axis: one spike leaves the rest readable
                kept = [(x, y) for x, y in points if math.isfinite(y) and y > 0]
                if len(kept) < len(points):
                    name += f" ({len(points) - len(kept)} non-finite or zero left out)"
                    legend = True
                points = kept
                if kept:
                    ax.set_yscale("log")
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=name)
        ax.set_xlabel("iteration")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if legend:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="TensorBoard directory / event file, or a training log file")
    p.add_argument("--output", default="training.png", help="PNG to write")
    p.add_argument("--seq-length", type=int, default=0,
                   help="tokens per sample, to turn TensorBoard samples/s into tokens/s")
    p.add_argument("--title", default=None,
                   help="the run in the title (e.g. model size and layout); default: read from "
                        "a log's start-up report, none for TensorBoard events")
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
        source = os.path.join(*os.path.normpath(os.path.abspath(args.source)).split(os.sep)[-2:])
        run = args.title if args.title is not None else (
            "" if is_events else describe_log(args.source))
        plot(series, args.output, title=plot_title(series, run, source), throughput_unit=unit)
    except ValueError as err:
        print(f"error: {args.source}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run every benchmark in ``benchmarks/`` and print one table; write JSON; compare with an earlier run.

A benchmark module either exposes ``run(quick: bool) -> list[dict]`` (rows with at least
``benchmark`` and ``case``; numeric columns such as ``tokens/s``, ``ratio``, ``MFU``), or is a
script with ``main(argv)``, which is run in a subprocess through an adapter below that turns its
printed lines into rows. Usage::

    python benchmarks/run_all.py [--quick] [--only train_step gpu_step] [--output results.json]
                                 [--compare earlier.json]

``--compare`` prints, for every row and numeric column present in both runs, new / old.
Comparisons inside one run (ours vs transformers, ours vs the tokenizer's limit) are measured
side by side by the benchmarks themselves, because shared machines drift between runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

_NUMBER = r"([-+]?[0-9][0-9,]*\.?[0-9]*(?:[eE][-+]?\d+)?)"


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _parse_train_step(out: str) -> list:
    rows = []
    for name in ("ours", "reference"):
        m = re.search(rf"^\s*{name}:\s+{_NUMBER} ms/step\s+{_NUMBER} tokens/s\s+MFU\s+{_NUMBER}%", out, re.M)
        if m:
            rows.append({"benchmark": "train_step", "case": "transformers" if name == "reference" else "ours",
                         "ms/step": _num(m.group(1)), "tokens/s": _num(m.group(2)),
                         "MFU": _num(m.group(3)) / 100})
    m = re.search(rf"ratio ours / transformers: {_NUMBER}", out)
    if m and rows:
        rows[0]["ratio"] = _num(m.group(1))
    return rows


def _parse_preprocess(out: str) -> list:
    rows, shape = [], None
    for line in out.splitlines():
        m = re.match(r"^(\w+): [\d,]+ documents", line)
        if m:
            shape = m.group(1)
        m = re.match(rf"^(.{{40}})\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}%", line)
        if m and shape:
            rows.append({"benchmark": "preprocess", "case": f"{shape}: {m.group(1).strip()}",
                         "tokens/s": _num(m.group(4)), "ratio": _num(m.group(7)) / 100})
    return rows


def _parse_convert(out: str) -> list:
    rows = []
    for line in out.splitlines():
        if line.startswith("{") and '"conversion"' in line:
            r = json.loads(line)
            rows.append({"benchmark": "convert", "case": r["conversion"], "seconds": r["seconds"],
                         "peak GiB": r["peak_anon_GiB"], "theory": r["model_GiB"]})
    return rows


# Scripts without run(): (arguments in quick mode, arguments in full mode, parser of their stdout).
ADAPTERS = {
    "train_step": (["--rounds", "5", "--steps", "1"], [], _parse_train_step),
    "preprocess": (["--repeats", "1"], [], _parse_preprocess),
    "convert": (["--layers", "2", "--hidden", "256", "--ffn", "688", "--heads", "4",
                 "--groups", "2", "--vocab", "1024"], [], _parse_convert),
}
SKIP = {"run_all", "__init__", "gemm_ceiling"}  # gemm_ceiling: a helper of train_step


def discover() -> list:
    return sorted(f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and f[:-3] not in SKIP)


def run_script(name: str, quick: bool) -> list:
    """Run ``benchmarks/<name>.py`` in a subprocess and parse its output into rows."""
    quick_args, full_args, parse = ADAPTERS.get(name, ([], [], lambda out: []))
    proc = subprocess.run([sys.executable, os.path.join(HERE, f"{name}.py")]
                          + (quick_args if quick else full_args), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return [{"benchmark": name, "case": "FAILED", "error": proc.stderr.strip().splitlines()[-1:]}]
    rows = parse(proc.stdout)
    return rows or [{"benchmark": name, "case": "output", "note": proc.stdout.strip().splitlines()[-1:]}]


def run_benchmark(name: str, quick: bool) -> list:
    module = importlib.import_module(f"benchmarks.{name}")
    run = getattr(module, "run", None)
    # The module's own run(quick); a ``run`` it merely imports (preprocess.py imports the
    # preprocessor's) does not count.
    if callable(run) and getattr(run, "__module__", None) == module.__name__:
        return run(quick=quick)
    return run_script(name, quick)


# "measured" / "theory": a quantity beside its formula (bubble fraction, MB sent, state MB);
# convert's "theory" is the model's size, "peak GiB" the conversion's peak anonymous memory;
# dist_checkpoint's "of ceiling" is a share of the disk's sequential write speed (GB/s);
# context_parallel's "... ratio" columns are a rank's figure at CP over the one process's.
NUMERIC_COLUMNS = ("tokens/s", "TFLOP/s", "MFU", "reference tokens/s", "ratio", "of ceiling", "ms/step",
                   "measured", "theory", "peak GiB", "seconds", "GB/s", "peak MB ratio",
                   "saved MB ratio", "cpu ms/step ratio")


def format_table(rows: list, previous: dict | None = None) -> str:
    """One text table: benchmark, case and the numeric columns present; ``vs old`` columns
    (new / old) for rows found in ``previous`` (keyed by benchmark and case)."""
    columns = [c for c in NUMERIC_COLUMNS if any(isinstance(r.get(c), (int, float)) for r in rows)]
    header = f"{'benchmark':<12} {'case':<40}" + "".join(f"{c:>20}" for c in columns)
    lines = [header, "-" * len(header)]
    for r in rows:
        line = f"{r['benchmark']:<12} {str(r['case'])[:40]:<40}"
        old = (previous or {}).get((r["benchmark"], str(r["case"])), {})
        for c in columns:
            v = r.get(c)
            cell = "" if not isinstance(v, (int, float)) else (
                f"{v:.1%}" if c in ("MFU", "of ceiling") else f"{v:,.0f}" if abs(v) >= 1000
                else f"{v:.3g}")
            if isinstance(v, (int, float)) and isinstance(old.get(c), (int, float)) and old[c]:
                cell += f" ({v / old[c]:.2f}x)"
            line += f"{cell:>20}"
        for key in ("error", "note"):
            if key in r:
                line += f"  {key}: {r[key]}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short variants (checks the harness, not performance)")
    p.add_argument("--only", nargs="+", default=None, help="benchmark module names to run")
    p.add_argument("--output", default=None, help="write rows as JSON here")
    p.add_argument("--compare", default=None, help="an earlier --output JSON to compare with")
    args = p.parse_args(argv)
    names = discover()
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            p.error(f"--only: no benchmark named {unknown}; available: {names}")
        names = [n for n in names if n in args.only]
    previous = None
    if args.compare:
        with open(args.compare) as f:
            previous = {(r["benchmark"], str(r["case"])): r for r in json.load(f)["rows"]}
    rows = []
    for name in names:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        rows += run_benchmark(name, args.quick)
        print(f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    print(format_table(rows, previous))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"quick": args.quick, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows},
                      f, indent=1, default=str)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

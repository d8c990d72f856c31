"""Time to the first iteration of a run that loads a checkpoint: the model drawn at random and
then overwritten by the load (the old path) against the model built on the meta device and only
filled by the load (``weights_from_checkpoint``, what ``pretrain`` does when ``--load`` names a
checkpoint).

The model is one 70B-shaped layer (hidden 8192, ffn 28672, 64 heads in 8 query groups, Llama-2
70B's layer) with a small vocabulary (1024 rows, so the layer dominates), fp32, one process on the
CPU; ``--quick``: hidden 1024, ffn 3584, 8 heads in 2 groups. A checkpoint of the weights (no
optimizer state) is written to a temporary folder first; then each path builds the model
(:func:`megatron.training.builders.build_model_chunks`) and loads the checkpoint into it with
``--finetune`` (:func:`megatron.checkpointing.load_checkpoint`), the page cache warm. The DDP
wrapper and the optimizer, the same on both paths, are left out (their buffers would double the
memory of the 70B-shaped layer). Figures are the median of the rounds
(the paths alternate).

Usage: python benchmarks/startup.py [--quick] [--rounds N]; ``run(quick)`` returns the rows for
run_all.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

SHAPES = {False: (8192, 28672, 64, 8), True: (1024, 3584, 8, 2)}


def _config(quick: bool, ckpt: str, **flags):
    from megatron import arguments
    from megatron.config import build_config

    hidden, ffn, heads, groups = SHAPES[quick]
    argv = ["--num-layers", "1", "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
            "--num-attention-heads", str(heads), "--group-query-attention",
            "--num-query-groups", str(groups), "--seq-length", "16", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-4", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1023", "--data-path", "unused", "--no-save-optim", "--no-save-rng"]
    for flag, value in flags.items():
        argv += [f"--{flag.replace('_', '-')}"] + ([] if value is True else [str(value)])
    args = arguments.parse_args(argv)
    arguments.validate_args(args, 1, check_files=False)
    return build_config(args, vocab_size=1024)


def _start(config, groups, meta: bool) -> dict:
    """Seconds of the model build and of the load, for one path."""
    import pretrain_llama
    from megatron import checkpointing
    from megatron.config import checkpoint_args
    from megatron.training import builders

    start = time.perf_counter()
    model = builders.build_model_chunks(config, pretrain_llama.model_provider, groups,
                                        torch.device("cpu"), weights_from_checkpoint=meta)
    built = time.perf_counter()
    checkpointing.load_checkpoint(model, None, None, config.checkpoint, groups,
                                  run_flags=checkpoint_args(config))
    loaded = time.perf_counter()
    params = sum(p.numel() for chunk in model for p in chunk.parameters())
    del model
    gc.collect()
    return {"build": built - start, "load": loaded - built, "params": params}


def run(quick: bool = False, rounds: int = 3) -> list:
    """Rows: model build, checkpoint load and their sum for the eager and the meta-device path,
    in seconds."""
    import pretrain_llama
    from megatron import checkpointing
    from megatron.config import checkpoint_args
    from megatron.training import builders
    from megatron.training.initialize import initialize_megatron, shutdown

    with tempfile.TemporaryDirectory() as tmp:
        saving = _config(quick, tmp, save=tmp)
        device, created, groups = initialize_megatron(saving)
        try:
            model = builders.build_model_chunks(saving, pretrain_llama.model_provider, groups, device)
            checkpointing.save_checkpoint(1, model, None, None, saving.checkpoint, groups,
                                          run_flags=checkpoint_args(saving),
                                          consumed_train_samples=1, consumed_valid_samples=0)
            del model
            gc.collect()
            loading = _config(quick, tmp, load=tmp, finetune=True)
            times = {False: [], True: []}
            for _ in range(rounds):
                for meta in (False, True):
                    times[meta].append(_start(loading, groups, meta))
        finally:
            shutdown(created)
    hidden, ffn, heads, query_groups = SHAPES[quick]
    shape = (f"1 layer h{hidden} ffn{ffn} GQA {heads}/{query_groups}, "
             f"{times[False][0]['params'] / 1e6:.0f}M params fp32")
    rows = []
    for meta, name in ((False, "eager init, then load (before)"),
                       (True, "meta build, then load (after)")):
        med = {k: statistics.median(t[k] for t in times[meta]) for k in ("build", "load")}
        rows.append({"benchmark": "startup", "case": f"{name}: {shape}",
                     "seconds": round(med["build"] + med["load"], 3),
                     "note": f"build {med['build']:.3f} s + load {med['load']:.3f} s "
                             f"(median of {rounds})"})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1024-wide layer instead")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each path (default 3)")
    args = parser.parse_args(argv)
    for row in run(args.quick, args.rounds):
        print(f"{row['case']}: {row['seconds']:.3f} s to the first iteration ({row['note']})")


if __name__ == "__main__":
    main()

"""pretrain_llama.main() runs inside process worlds: the small model's flags and the comparison of
histories, shared by the end-to-end tests (the dataset is the ``data_prefix`` fixture of conftest.py)."""

import copy
import hashlib
import os

import numpy as np

VOCAB = 127  # NullTokenizer: ids 0..126, end-of-document 127, vocabulary 128

ITERS = 10

# The layout tests' runs (tests/e2e/test_pretrain_e2e.py): long enough for a clip factor that
# depended on the layout to show (1.1e-5 at TP=2 x PP=2 after 20 iterations before it was exact),
# at lr 1e-3 (at BASE's 5e-3 clipped AdamW grows fp32 rounding to 9e-6 in the grad norm by
# iteration 13 at DP=2 as at TP=2, in the loss to 1e-7: see CP_BASE).
LAYOUT_ITERS = 20
LAYOUT_LR = ["--lr", "1e-3", "--min-lr", "1e-4"]


CLIP = 0.3  # below every iteration's grad norm here: each step clips (folded into fused AdamW)

BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
    "--lr", "5e-3", "--min-lr", "5e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.1", "--clip-grad", str(CLIP),
    "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
    "--make-vocab-size-divisible-by", "64", "--split", "90,10,0",
    "--log-interval", "5", "--eval-interval", "5", "--eval-iters", "2", "--seed", "7",
    "--num-workers", "0",
]

UNTIED = ["--untie-embeddings-and-output-weights"]

MASKED = ["--eod-mask-loss", "--calculate-per-token-loss", "--reset-position-ids",
          "--reset-attention-mask"]


# Context-parallel runs are held to rtol 1e-6 over 20 iterations: at lr 5e-3 rounding grows to
# 1e-5 in the grad norm by iteration 13 in every layout (TP=2 too, measured), at 1e-3 it stays
# at 1e-7. Vocabulary 128 padded to 160 rows at TP 1 and 2 (the padding rows are out of the loss).
# Global batch 4 (2 micro-batches of 2 at DP = 1) keeps the 20 iterations cheap.
CP_ITERS = 20
CP_BASE = ["--train-iters", str(CP_ITERS), "--lr", "1e-3", "--min-lr", "1e-4",
           "--global-batch-size", "4", "--make-vocab-size-divisible-by", "80",
           "--eval-interval", "10", "--eval-iters", "1", *UNTIED]

# Document masks and positions, per-token loss (documents cross the split's chunk boundaries).
CP_MASKED = ["--eod-mask-loss", "--calculate-per-token-loss", "--reset-position-ids",
             "--reset-attention-mask"]


def cp_args(cp, comm_type="p2p"):
    return ["--context-parallel-size", str(cp), "--cp-comm-type", comm_type]


def layout_args(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def run_many(runs):
    """Run ``pretrain_llama.main`` for each ``(name, argv)`` in this world; the histories of the
    last rank (last pipeline stage) by name."""
    import torch.distributed as dist

    import pretrain_llama

    out = {}
    for name, argv in runs:
        history = pretrain_llama.main(argv)
        out[name] = history
        dist.barrier()
    return out if dist.get_rank() == dist.get_world_size() - 1 else None


# The one-process histories this pytest process has computed, by configuration (see one_process).
_ONE_PROCESS = {}
_PATH_FLAGS = ("--data-path", "--data-cache-path")
# A folder the pytest worker processes of one run share (tests/conftest.py sets it under
# pytest-xdist), where each writes the histories it computed for the others; None: this process's
# memo only.
_SHARED_MEMO = None


def share_one_process_memo(folder):
    """Let this pytest process read and write one-process histories in ``folder`` (a folder of
    this test run that every worker process sees), besides its own memo."""
    global _SHARED_MEMO
    _SHARED_MEMO = folder


def configuration(argv):
    """``argv`` as a key, with the paths of ``--data-path`` and ``--data-cache-path`` left out:
    every module's ``data_prefix`` (conftest.py) holds the same documents, drawn from
    ``RandomState(0)``, and the cache only holds indices built from them, so two runs that differ
    only there train alike. A blend's weights (``--data-path 0.3 A 0.7 B``: the numbers among the
    flag's values) and any other path (``--save``, ``--load``) stay in the key."""
    key, values_of = [], None
    for arg in argv:
        if arg.startswith("--"):
            flag, eq, _ = arg.partition("=")
            values_of = flag if flag in _PATH_FLAGS and not eq else None
            key.append(f"{flag}=<path>" if eq and flag in _PATH_FLAGS else arg)
        elif values_of is not None:
            key.append(arg if _is_number(arg) and values_of == "--data-path" else "<path>")
        else:
            key.append(arg)
    return tuple(key)


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def _shared_file(key):
    """The file of ``key``'s history in the shared folder; None when there is none, or when the
    run reads or writes a checkpoint (its folder is another process's: a resumed run must come
    after the run that saved, in the same process)."""
    if _SHARED_MEMO is None or any(arg == flag or arg.startswith(flag + "=")
                                   for arg in key for flag in ("--save", "--load")):
        return None
    return os.path.join(_SHARED_MEMO, hashlib.sha256(repr(key).encode()).hexdigest() + ".pt")


def _read_shared(key):
    import torch

    path = _shared_file(key)
    if path is None or not os.path.exists(path):
        return None
    return torch.load(path, weights_only=True)


def _write_shared(key, history):
    import torch

    path = _shared_file(key)
    if path is None:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(history, tmp)
    os.replace(tmp, path)  # whole or absent for a reader in another process


def one_process(runs, timeout=900):
    """The one-process reference of each ``(name, argv)``: ``run_many`` in a 1-rank world for the
    configurations this pytest session has not run yet (in the given order, so that a run
    resuming from another's ``--save`` comes after it), the others from the session's memo, as a
    session-scoped fixture shared by every module would give them; under pytest-xdist the
    session's worker processes share what each computed (``share_one_process_memo``). Returns the
    histories by name, copies (a test may change its own). The oracle is a live run of this test
    session, never a stored file from another."""
    from tests.helpers.dist import run_distributed

    for _, argv in runs:
        key = configuration(argv)
        if key not in _ONE_PROCESS:
            shared = _read_shared(key)
            if shared is not None:
                _ONE_PROCESS[key] = shared
    missing = [(name, argv) for name, argv in runs if configuration(argv) not in _ONE_PROCESS]
    if missing:
        got = run_distributed(1, run_many, missing, timeout=timeout)[0]
        for name, argv in missing:
            _ONE_PROCESS[configuration(argv)] = got[name]
            _write_shared(configuration(argv), got[name])
    return {name: copy.deepcopy(_ONE_PROCESS[configuration(argv)]) for name, argv in runs}


def run_finetune(runs):
    """``finetune_llama.main`` (SFT or DPO) for each ``(name, argv)`` in this world; the last
    rank's histories by name."""
    import torch.distributed as dist

    import finetune_llama

    out = {}
    for name, argv in runs:
        out[name] = finetune_llama.main(argv)
        dist.barrier()
    return out if dist.get_rank() == dist.get_world_size() - 1 else None


def e2e_argv(data_prefix, cache, *extra):
    return BASE + ["--data-path", data_prefix, "--data-cache-path", cache] + list(extra)


def assert_close_history(a, b, name, rtol=1e-6, grad_norm_rtol=None, clip=CLIP):
    """Losses, validation losses and grad norms of two runs equal within ``rtol`` (grad norms
    within ``grad_norm_rtol`` when given), with the clipping active on every iteration (each norm
    above ``clip``; None: not asserted). fp32: a layout sums in another order, nothing else may
    differ. Prints the largest differences (``pytest -s`` shows them)."""
    print(f"{name}: " + ", ".join(f"{key} {relative_difference(a[key], b[key]):.1e}"
                                  for key in ("lm loss", "grad norm")))
    if clip is not None:
        assert min(b["grad norm"]) > clip, f"{name}: not clipped on every iteration"
    np.testing.assert_allclose(a["lm loss"], b["lm loss"], rtol=rtol, err_msg=f"{name}: lm loss")
    np.testing.assert_allclose(a["grad norm"], b["grad norm"], rtol=grad_norm_rtol or rtol,
                               err_msg=f"{name}: grad norm")
    np.testing.assert_allclose([v for _, v in a["valid"]], [v for _, v in b["valid"]], rtol=rtol,
                               err_msg=f"{name}: validation loss")


def history_tail(history, first_iteration):
    """The part of ``history`` from ``first_iteration`` on (a resumed run's iterations)."""
    keep = [i for i, it in enumerate(history["iteration"]) if it >= first_iteration]
    return {"iteration": [history["iteration"][i] for i in keep],
            "lm loss": [history["lm loss"][i] for i in keep],
            "grad norm": [history["grad norm"][i] for i in keep],
            "valid": [(it, v) for it, v in history["valid"] if it >= first_iteration]}


def relative_difference(got, want) -> float:
    """The largest ``|got - want| / |want|`` of two equally long lists (0 where both are equal,
    also at 0; inf where only ``want`` is 0)."""
    diff, scale = np.abs(np.subtract(got, want)), np.abs(np.asarray(want, dtype=float))
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.max(np.where(diff == 0, 0.0, diff / scale)))

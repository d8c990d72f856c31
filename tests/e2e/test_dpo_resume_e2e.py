"""A DPO run resumes exactly: ``finetune_llama.main(--dpo)`` trained 4 iterations straight equals
2 iterations (``--exit-interval 2``) then a resume (``--load`` of its own ``--save``, no
``--finetune``) of 2 more, which reads the saved reference table instead of recomputing it from the
partly trained weights.

Oracle: the straight run. Bitwise equality (fp32, the same layout, the same sums): DPO losses,
sequence log-probabilities, rewards, grad norms, the final validation values and the final
weights (legacy checkpoints, every shard). One process, PP=2 and TP=2 with ``--ckpt-format torch``,
DP=2 with ``torch_dist``. A recomputed reference would differ: its rewards would start at 0 (asserted).
"""

import os
import shutil

import numpy as np
import pytest
import torch

from tests.e2e.test_dpo_e2e import DPO_BASE, write_pairs
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import layout_args, run_finetune

KEYS = ("dpo loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected",
        "rewards/margins", "rewards/accuracies", "grad norm")


@pytest.fixture(scope="module")
def dpo_prefix(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("dpo_resume_data"))


def _runs(prefix, root, fmt, reference=False):
    """The straight run, the first half and the resume; with ``reference`` the two fresh runs
    start from a DPO checkpoint of 2 iterations (``--load REF --finetune``), written first."""
    base = DPO_BASE + ["--data-path", prefix, "--ckpt-format", fmt, "--save-interval", "100"]
    straight, halves, ref = str(root / "straight"), str(root / "halves"), str(root / "ref")
    fresh = ["--load", ref, "--finetune"] if reference else []
    return ([("reference", base + ["--save", ref, "--train-iters", "2"])] if reference else []) + [
        ("straight", base + ["--save", straight] + fresh),
        ("first half", base + ["--save", halves, "--exit-interval", "2"] + fresh),
        ("resumed", base + ["--load", halves, "--save", halves])]


def _tail(history, first):
    keep = [i for i, it in enumerate(history["iteration"]) if it >= first]
    return {key: [history[key][i] for i in keep] for key in KEYS}


def _assert_resumed(out, root, legacy):
    straight, resumed = out["straight"], out["resumed"]
    assert resumed["iteration"] == [3, 4]
    want = _tail(straight, 3)
    for key in KEYS:
        assert resumed[key] == want[key], f"{key}: {resumed[key]} != {want[key]}"
    # The policy has moved away from the reference: a recomputed table would give rewards 0.
    assert min(abs(v) for v in resumed["rewards/margins"]) > 1e-5
    assert resumed["final valid"] == straight["final valid"]
    for name in ("straight", "halves"):
        assert os.path.isfile(root / name / "dpo_reference.npz")
    if legacy:
        shards = sorted(os.listdir(root / "straight" / "iter_0000004"))
        assert shards
        for shard in shards:
            a, b = (torch.load(root / name / "iter_0000004" / shard / "model_optim_rng.pt",
                               map_location="cpu", weights_only=True)["model"]
                    for name in ("straight", "halves"))
            assert a.keys() == b.keys() and len(a) > 0
            for key in a:
                if isinstance(a[key], torch.Tensor):
                    assert torch.equal(a[key], b[key]), f"{shard} {key}"


def test_resume_one_process(dpo_prefix, tmp_path, capsys):
    import json

    import finetune_llama

    out = run_distributed(1, run_finetune, _runs(dpo_prefix, tmp_path, "torch", reference=True),
                          timeout=900)[0]
    _assert_resumed(out, tmp_path, legacy=True)
    with np.load(tmp_path / "halves" / "dpo_reference.npz", allow_pickle=False) as f:
        meta, table, pairs = json.loads(str(f["meta"])), f["table"], f["pairs"]
    # What it was computed from: the reference checkpoint (2 iterations), the data, the flags.
    assert meta["reference_load"] == os.path.realpath(tmp_path / "ref")
    assert meta["reference_iteration"] == 2
    assert meta["data_path"] == os.path.realpath(dpo_prefix) and meta["documents"] == 80
    assert (meta["seq_length"], meta["length_normalization"], meta["vocab_size"]) == \
        (16, False, 128)
    assert table.shape == (80, 2) and table.dtype == np.float32
    assert np.all(table[pairs] < 0) and np.all(table[np.setdiff1d(np.arange(80), pairs)] == 0)
    # A resume that reads more pairs than the table holds: one line, exit 2, nothing trained.
    capsys.readouterr()
    argv = _runs(dpo_prefix, tmp_path, "torch")[-1][1] + ["--train-iters", "40",
                                                          "--override-opt_param-scheduler"]
    assert finetune_llama.command(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "preference pairs the reference table does not hold" in err[0], err
    assert sorted(os.listdir(tmp_path / "halves"))[-1] == "latest_checkpointed_iteration.txt"


def test_resume_dp2_torch_dist(dpo_prefix, tmp_path):
    """DP=2, torch_dist, the resume saving into another folder: the table is copied there."""
    runs = _runs(dpo_prefix, tmp_path, "torch_dist")
    runs[-1] = ("resumed", runs[-1][1] + ["--save", str(tmp_path / "resumed")])
    out = run_distributed(2, run_finetune, runs, timeout=900)[1]
    _assert_resumed(out, tmp_path, legacy=False)
    tables = []
    for name in ("halves", "resumed"):
        with np.load(tmp_path / name / "dpo_reference.npz", allow_pickle=False) as f:
            tables.append({key: f[key] for key in ("table", "pairs", "meta")})
    for key in ("table", "pairs", "meta"):
        assert np.array_equal(tables[0][key], tables[1][key]), key


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)], ids=["pp2", "tp2"])
def test_resume_model_parallel(dpo_prefix, tmp_path, tp, pp):
    """PP=2: the table is filled on the last stage (rank 1), which writes it; TP=2: tensor-parallel
    rank 0 writes it. Both ranks' weight shards are compared."""
    runs = [(name, argv + layout_args(tp, pp))
            for name, argv in _runs(dpo_prefix, tmp_path, "torch")]
    out = run_distributed(2, run_finetune, runs, timeout=900)[1]
    _assert_resumed(out, tmp_path, legacy=True)
    assert len(os.listdir(tmp_path / "halves" / "iter_0000004")) == 2


def test_resume_refusals(dpo_prefix, tmp_path, capsys):
    """A missing table, one of another run, one without a checkpoint, and pairs it lacks: one
    line, exit 2."""
    import finetune_llama
    from megatron.training.dpo_reference import check_pairs, save_reference
    from megatron.usage_error import UsageError

    folder = tmp_path / "save"
    folder.mkdir()
    argv = DPO_BASE + ["--data-path", dpo_prefix, "--load", str(folder)]
    assert finetune_llama.command(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{folder}/dpo_reference.npz is missing" in err[0]
    assert "--finetune" in err[0]
    meta = {"data_path": os.path.realpath(dpo_prefix), "documents": 80, "seq_length": 1,
            "length_normalization": False, "vocab_size": 128, "reference_load": None,
            "reference_iteration": 0}
    save_reference(str(folder), np.zeros((80, 2), np.float32), np.arange(80), meta)
    assert finetune_llama.command(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "computed for --seq-length 1, this run has" in err[0]
    # A table and no checkpoint (stopped before the first save): training would start from the
    # initial weights against the reference's table.
    with open(folder / "dpo_reference.npz", "rb") as f:
        data = dict(np.load(f, allow_pickle=False))
    meta["seq_length"] = 16
    save_reference(str(folder), data["table"], data["pairs"], meta)
    assert finetune_llama.command(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint yet" in err[0]
    with pytest.raises(UsageError, match=r"reads 2 preference pairs .* \(first: document 7\)"):
        check_pairs(str(folder), np.arange(7), np.arange(9))
    shutil.rmtree(folder)


@pytest.mark.parametrize("kind", ["named pipe", "folder", "symbolic link to nothing"])
def test_a_reference_table_that_is_no_regular_file_is_named_and_never_read(dpo_prefix, tmp_path,
                                                                         capsys, kind):
    """A ``dpo_reference.npz`` that is a FIFO, a folder or a broken link was called "missing"
    (and a FIFO was one open away from waiting forever): the line says what it is."""
    import threading

    import finetune_llama

    folder = tmp_path / "save"
    folder.mkdir()
    path = folder / "dpo_reference.npz"
    if kind == "named pipe":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        os.symlink(tmp_path / "gone.npz", path)
    argv = DPO_BASE + ["--data-path", dpo_prefix, "--load", str(folder)]
    status = []
    worker = threading.Thread(target=lambda: status.append(finetune_llama.command(argv)))
    worker.start()
    worker.join(timeout=300)
    if worker.is_alive():  # it opened the pipe for reading: release it, then fail
        with open(path, "wb"):
            pass
        worker.join()
        pytest.fail("the named pipe was opened for reading")
    err = capsys.readouterr().err.strip().splitlines()
    assert status == [2] and len(err) == 1, err
    assert f"{path} is a {kind}, not a regular file; remove it" in err[0] and "missing" not in err[0]

"""W&B logging (--wandb-project, --wandb-exp-name, --wandb-save-dir) in offline mode: the run's
files hold the TensorBoard scalars at each iteration. Skips when wandb (an optional extra) is not
installed; .ci/run installs it."""

import glob
import json
import os

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import ITERS, e2e_argv


BLOCK, HEADER = 32768, 7  # W&B's transaction log: LevelDB-style 32 KiB blocks, 7-byte headers


def _records(run_file):
    """The protobuf records of a W&B run file (``:W&B`` header, then records of FULL / FIRST /
    MIDDLE / LAST pieces, none crossing a 32 KiB block), read here because wandb's own reader
    is no longer Python."""
    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    pos, pieces = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pieces += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            yield pieces
            pieces = b""


def _history(run_file):
    """The history rows of an offline run file, as wandb sync reads them."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for data in _records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def _main(argv):
    import pretrain_llama

    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    return pretrain_llama.main(argv)


def test_wandb_offline_run_holds_the_tensorboard_scalars(data_prefix, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install -e '.[wandb]' "
                                        "(.ci/run installs it)")
    save_dir = str(tmp_path / "wandb")
    argv = e2e_argv(data_prefix, str(tmp_path / "cache"), "--wandb-project", "megatron-test",
                    "--wandb-exp-name", "tiny", "--wandb-save-dir", save_dir)
    history = run_distributed(1, _main, argv, timeout=600)[0]
    runs = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, os.listdir(save_dir)
    rows = _history(runs[0])
    training = [r for r in rows if "lm loss" in r]
    assert [r["_step"] for r in training] == list(range(1, ITERS + 1))
    for row, loss, lr, norm in zip(training, history["lm loss"], history["learning rate"],
                                   history["grad norm"]):
        assert row["lm loss"] == pytest.approx(loss, rel=1e-12)
        assert row["learning-rate"] == pytest.approx(lr, rel=1e-12)
        assert row["grad-norm"] == pytest.approx(norm, rel=1e-12)
        assert row["batch-size"] == 8 and row["loss-scale"] == 1.0 and row["iteration-time"] > 0
    valid = {r["_step"]: r["lm loss validation"] for r in rows if "lm loss validation" in r}
    assert sorted(valid) == [5, 10]
    assert valid[5] == pytest.approx(dict(history["valid"])[5], rel=1e-12)


def test_wandb_flags_without_the_library_or_a_name_fail_clearly(monkeypatch):
    import importlib.util

    from megatron.training import wandb_writer

    assert wandb_writer.wandb_flag_error(None, None, None, None) is None
    assert "needs --wandb-exp-name" in wandb_writer.wandb_flag_error("p", None, "d", None)
    assert "--wandb-save-dir DIR or --save DIR" in wandb_writer.wandb_flag_error("p", "e", None, None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    message = wandb_writer.wandb_flag_error("p", "e", None, "ckpt")
    assert message == ("--wandb-project needs the wandb library, an optional extra: pip install -e "
                       "'.[wandb]' (or pip install wandb)")

"""``megatron.training.dpo_reference.read_reference`` on crafted ``dpo_reference.npz`` files
(the fourth hostile pass): each is one UsageError naming the file, and no array is read before
its header fits the meta (a header claiming 10^12 rows had numpy try to allocate 7 TiB)."""

import io
import json
import zipfile

import numpy as np
import pytest

from megatron.training import dpo_reference
from megatron.usage_error import UsageError


def _write(folder, meta, table=None, pairs=None, raw_table=None):
    table = np.zeros((3, 2), np.float32) if table is None else table
    pairs = np.arange(2, dtype=np.int64) if pairs is None else pairs
    with open(dpo_reference.reference_file(str(folder)), "wb") as f:
        np.savez(f, table=table, pairs=pairs, meta=np.array(meta))
    if raw_table is not None:  # replace table.npy by bytes whose header says anything
        path = dpo_reference.reference_file(str(folder))
        with zipfile.ZipFile(path) as z:
            members = {n: z.read(n) for n in z.namelist()}
        members["table.npy"] = raw_table
        with zipfile.ZipFile(path, "w") as z:
            for name, data in members.items():
                z.writestr(name, data)


def _huge_header():
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False,
                                               "shape": (10 ** 12, 2)})
    return buf.getvalue() + b"\0" * 16


GOOD = {"documents": 3}


@pytest.mark.parametrize("meta, extra, why", [
    ("[1, 2]", {}, "not a JSON object with a document count"),
    ("7", {}, "not a JSON object with a document count"),
    ('{"seq_length": 16}', {}, "not a JSON object with a document count"),
    ("[" * 100000, {}, "RecursionError"),
    (json.dumps(GOOD), {"raw_table": _huge_header()}, "table is ((1000000000000, 2)"),
    (json.dumps(GOOD), {"table": np.zeros((4, 2), np.float32)}, "table is ((4, 2)"),
    (json.dumps(GOOD), {"pairs": np.arange(5, dtype=np.int64)}, "pairs is (5,)"),
])
def test_a_crafted_reference_table_is_one_usage_error(tmp_path, meta, extra, why):
    _write(tmp_path, meta, **extra)
    with pytest.raises(UsageError, match="dpo_reference.npz: not a DPO reference table") as err:
        dpo_reference.read_reference(str(tmp_path), {})
    assert why in str(err.value), str(err.value)


def test_a_table_that_fits_is_read(tmp_path):
    table = np.arange(6, dtype=np.float32).reshape(3, 2)
    _write(tmp_path, json.dumps(GOOD), table=table)
    got, pairs, meta = dpo_reference.read_reference(str(tmp_path), {"documents": 3})
    assert np.array_equal(got, table) and pairs.tolist() == [0, 1] and meta == GOOD

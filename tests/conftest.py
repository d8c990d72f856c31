"""Fixtures shared by the whole suite: the reference data folder, a small dataset for end-to-end
runs and the files argument validation checks for. Builders live in ``tests/helpers``."""

import collections
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.helpers.paths import SHARED_DATA  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long tests (kill/restart, multi-node, demo); run with -m slow")


# Under pytest-xdist (pytest.ini) the test modules go to the two workers in this order: the modules
# of many tests first, as pytest-xdist orders them itself (its --loadscope-reorder: the default
# suite took 547 to 573 s so, 670 s in the order of the files), but these modules of one test of
# minutes start first: the slow tier ended waiting for the demo alone (911 s, the demo last).
START_FIRST = ("tests/e2e/test_demo.py",)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    modules = [item.nodeid.split("::")[0] for item in items]
    counts = collections.Counter(modules)
    first_seen = {m: i for i, m in reversed(list(enumerate(modules)))}
    order = {id(item): (m not in START_FIRST, -counts[m], first_seen[m], i)
             for i, (item, m) in enumerate(zip(items, modules))}
    items.sort(key=lambda item: order[id(item)])


def pytest_deselected(items):
    if items:
        from tests.helpers.suite_counts import record_deselected
        record_deselected(items[0].config, items)


def pytest_collection_finish(session):
    from tests.helpers.suite_counts import record_collection
    record_collection(session)


@pytest.fixture(scope="session", autouse=True)
def _warm_worlds():
    """The warm worlds of ``run_distributed`` live for the session and end with it."""
    from tests.helpers.dist import shutdown_pool

    yield
    shutdown_pool()


@pytest.fixture(scope="session", autouse=True)
def _one_process_memo(tmp_path_factory):
    """Under pytest-xdist (pytest.ini's ``-n``) the worker processes of this run share the
    one-process references each computed, in a folder of the run's temporary root (one per
    run: pytest-xdist gives each worker its own folder inside it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from tests.helpers.pretrain import share_one_process_memo

        folder = tmp_path_factory.getbasetemp().parent / "one_process_memo"
        folder.mkdir(exist_ok=True)
        share_one_process_memo(str(folder))
    yield


@pytest.fixture(scope="session")
def shared_data():
    """Path of the shared reference data folder; skips the test where it is absent."""
    if not os.path.isdir(SHARED_DATA):
        pytest.skip("../shared/data is not present on this machine")
    return SHARED_DATA


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """200 documents of 3..40 random tokens, each ended by the EOD token (127), for the runs of
    ``tests/helpers/pretrain.py``."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    from tests.helpers.pretrain import VOCAB

    folder = tmp_path_factory.mktemp("e2e_data")
    prefix = str(folder / "tiny_text_document")
    rng = np.random.RandomState(0)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(200):
        doc = rng.randint(0, VOCAB, size=rng.randint(3, 41)).tolist() + [VOCAB]
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def files(tmp_path):
    """A dataset prefix (1000 documents of 300 zero tokens: validation reads only its .idx) and a
    tokenizer file (validation only checks it exists)."""
    from tests.helpers.data import placeholder_dataset

    prefix = placeholder_dataset(str(tmp_path / "corpus_text_document"))
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"")
    return {"prefix": prefix, "model": str(model), "dir": str(tmp_path)}

"""The whole suite's test counts as this pytest session collected them, so that a test can read
them without collecting the suite again in a fresh interpreter (about 35 s).

``tests/conftest.py`` records, in the session's config, the items pytest kept and the ones it
deselected (``-m "not slow"`` of pytest.ini, ``-k``, ``--deselect``): together every collected
test. They are the whole suite only when the session collected pytest.ini's ``testpaths`` (or the
tests folder itself) with nothing ignored and no ``--lf`` narrowing the files read.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import pytest

from tests.helpers.paths import ROOT

_ITEMS = pytest.StashKey[List[pytest.Item]]()
_DESELECTED = pytest.StashKey[List[pytest.Item]]()


def record_deselected(config: pytest.Config, items: List[pytest.Item]) -> None:
    """The ``pytest_deselected`` hook's items, kept in ``config``."""
    config.stash.setdefault(_DESELECTED, []).extend(items)


def record_collection(session: pytest.Session) -> None:
    """The items ``session`` will run, kept in its config (``pytest_collection_finish``)."""
    session.config.stash[_ITEMS] = list(session.items)


def _whole_suite(config: pytest.Config) -> bool:
    tests = os.path.join(ROOT, "tests")
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        paths = [os.path.join(str(config.rootpath), a) for a in config.args]
    else:
        paths = [os.path.join(str(config.invocation_params.dir), a) for a in config.args]
    narrowed = (config.getoption("ignore") or config.getoption("ignore_glob")
                or config.getoption("lf", False))
    return not narrowed and bool(paths) and all(
        os.path.realpath(p) in (os.path.realpath(tests), os.path.realpath(ROOT)) for p in paths)


def whole_suite_counts(config: pytest.Config) -> Optional[Tuple[int, int]]:
    """``(default, slow)``: tests without and with the ``slow`` mark among every test this session
    collected, or None when the session did not collect the whole suite (a module run alone)."""
    if _ITEMS not in config.stash or not _whole_suite(config):
        return None
    items = config.stash[_ITEMS] + config.stash.get(_DESELECTED, [])
    slow = sum(1 for item in items if item.get_closest_marker("slow") is not None)
    return len(items) - slow, slow

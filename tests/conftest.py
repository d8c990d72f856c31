import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long tests (kill/restart, multi-node, demo); run with -m slow")


@pytest.fixture(scope="session")
def shared_data():
    """Path of the shared reference data folder; skips the test where it is absent."""
    if not os.path.isdir(SHARED_DATA):
        pytest.skip("../shared/data is not present on this machine")
    return SHARED_DATA

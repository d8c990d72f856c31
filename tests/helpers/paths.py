"""Paths the tests use: the repository root, the test fixtures, the shared reference data."""

import os


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
# The reference artifacts other systems wrote, beside the checkout (absent outside this setup).
SHARED_DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")

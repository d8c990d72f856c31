"""The README's stated test counts against what pytest collects, so they cannot go stale.

The README says "about N tests" (the default suite) and "about M slow tests"; one
``pytest --collect-only -q`` run (the default ``-m "not slow"`` of pytest.ini) reports both:
``D/T tests collected (S deselected)``, D the default suite, S the slow tests. Each stated count
must be within 10% of the collected one (at least 3 tests for the small slow suite), close enough
to mean what it says and loose enough for a few tests added before the number is edited.
"""

import os
import re
import subprocess
import sys

from tests.helpers.paths import ROOT
from tests.helpers.suite_counts import whole_suite_counts

SUMMARY = re.compile(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?")


def stated_counts(readme: str) -> tuple:
    """``(default, slow)`` as the README states them ("about N tests", "about M slow tests")."""
    default = re.search(r"about (\d+) tests\b", readme)
    slow = re.search(r"about (\d+) slow tests\b", readme)
    assert default and slow, "README.md should state 'about N tests' and 'about M slow tests'"
    return int(default.group(1)), int(slow.group(1))


def collected_counts(output: str) -> tuple:
    """``(default, slow)`` from ``pytest --collect-only -q``'s summary line under
    ``-m "not slow"``."""
    match = SUMMARY.search(output.strip().splitlines()[-1])
    assert match, output[-2000:]
    return int(match.group(1)), int(match.group(3) or 0)


def close_enough(stated: int, collected: int) -> bool:
    return abs(stated - collected) <= max(0.10 * collected, 3)


def test_summary_parsing_and_tolerance():
    assert collected_counts("x\n\n943/962 tests collected (19 deselected) in 38.85s\n") == (943, 19)
    assert collected_counts("12 tests collected in 0.1s") == (12, 0)
    assert stated_counts("about 940 tests (...). The about 20 slow tests") == (940, 20)
    assert close_enough(940, 1000) and not close_enough(850, 1000)
    assert close_enough(20, 17) and not close_enough(20, 16)


def suite_counts(config) -> tuple:
    """``(default, slow)`` of the whole suite: from this session's own collection when it
    collected the whole suite (the README's command), else from a ``pytest --collect-only`` run."""
    counts = whole_suite_counts(config)
    if counts is not None:
        return counts
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-m", "not slow"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return collected_counts(proc.stdout)


def test_readme_test_counts_match_the_collected_suite(request):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        default_stated, slow_stated = stated_counts(f.read())
    default, slow = suite_counts(request.config)
    assert close_enough(default_stated, default), (
        f"README.md says about {default_stated} tests; pytest collects {default}: update it")
    assert close_enough(slow_stated, slow), (
        f"README.md says about {slow_stated} slow tests; pytest collects {slow}: update it")

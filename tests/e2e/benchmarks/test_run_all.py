"""benchmarks/run_all.py picks each module's own run(quick) and runs other scripts through their
adapters (a `run` a script merely imports must not be taken for its entry point)."""

import sys
import types

from benchmarks import run_all


def test_only_a_module_own_run_is_called(monkeypatch):
    own = types.ModuleType("benchmarks.fake_own")
    own.run = lambda quick=False: [{"benchmark": "fake_own", "case": "quick" if quick else "full"}]
    own.run.__module__ = own.__name__
    imported = types.ModuleType("benchmarks.fake_imported")
    imported.run = lambda args: None  # e.g. ``from tools.preprocess_data import run``
    imported.run.__module__ = "tools.preprocess_data"
    monkeypatch.setitem(sys.modules, own.__name__, own)
    monkeypatch.setitem(sys.modules, imported.__name__, imported)
    scripts = []
    monkeypatch.setattr(run_all, "run_script", lambda name, quick: scripts.append(name) or [])
    assert run_all.run_benchmark("fake_own", True) == [{"benchmark": "fake_own", "case": "quick"}]
    assert run_all.run_benchmark("fake_imported", False) == [] and scripts == ["fake_imported"]

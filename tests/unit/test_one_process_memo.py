"""The one-process references (tests/helpers/pretrain.one_process) that pytest-xdist's worker
processes share: a history one process computed is what another reads, types and all; a run that
saves or loads a checkpoint is never shared (its folder is the computing process's)."""

import pytest

from tests.helpers import dist, pretrain


@pytest.fixture
def memo(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain, "_ONE_PROCESS", {})
    monkeypatch.setattr(pretrain, "_SHARED_MEMO", None)
    pretrain.share_one_process_memo(str(tmp_path))
    calls = []

    def fake_world(world_size, fn, runs, timeout):
        calls.append([name for name, _ in runs])
        return [{name: {"lm loss": [float(len(argv))], "valid": [(10, 1.5)], "name": name}
                 for name, argv in runs}]

    monkeypatch.setattr(dist, "run_distributed", fake_world)
    return calls


def test_a_history_computed_by_one_process_is_read_by_another(memo, monkeypatch):
    argv = pretrain.e2e_argv("/a/prefix", "/a/cache", "--seed", "3")
    first = pretrain.one_process([("ref", argv)])
    assert memo == [["ref"]]
    monkeypatch.setattr(pretrain, "_ONE_PROCESS", {})  # another worker: its own memo is empty
    second = pretrain.one_process([("other name", pretrain.e2e_argv("/b/prefix", "/b/cache",
                                                                   "--seed", "3"))])
    assert memo == [["ref"]], "the second process ran the reference again"
    assert second["other name"] == first["ref"] and second["other name"]["valid"] == [(10, 1.5)]


def test_runs_that_save_or_load_are_not_shared(memo, monkeypatch):
    runs = [("save", pretrain.e2e_argv("/p", "/c", "--save", "/ck")),
            ("load", pretrain.e2e_argv("/p", "/c", "--load", "/ck")),
            ("save=", pretrain.e2e_argv("/p", "/c", "--save=/ck2")),
            ("load=", pretrain.e2e_argv("/p", "/c", "--load=/ck2")),
            ("plain", pretrain.e2e_argv("/p", "/c"))]
    pretrain.one_process(runs)
    monkeypatch.setattr(pretrain, "_ONE_PROCESS", {})
    pretrain.one_process(runs)
    assert memo == [["save", "load", "save=", "load=", "plain"], ["save", "load", "save=", "load="]]


def test_without_a_shared_folder_each_process_keeps_its_own(memo, monkeypatch):
    monkeypatch.setattr(pretrain, "_SHARED_MEMO", None)
    argv = pretrain.e2e_argv("/p", "/c")
    pretrain.one_process([("a", argv)])
    pretrain.one_process([("b", argv)])
    monkeypatch.setattr(pretrain, "_ONE_PROCESS", {})
    pretrain.one_process([("c", argv)])
    assert memo == [["a"], ["c"]]


def test_the_key_leaves_out_data_paths_but_keeps_a_blend_s_weights():
    key = pretrain.configuration
    blend = ["--seed", "3", "--data-path", "0.3", "/a/one", "0.7", "/a/two",
             "--data-cache-path", "/a/cache"]
    same_elsewhere = ["--seed", "3", "--data-path", "0.3", "/b/one", "0.7", "/b/two",
                      "--data-cache-path", "/b/cache"]
    assert key(blend) == key(same_elsewhere)
    other_weights = ["--seed", "3", "--data-path", "0.5", "/a/one", "0.5", "/a/two",
                     "--data-cache-path", "/a/cache"]
    assert key(blend) != key(other_weights)
    assert key(["--data-path=/a/p", "--save", "/x"]) == key(["--data-path=/b/p", "--save", "/x"])
    assert key(["--data-path", "/a/p", "--save", "/x"]) != key(["--data-path", "/a/p",
                                                                "--save", "/y"])

"""Reliability (issue 7), the fast part: crash-safe saves killed at several points, partial and
corrupt checkpoints named with the last complete one, RNG states, determinism, bad data and
--exit-duration-in-mins, in small CPU worlds. The launched cases (SIGKILL and resume, SIGTERM,
elastic restarts, multi-node, hangs) are in test_reliability_launch.py (slow)."""

import contextlib
import dataclasses
import io
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron import checkpointing as ckpt
from tests.helpers.dist import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.reliability import (checkpoint_config, linear_and_adamw, tiny_argv,
                                       write_dataset)


# Crash-safe saves: a process SIGKILLed at each point of a save -------------------------------------

KILL_POINTS = {  # point -> (function patched, its call number in the second save, loadable iteration)
    "mid-write of the shard": ("torch.save", 1, 1),
    "before the shard's rename": ("os.replace", 1, 1),
    "before publishing the folder": ("os.rename", 1, 1),
    "before replacing the tracker": ("os.replace", 2, 1),
    "after the tracker, before --keep-last deletion": ("fsync_dir", 1, 2),
}


def _verify(folders):
    """Load each folder, then save iteration 3 over the leftovers and load that."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    out = []
    for folder in folders:
        model, opt = linear_and_adamw(0.0)
        groups = ps.get_process_groups()
        loaded = ckpt.load_checkpoint(model, opt, None, checkpoint_config(folder), groups,
                                      run_flags={})
        weight = float(model[0].weight[0, 0].detach())
        ckpt.save_checkpoint(3, model, opt, None, checkpoint_config(folder), groups, run_flags={},
                             consumed_train_samples=24, consumed_valid_samples=0)
        again = ckpt.load_checkpoint(*linear_and_adamw(0.0), None, checkpoint_config(folder),
                                     groups, run_flags={})["iteration"]
        out.append((loaded["iteration"], weight, again, sorted(os.listdir(folder))))
    return out


def test_kill_at_any_point_of_a_save_leaves_a_loadable_checkpoint(tmp_path):
    folders, procs = [], []
    for i, (function, call, _) in enumerate(KILL_POINTS.values()):
        folder = str(tmp_path / f"point{i}")
        folders.append(folder)
        code = ("import sys; sys.path.insert(0, '.'); from tests.helpers.reliability import crash_child; "
                f"crash_child({folder!r}, {function!r}, {call})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                                      stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == -9, err  # died by SIGKILL inside the save
    results = run_distributed(1, _verify, folders)[0]
    for (point, (_, _, expected)), (iteration, weight, again, listing) in zip(KILL_POINTS.items(),
                                                                              results):
        assert (iteration, weight) == (expected, float(expected)), point
        assert again == 3, point  # the leftovers of the killed save do not block the next one
        assert listing == ["iter_0000003", ckpt.TRACKER_FILENAME], (point, listing)


# Partial / corrupt checkpoints: name the file, what is wrong, and the last complete checkpoint ---

def _broken_load(folder, how):
    from tests.helpers.checkpoint import checkpoint_parts

    from megatron.core import parallel_state as ps

    model, opt, sched = checkpoint_parts(0)
    config = dataclasses.replace(checkpoint_config(folder), keep_last_checkpoints=None)
    groups = ps.get_process_groups()
    for it in (2, 4):
        ckpt.save_checkpoint(it, model, opt, sched, config, groups, run_flags={},
                             consumed_train_samples=8 * it, consumed_valid_samples=0)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 1:  # only the second pipeline stage's shard is damaged
        path = ckpt.checkpoint_name_of(folder, 4, groups)
        if how == "truncated":
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        else:
            os.remove(path)
    torch.distributed.barrier()
    try:
        ckpt.load_checkpoint(model, opt, sched, config, groups, run_flags={})
    except ckpt.CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("how", ["truncated", "missing"])
def test_partial_or_corrupt_checkpoint_names_file_and_last_complete(tmp_path, how):
    errors = run_distributed(2, _broken_load, str(tmp_path), how)
    hint = (f"The last complete checkpoint is {tmp_path / 'iter_0000002'}: to resume from it, "
            f"write 2 into {tmp_path / ckpt.TRACKER_FILENAME}")
    shard = str(tmp_path / "iter_0000004" / "mp_rank_00_001" / "model_optim_rng.pt")
    problem = "cannot read checkpoint shard" if how == "truncated" else "does not exist"
    assert shard in errors[1] and problem in errors[1] and hint in errors[1], errors[1]
    # The healthy rank stops too, instead of waiting for the broken one in the next collective,
    # silently: rank 1 says it for the job (a usage error, status 2 on every rank).
    assert errors[0] == "rank 1 found a usage error (see its line)", errors[0]


# RNG states ------------------------------------------------------------------------------------

def _rng_round_trip():
    import random

    from megatron.checkpointing import rng_state
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_rng_tracker, model_parallel_manual_seed

    ps.initialize_model_parallel(1, 1)
    model_parallel_manual_seed(3, 0)
    state = rng_state.get_rng_state()
    saved = torch.load(io.BytesIO(_saved(state)), weights_only=True)

    def draw():
        with get_rng_tracker().fork():
            tracker = torch.rand(2).tolist()
        return random.random(), np.random.rand(), torch.rand(1).item(), tracker

    first = draw()
    rng_state.set_rng_state(saved)
    return first, draw()


def _saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_python_numpy_torch_and_tracker_rng_states_round_trip():
    first, again = run_distributed(1, _rng_round_trip)[0]
    assert first == again


# Training runs in one world: determinism, bad data, empty --load, --exit-duration-in-mins -------

def _fill_disk_after_first_save():
    """From the second checkpoint file on, rank 0's writes fail as on a full disk."""
    import errno

    from megatron.checkpointing import legacy

    real, calls = legacy.write_atomic, [0]

    def writer(obj, path):
        calls[0] += 1
        if calls[0] > 1 and torch.distributed.get_rank() == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, path)

    legacy.write_atomic = writer


def _runs(cases):
    import pretrain_llama

    out = {}
    for name, argv in cases:
        if name == "full disk":
            _fill_disk_after_first_save()
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                history = pretrain_llama.main(argv)
            out[name] = {"lm loss": history["lm loss"], "iteration": history["iteration"],
                         "valid": history["valid"], "log": log.getvalue()}
        except Exception as exc:  # noqa: BLE001 - the error is what some cases test
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "log": log.getvalue()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    good = write_dataset(str(root / "good_text_document"))
    bad = write_dataset(str(root / "bad_text_document"), max_id=200)
    tiny = write_dataset(str(root / "tiny_text_document"), num_docs=1)
    other = write_dataset(str(root / "other_text_document"), seed=1)
    empty = write_dataset(str(root / "empty_text_document"), num_docs=0)
    damaged = write_dataset(str(root / "damaged_text_document"), seed=2)
    with open(damaged + ".idx", "r+b") as f:  # uint16 data behind an int32 header
        f.seek(17)
        f.write(bytes([4]))
    cache = str(root / "cache")
    per_split = [a for a in tiny_argv(good, cache, 2) if a not in ("--data-path", good)]
    folders = {k: str(root / k) for k in ("empty", "finetune", "bad_save", "timed")}
    os.makedirs(folders["empty"])
    os.makedirs(folders["finetune"])
    cases = [
        ("seed 7", tiny_argv(good, cache)),
        ("seed 7 again", tiny_argv(good, cache)),
        ("seed 8", tiny_argv(good, cache, 4, "--seed", "8")),
        ("bad ids", tiny_argv(bad, cache, 4, "--save", folders["bad_save"])),
        ("empty load", tiny_argv(good, cache, 2, "--load", folders["empty"], "--save",
                                 folders["empty"])),
        ("empty load finetune", tiny_argv(good, cache, 2, "--load", folders["finetune"],
                                          "--finetune")),
        ("tiny data", tiny_argv(tiny, cache, 2)),
        ("unweighted blend", tiny_argv(good, cache, 2, "--data-path", good, other)),
        ("empty data", tiny_argv(empty, cache, 2)),
        ("no validation share", tiny_argv(good, cache, 2, "--split", "100,0,0")),
        ("damaged validation data", per_split + ["--train-data-path", good, "--valid-data-path", damaged]),
        # 0.0005 minutes = 30 ms: over after the first iteration; saves and stops there.
        ("timed", tiny_argv(good, cache, 50, "--exit-duration-in-mins", "0.0005", "--save",
                            folders["timed"])),
    ]
    return run_distributed(1, _runs, cases, timeout=600)[0], folders, bad


def test_same_seed_same_losses_and_seed_changes_them(runs):
    out = runs[0]
    assert out["seed 7"]["lm loss"] == out["seed 7 again"]["lm loss"]  # bitwise
    assert out["seed 7"]["valid"] == out["seed 7 again"]["valid"]
    assert all(a != b for a, b in zip(out["seed 7"]["lm loss"], out["seed 8"]["lm loss"]))


def test_token_id_outside_vocabulary_is_refused_at_start(runs):
    out, folders, bad = runs
    error = out["bad ids"]["error"]
    high = int(np.fromfile(bad + ".bin", dtype=np.uint16).max())  # the oracle: the file's max
    assert high >= 128
    assert error == (f"UsageError: --data-path ({bad}): token id {high} in {bad}.bin is outside "
                     "the vocabulary [0, 128) of --tokenizer-type NullTokenizer --vocab-size 127: "
                     "the data was tokenized with another tokenizer; pass that tokenizer's flags, "
                     "or re-run tools/preprocess_data.py with this one"), error
    assert "building" not in out["bad ids"]["log"]  # before the model
    assert not os.path.exists(folders["bad_save"])  # nothing written


def test_empty_load_folder_fresh_start_in_log_but_finetune_is_an_error(runs):
    out, folders, _ = runs
    assert out["empty load"].get("iteration") == [1, 2], out["empty load"].get("error")
    assert f"no checkpoint found at --load {folders['empty']}" in out["empty load"]["log"]
    assert "starting from scratch" in out["empty load"]["log"]
    assert "CheckpointUsageError: --finetune needs a checkpoint" in out["empty load finetune"]["error"]
    assert os.listdir(folders["finetune"]) == []


def test_exit_duration_in_fractional_minutes_saves_and_stops(runs):
    out, folders, _ = runs
    timed = out["timed"]
    assert "error" not in timed, timed.get("error")
    last = timed["iteration"][-1]
    assert 1 <= last < 50
    assert f"exiting program at iteration {last} after 0.0005 minutes" in timed["log"]
    tracker = os.path.join(folders["timed"], ckpt.TRACKER_FILENAME)
    assert open(tracker).read() == str(last)


def _refused_before_anything_is_built(run):
    assert "error" in run, run
    assert "building" not in run["log"] and "training from iteration" not in run["log"], run["log"]
    return run["error"]


def test_dataset_smaller_than_one_sample_is_refused(runs):
    error = _refused_before_anything_is_built(runs[0]["tiny data"])
    assert re.search(r"the train split of .*tiny_text_document holds \d+ tokens \(sequences \[0, 1\) of 1\), "
                     r"fewer than one sample of --seq-length 16.*--split", error), error


def test_unweighted_data_path_list_trains_as_megatron_reads_it(runs):
    """--data-path A B (no weights) passed validation and then failed after the model was built."""
    run = runs[0]["unweighted blend"]
    assert "error" not in run, run
    assert run["iteration"] == [1, 2] and all(math.isfinite(x) for x in run["lm loss"])
    assert run["valid"] and all(it == 2 and math.isfinite(loss) for it, loss in run["valid"])


@pytest.mark.parametrize("case, message", [
    ("empty data", r"^UsageError: --data-path \(.*empty_text_document\) with --split 90,10,0, training data: "
                   r"dataset .*empty_text_document holds no tokens \(0 sequences\)"),
    ("no validation share", r"^UsageError: --split \(100,0,0\): the validation share is 0, but --eval-iters "
                            r"\(1\) and --eval-interval \(2\) ask for evaluation"),
    ("damaged validation data", r"^UsageError: --valid-data-path \(.*damaged_text_document\), validation data: "
                                r".*damaged_text_document\.idx: sequence 1 starts at byte"),
])
def test_bad_data_is_refused_before_anything_is_built(runs, case, message):
    error = _refused_before_anything_is_built(runs[0][case])
    assert re.search(message, error), error


@pytest.mark.parametrize("kind, flag", [("SentencePieceTokenizer", "tokenizer_model"),
                                        ("HuggingFaceTokenizer", "tokenizer_name_or_path")])
def test_tokenizer_file_of_the_wrong_kind_is_named(tmp_path, kind, flag):
    from types import SimpleNamespace

    from megatron.tokenizer import build_tokenizer

    junk = tmp_path / "tokenizer.model"
    junk.write_text('{"model": "not a SentencePiece model"}')
    path = str(junk if flag == "tokenizer_model" else tmp_path)
    args = SimpleNamespace(tokenizer_type=kind, tokenizer_model=None, tokenizer_name_or_path=None,
                           vocab_file=None, merge_file=None, vocab_size=None)
    setattr(args, flag, path)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        build_tokenizer(args)
    assert f"--{flag.replace('_', '-')} {path}" in str(err.value)


# Distributed optimizer shards and --no-save-optim / --no-save-rng, in a world of two -------------

@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp2")
    data = write_dataset(str(root / "text_document"))
    cache, ckpt_dir, bare = str(root / "cache"), str(root / "ckpt"), str(root / "bare")
    dist_opt = ["--use-distributed-optimizer"]
    cases = [
        ("whole", tiny_argv(data, cache, 6, *dist_opt)),
        ("first", tiny_argv(data, cache, 6, *dist_opt, "--save", ckpt_dir, "--save-interval", "3",
                            "--exit-interval", "3")),
        ("second", tiny_argv(data, cache, 6, *dist_opt, "--load", ckpt_dir)),
        ("bare save", tiny_argv(data, cache, 2, "--save", bare, "--no-save-optim",
                                "--no-save-rng")),
        ("bare load", tiny_argv(data, cache, 3, "--load", bare)),
        ("bare load ok", tiny_argv(data, cache, 3, "--load", bare, "--no-load-optim",
                                   "--no-load-rng")),
        ("full disk", tiny_argv(data, cache, 4, "--save", str(root / "full"),
                                "--save-interval", "1")),  # last: its writer stays broken
    ]
    return run_distributed(2, _runs, cases, timeout=600), ckpt_dir, bare, str(root / "full")


def test_distributed_optimizer_shards_resume_exactly(dp2_runs):
    out = dp2_runs[0][1]
    assert out["first"]["iteration"] == [1, 2, 3] and out["second"]["iteration"] == [4, 5, 6]
    assert out["first"]["lm loss"] + out["second"]["lm loss"] == out["whole"]["lm loss"]  # bitwise
    assert out["second"]["valid"] == [v for v in out["whole"]["valid"] if v[0] > 3]
    folder = os.path.join(dp2_runs[1], "iter_0000003", "mp_rank_00")
    assert sorted(os.listdir(folder)) == ["distrib_optim_dp_000.pt", "distrib_optim_dp_001.pt",
                                          "model_optim_rng.pt"]


def test_no_save_optim_and_rng_are_honoured_and_named_on_load(dp2_runs):
    out = dp2_runs[0][0]  # rank 0 says it for the job (both ranks find it)
    path = os.path.join(dp2_runs[2], "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=True)
    assert state["optimizer"] is None and "rng_state" not in state
    assert "holds no optimizer state (saved with --no-save-optim); pass --no-load-optim" in \
        out["bare load"]["error"]
    assert out["bare load ok"]["iteration"] == [3]


def test_full_disk_during_save_stops_with_clear_error_and_keeps_previous(dp2_runs):
    results, _, _, full = dp2_runs
    assert re.search(r"CheckpointSaveError: rank 0 could not write .*iter_0000002\.tmp.*No space left "
                     r"on device; the previous checkpoint and latest_checkpointed_iteration.txt "
                     r"are intact", results[0]["full disk"]["error"]), results[0]["full disk"]
    assert "failed on another rank; the previous checkpoint" in results[1]["full disk"]["error"]
    assert open(os.path.join(full, ckpt.TRACKER_FILENAME)).read() == "1"
    assert sorted(os.listdir(full)) == ["iter_0000001", ckpt.TRACKER_FILENAME]
    assert ckpt.looks_complete(os.path.join(full, "iter_0000001"))


@pytest.mark.parametrize("extra, message", [
    (["--exit-signal-handler"], r"--exit-signal-handler needs --save DIR"),
    (["--keep-last-checkpoints", "2"], r"--keep-last-checkpoints \(2\) needs --save DIR"),
    (["--keep-last-checkpoints", "0", "--save", "x"], r"--keep-last-checkpoints \(0\) must be positive"),
    (["--exit-duration-in-mins", "-1"], r"--exit-duration-in-mins \(-1.0\) must be positive"),
    (["--distributed-timeout-minutes", "0"], r"--distributed-timeout-minutes \(0.0\) must be positive"),
])
def test_reliability_flags_are_validated(extra, message):
    from megatron import arguments

    args = arguments.parse_args(tiny_argv("prefix", "cache", 4, *extra))
    with pytest.raises(ValueError, match=message):
        arguments.validate_args(args, 1, check_files=False)
    # and fractional minutes are accepted
    ok = arguments.parse_args(tiny_argv("prefix", "cache", 4, "--exit-duration-in-mins", "0.05",
                                        "--distributed-timeout-minutes", "0.1"))
    arguments.validate_args(ok, 1, check_files=False)


def _sigterm_during_startup(argv):
    """pretrain_llama.main with SIGTERM arriving while the model is built (start-up)."""
    import signal

    import pretrain_llama
    from megatron.training import builders

    build = builders.setup_model_and_optimizer

    def build_then_signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return build(*args, **kwargs)

    builders.setup_model_and_optimizer = build_then_signalled  # put back after the task
    history = pretrain_llama.main(argv)
    return history["iteration"], signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_during_startup_saves_after_the_first_iteration(tmp_path):
    """The fourth hostile pass: SIGTERM to torchrun's agent while the ranks started up killed
    them (status -15; the handler was installed only when the training loop began). As in
    Megatron-LM the handler is installed at the start: the run trains one iteration, saves it
    and returns; the process's own SIGTERM handler is put back."""
    prefix = write_dataset(str(tmp_path / "data"))
    save = tmp_path / "save"
    argv = tiny_argv(prefix, str(tmp_path / "cache"), 4, "--exit-signal-handler", "--save",
                     str(save), "--save-interval", "100")
    iterations, default_again = run_distributed(1, _sigterm_during_startup, argv)[0]
    assert iterations == [1] and default_again
    assert (save / ckpt.TRACKER_FILENAME).read_text() == "1"
    assert ckpt.looks_complete(str(save / "iter_0000001"))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_checkpoint_copied_over_another_iterations_name_is_refused(tmp_path, fmt):
    """The fourth hostile pass: iter_0000001 copied over iter_0000002 (tracker 2) loaded and
    trained from iteration 1, replaying its data, without a word."""
    import shutil

    prefix = write_dataset(str(tmp_path / "data"))
    save = tmp_path / "save"
    first = tiny_argv(prefix, str(tmp_path / "cache"), 4, "--save", str(save), "--save-interval",
                      "1", "--ckpt-format", fmt, "--exit-interval", "2")
    resumed = tiny_argv(prefix, str(tmp_path / "cache"), 4, "--load", str(save), "--ckpt-format", fmt)
    out = run_distributed(1, _runs, [("first", first)])[0]
    assert out["first"]["iteration"] == [1, 2], out["first"].get("error")
    shutil.rmtree(save / "iter_0000002")
    shutil.copytree(save / "iter_0000001", save / "iter_0000002")
    error = run_distributed(1, _runs, [("resumed", resumed)])[0]["resumed"].get("error", "")
    assert f"{save / 'iter_0000002'} holds the checkpoint of iteration 1 (its files say so), " \
           "not of iteration 2" in error, error

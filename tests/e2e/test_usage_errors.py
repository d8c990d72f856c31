"""Usage errors of pretrain_llama.py (issue 13): one line ``pretrain_llama.py: error: ...`` and
status 2, before anything heavy where the flags alone tell: an unusable or busy ``--save``, a
tracker file of garbage, ``--train-iters`` below the loaded iteration, a resume in another
precision, a resume whose schedule differs from the checkpoint's. The same under ``torchrun`` with 4 ranks (one line for the whole job) is the slow part,
at the end."""

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from megatron.checkpointing import save_folder
from tests.helpers.dist import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.reliability import tiny_argv, write_dataset


def _commands(cases):
    import pretrain_llama

    out = {}
    for name, argv in cases:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = pretrain_llama.command(argv)
        out[name] = {"status": status, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
    return out


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    root = tmp_path_factory.mktemp("usage")
    data, cache = write_dataset(str(root / "text_document")), str(root / "cache")
    a_file = root / "a_file"
    a_file.write_text("")
    held = root / "held"
    held.mkdir()
    me = save_folder.LockHolder.this_process()  # this test process: alive on this host
    (held / save_folder.LOCK_FILENAME).write_text(json.dumps(dict(me.__dict__, job="slurm:99")))
    garbage = root / "garbage"
    garbage.mkdir()
    (garbage / "latest_checkpointed_iteration.txt").write_text("hello\n")
    ahead = root / "ahead"
    (ahead / "iter_0000008").mkdir(parents=True)
    (ahead / "latest_checkpointed_iteration.txt").write_text("8")
    fp32, fp32_dist = str(root / "fp32"), str(root / "fp32_dist")
    cases = [
        ("seed", tiny_argv(data, cache, 2, "--seed=-1")),
        ("save is a file", tiny_argv(data, cache, 2, "--save", str(a_file))),
        ("save held", tiny_argv(data, cache, 2, "--save", str(held))),
        ("garbage tracker", tiny_argv(data, cache, 2, "--load", str(garbage))),
        ("train-iters below", tiny_argv(data, cache, 4, "--load", str(ahead))),
        ("fp32 save", tiny_argv(data, cache, 2, "--save", fp32)),
        ("bf16 resume", tiny_argv(data, cache, 4, "--load", fp32, "--bf16")),
        ("fp32 dist save", tiny_argv(data, cache, 2, "--save", fp32_dist, "--ckpt-format",
                                     "torch_dist")),
        ("bf16 dist resume", tiny_argv(data, cache, 4, "--load", fp32_dist, "--bf16")),
        # --lr-decay-iters follows --train-iters: 4 iterations of 8 samples against the saved 2
        ("longer resume", tiny_argv(data, cache, 4, "--load", fp32)),
        ("longer dist resume", tiny_argv(data, cache, 4, "--load", fp32_dist)),
        # issue 31: a mistyped --load trained from scratch with status 0
        ("load missing", tiny_argv(data, cache, 2, "--load", str(root / "fp32_typo"))),
        ("load is a file", tiny_argv(data, cache, 2, "--load", str(a_file))),
        ("load is save, empty", tiny_argv(data, cache, 2, "--load", str(root / "first"),
                                          "--save", str(root / "first"))),
    ]
    return run_distributed(1, _commands, cases, timeout=600)[0], root, me


def _one_line(run):
    assert run["status"] == 2, run
    lines = run["stderr"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_llama.py: error: "), run["stderr"]
    return lines[0][len("pretrain_llama.py: error: "):]


def _before_the_model(run):
    assert "building" not in run["stdout"] and "training from iteration" not in run["stdout"]


@pytest.mark.parametrize("case, message", [
    ("seed", r"^--seed \(-1\) must be in \[0, 4294967295\]: a seed \(NumPy's range\); e\.g\. "
             r"1234 \(the default\)$"),
    ("save is a file", r"^--save \(.*a_file\) is a file, not a folder"),
    ("garbage tracker", r"^--load \(.*garbage\): .*latest_checkpointed_iteration\.txt must hold an "
                        r"iteration number or 'release', found 'hello'; write the iteration of a "
                        r"complete checkpoint there"),
    ("load missing", r"^--load \(.*fp32_typo\) does not exist: check the path .*drop --load to "
                     r"start from scratch"),
    ("load is a file", r"^--load \(.*a_file\) is a file, not a checkpoint folder"),
    ("train-iters below", r"^--train-iters \(4\) ends before the checkpoint at --load .*ahead "
                          r"\(iteration 8\): raise it above 8 to train on, or pass --finetune"),
])
def test_refused_in_one_line_before_the_model_is_built(refused, case, message):
    run = refused[0][case]
    assert re.search(message, _one_line(run)), run["stderr"]
    _before_the_model(run)


def test_load_that_is_the_empty_save_folder_starts_from_scratch(refused):
    out, root, _ = refused
    run = out["load is save, empty"]
    assert run["status"] == 0, run["stderr"]
    assert "starting from scratch" in run["stdout"]
    assert (root / "first" / "iter_0000002").is_dir()


def test_a_save_folder_another_job_holds_is_refused_naming_it(refused):
    out, root, me = refused
    line = _one_line(out["save held"])
    assert line.startswith(f"--save ({root / 'held'}) is in use by another job (host "
                           f"{socket.gethostname()}, pid {me.pid}, job slurm:99, started "
                           f"{me.started}; lock file {root / 'held' / 'megatron_save.lock'})"), line
    _before_the_model(out["save held"])
    assert os.listdir(root / "held") == ["megatron_save.lock"]  # nothing written, nothing removed


@pytest.mark.parametrize("fmt", ["", "dist"], ids=["torch", "torch_dist"])
def test_a_resume_in_another_precision_names_both_and_the_fixes(refused, fmt):
    out, root, _ = refused
    name = "fp32_dist" if fmt else "fp32"
    saved = out[f"fp32 {fmt} save".replace("  ", " ")]
    assert saved["status"] == 0, saved["stderr"]
    assert sorted(os.listdir(root / name)) == ["iter_0000002",
                                               "latest_checkpointed_iteration.txt"]
    line = _one_line(out[f"bf16 {fmt} resume".replace("  ", " ")])
    assert line == (f"--bf16: the checkpoint at --load {root / name} (iteration 2) was saved in "
                    "fp32 with its optimizer state, which this bf16 run cannot resume (the "
                    "optimizer's main parameters, moments and loss scaling differ); pass "
                    "--finetune (weights only; iteration, optimizer and schedule start afresh) or "
                    "--no-load-optim (weights, iteration and schedule; a new optimizer state), or "
                    "resume in fp32 (no --bf16 / --fp16)")


@pytest.mark.parametrize("fmt", ["", "dist"], ids=["torch", "torch_dist"])
def test_a_resume_with_another_schedule_names_the_values_and_the_policy_flags(refused, fmt):
    out, root, _ = refused
    name = "fp32_dist" if fmt else "fp32"
    line = _one_line(out[f"longer {fmt} resume".replace("  ", " ")])
    assert line == (f"--load ({root / name}): OptimizerParamScheduler: total number of decay "
                    "steps is 32 but the checkpoint has 16; pass --override-opt_param-scheduler "
                    "to keep the new value or --use-checkpoint-opt_param-scheduler to take the "
                    "checkpoint's")


# torchrun with 4 ranks (slow) ------------------------------------------------------------------

def _torchrun(argv, nproc=4):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), os.path.join(ROOT, "pretrain_llama.py"),
                           *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", ["found by every rank", "found by rank 0 after the groups"])
def test_under_torchrun_4_ranks_say_it_once_and_all_exit_2(tmp_path, case):
    data = write_dataset(str(tmp_path / "text_document"))
    extra = (["--adam-beta1", "1.5"] if case == "found by every rank" else
             ["--save", str(tmp_path / "a_file")])
    (tmp_path / "a_file").write_text("")
    status, log = _torchrun(tiny_argv(data, str(tmp_path / "cache"), 2, *extra))
    errors = [line for line in log.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("pretrain_llama.py: error: --"), log[-4000:]
    assert status != 0 and len(re.findall(r"exitcode\s*:\s*2", log)) >= 1, log[-4000:]
    assert "megatron/" not in log and "pretrain_llama.py\", line" not in log, log[-4000:]

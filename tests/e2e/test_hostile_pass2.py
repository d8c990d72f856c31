"""A second hostile pass over the faults of issue 31, by someone who did not write the fixes:
inputs the fixes' authors did not try. The cases that held are regression tests; the cases
that failed are ``xfail(strict=True)`` (drop the marker with the fix). Each case names what a
user does and what the project promises for it (docs/reliability.md): one line naming the file
or flag and the fix, exit 2 (1 for a runtime fault), no traceback, nothing lost, no hang.

The signal and kill cases of the pass (preemption with loader workers at PP=2 / DP=2, during
evaluation, during a save, twice; preprocessing workers killed or stopped) are in the ``slow``
tier at the end of this file."""

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron.checkpointing import checkpoint_folder, save_folder
from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
from megatron.usage_error import UsageError
from tests.helpers.dist import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.reliability import tiny_argv, write_dataset

TRACKER = checkpoint_folder.TRACKER_FILENAME


def _within(seconds, fn, *args):
    """``fn(*args)`` in a daemon thread: ``("returned", value)``, ``("raised", exception)``, or
    ``("hung", None)`` when it has not ended after ``seconds`` (a pipe opened for reading)."""
    box = {}

    def run():
        try:
            box["r"] = ("returned", fn(*args))
        except BaseException as exc:  # noqa: BLE001 - the test inspects what came out
            box["r"] = ("raised", exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return box.get("r", ("hung", None))


def _lock_kinds():
    """What a hostile or broken ``megatron_save.lock`` can be (``make(path)``)."""
    def sparse(path, size=10 ** 10):  # 10 GB, no disk used
        with open(path, "wb") as f:
            f.truncate(size)

    return {
        "named pipe": os.mkfifo,
        "folder": os.mkdir,
        "dangling symlink": lambda p: os.symlink(p + ".nowhere", p),
        "symlink to /dev/zero": lambda p: os.symlink("/dev/zero", p),
        "10 GB sparse file": sparse,
        "not UTF-8": lambda p: open(p, "wb").write(b"\xff\xfe{"),
        "pid 1e400": lambda p: open(p, "w").write(
            '{"host": "h", "pid": 1e400, "job": "", "started": "x", "token": "t"}'),
    }


@pytest.mark.parametrize("kind", list(_lock_kinds()))
def test_a_hostile_lock_file_is_refused_in_one_line_without_blocking(tmp_path, kind):
    _lock_kinds()[kind](str(tmp_path / save_folder.LOCK_FILENAME))
    how, value = _within(60, save_folder.SaveFolderLock(str(tmp_path)).acquire)
    assert how == "raised" and isinstance(value, UsageError), (how, value)
    assert save_folder.LOCK_FILENAME in str(value) and "\n" not in str(value)


def test_a_deeply_nested_lock_file_is_refused_in_one_line(tmp_path):
    with open(tmp_path / save_folder.LOCK_FILENAME, "w") as f:
        f.write("[" * 60000)
    how, value = _within(60, save_folder.SaveFolderLock(str(tmp_path)).acquire)
    assert how == "raised" and isinstance(value, UsageError), (how, value)


@pytest.mark.parametrize("kind", ["named pipe", "folder", "dangling symlink",
                                  "symlink to /dev/zero", "10 GB sparse file", "not UTF-8"])
def test_a_hostile_tracker_is_refused_naming_it_without_blocking(tmp_path, kind):
    _lock_kinds()[kind](str(tmp_path / TRACKER))
    how, value = _within(60, checkpoint_folder.find_checkpoint, str(tmp_path))
    assert how == "raised" and isinstance(value, CheckpointError), (how, value)
    assert TRACKER in str(value) and "\n" not in str(value)


def test_a_tracker_of_fullwidth_digits_is_refused(tmp_path):
    (tmp_path / TRACKER).write_text("\uff11\uff12")  # "12" in full-width digits: isdigit() is True
    with pytest.raises(CheckpointError, match="iteration number"):
        checkpoint_folder.find_checkpoint(str(tmp_path))


# --- the --save folder's own files, seen by a run that does not --load it -------------------

@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile2")
    return write_dataset(str(root / "text_document")), str(root / "cache")


def _pretrain(argv, cwd, timeout):
    """``pretrain_llama.py argv`` as a user runs it: ``(status, stderr)``; ``(None, log)`` when
    it has not ended after ``timeout`` seconds (then killed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_llama.py"), *argv],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, err


def _command_in(cwd, argv):
    import pretrain_llama
    from tests.helpers.cli import run_main

    here = os.getcwd()
    os.chdir(cwd)
    try:
        out = run_main(pretrain_llama.command, argv)
    finally:
        os.chdir(here)
    return out.returncode, out.stderr


def _pretrain_here(argv, cwd):
    """:func:`_pretrain` in a warm one-process world: ``pretrain_llama.command(argv)`` run from
    ``cwd``, ``(status, stderr)``; for the cases that cannot hang (a fresh interpreter costs 2 to
    4 s of imports; the subprocess cases keep the exit status and the one line as a shell sees
    them)."""
    return run_distributed(1, _command_in, str(cwd), [str(a) for a in argv], timeout=900)[0]


@pytest.mark.timeout(1800)
def test_a_tracker_that_is_a_folder_in_save_is_refused_before_training(tiny_data, tmp_path):
    prefix, cache = tiny_data
    save = tmp_path / "save"
    (save / TRACKER).mkdir(parents=True)
    status, err = _pretrain_here(tiny_argv(prefix, cache, 2, "--save", str(save),
                                           "--save-interval", "2"), tmp_path)
    assert status == 2 and TRACKER in err and "Traceback" not in err, err[-3000:]
    assert not glob.glob(str(save / "iter_*")), "trained and saved although the folder is unusable"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_tracker_temporary_that_is_a_pipe_does_not_hang_the_save(tiny_data, tmp_path):
    prefix, cache = tiny_data
    save = tmp_path / "save"
    save.mkdir()
    os.mkfifo(save / (TRACKER + ".tmp"))
    status, err = _pretrain(tiny_argv(prefix, cache, 2, "--save", str(save), "--save-interval",
                                      "2"), tmp_path, 600)
    assert status in (1, 2) and "Traceback" not in err, (status, err[-3000:])
    assert TRACKER in err


@pytest.mark.timeout(1800)
def test_a_mistyped_load_is_refused_in_one_line(tiny_data, tmp_path):
    """A --load that is a symbolic link to a file, beside another --save: one line, exit 2."""
    prefix, cache = tiny_data
    (tmp_path / "f").write_text("3")
    os.symlink("f", tmp_path / "lnk")
    status, err = _pretrain(tiny_argv(prefix, cache, 2, "--load", "lnk", "--save", "save"),
                            tmp_path, 900)
    assert status == 2 and len(err.strip().splitlines()) == 1 and "--load (lnk)" in err, err


# --- ZeRO-3: reading a parameter between iterations ------------------------------------------

def _zero3_reads():
    import copy
    import io

    from megatron.core import parallel_state as ps
    from megatron.core.distributed.param_units import ShardedParameterAccessError
    from tests.helpers.toy import distrib_iteration
    from tests.unit.core.distributed.test_zero import _build

    ps.initialize_model_parallel(1, 1)
    net, ddp, opt = _build("optim_grads_params", overlap_grad=True)
    for step in range(2):
        distrib_iteration(ddp, opt, step, 2)
    reads = {
        "torch.save(parameter)": lambda p: torch.save(p, io.BytesIO()),
        "torch.save(state_dict())": lambda p: torch.save(net.state_dict(), io.BytesIO()),
        "copy.deepcopy(model)": lambda p: copy.deepcopy(net),
        "numpy()": lambda p: p.detach().numpy(),
        "float()": lambda p: p.float(),
        "norm()": lambda p: p.norm(),
        ".real.sum()": lambda p: p.real.sum(),
        ".T.sum()": lambda p: p.T.sum(),
        ".mT.sum()": lambda p: p.mT.sum(),
    }
    out = {}
    for name, read in reads.items():
        try:
            read(net.fc.weight)
            out[name] = "no error"
        except ShardedParameterAccessError as exc:
            out[name] = "named" if "finish_param_sync()" in str(exc) else str(exc)
        except Exception as exc:  # noqa: BLE001 - a raw library error is the finding
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def zero3_reads():
    return run_distributed(2, _zero3_reads)


@pytest.mark.parametrize("read", ["torch.save(parameter)", "torch.save(state_dict())",
                                  "copy.deepcopy(model)", "numpy()", "float()", "norm()",
                                  ".real.sum()", ".T.sum()", ".mT.sum()"])
def test_zero3_reads_between_iterations_raise_the_named_error(zero3_reads, read):
    assert all(out[read] == "named" for out in zero3_reads), [out[read] for out in zero3_reads]


# --- the converter's export copies a file named inside the checkpoint ------------------------

def test_export_does_not_copy_a_private_file_named_by_the_checkpoint(tmp_path):
    from tests.helpers.convert import convert, make_hf

    secret = tmp_path / "private" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY MATERIAL\n")
    make_hf(str(tmp_path / "hf"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "hf",
            "--save-dir", tmp_path / "meg")
    for path in glob.glob(str(tmp_path / "meg" / "**" / "model_optim_rng.pt"), recursive=True):
        state = torch.load(path, weights_only=True)
        state["args"]["tokenizer_model"] = str(secret)  # what a crafted checkpoint records
        torch.save(state, path)
    try:
        convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "meg",
                "--save-dir", tmp_path / "export")
    except (SystemExit, ValueError):
        pass  # refusing is fine
    copied = [p for p in glob.glob(str(tmp_path / "export" / "*"))
              if open(p, "rb").read() == secret.read_bytes()]
    assert not copied, f"{copied} is a copy of {secret}"


# --- HuggingFace folders holding pipes or hostile JSON ------------------------------------------

def test_a_config_file_that_is_a_pipe_is_refused_without_blocking(tmp_path):
    from megatron.hf_folder import refuse_custom_code

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    os.mkfifo(tmp_path / "generation_config.json")
    how, value = _within(60, refuse_custom_code, str(tmp_path), "--load-dir")
    assert how == "raised" and isinstance(value, ValueError), (how, value)
    assert "generation_config.json" in str(value)


def test_a_deeply_nested_config_is_refused_in_one_line(tmp_path):
    from megatron.hf_folder import refuse_custom_code

    (tmp_path / "config.json").write_text("[" * 100000)
    how, value = _within(60, refuse_custom_code, str(tmp_path), "--load-dir")
    assert how == "raised" and isinstance(value, ValueError), (how, value)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_shard_that_is_a_pipe_is_refused_without_blocking(tmp_path):
    from tests.helpers.convert import make_hf

    hf = tmp_path / "hf"
    make_hf(str(hf))
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    os.remove(hf / "model.safetensors")
    shard = "model-00001-of-00001.safetensors"
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: shard for n in names}}))
    os.mkfifo(hf / shard)
    try:
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
                              "--model-type", "GPT", "--loader", "hf", "--saver", "megatron",
                              "--load-dir", str(hf), "--save-dir", str(tmp_path / "out")],
                             capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("convert.py hung on a shard that is a named pipe")
    assert out.returncode == 2 and shard in out.stderr and "Traceback" not in out.stderr, out.stderr


# --- tools/serve.py: undecodable text inside valid JSON --------------------------------------

@pytest.mark.parametrize("route, body", [
    ("/v1/completions", b'{"prompt": "abc \\ud800 def", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udc80y"}], '
                             b'"max_tokens": 2}'),
])
def test_a_lone_surrogate_in_a_request_is_a_400_naming_the_field(server, route, body):
    got, answer = server.raw("POST", route, body, {"Content-Type": "application/json"})
    assert got == 400 and ("prompt" in answer["error"]["message"]
                           or "messages" in answer["error"]["message"]), (got, answer)


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared_data):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from tests.e2e.tools.test_serve import Server
    from tests.helpers.convert import convert, make_hf

    root = tmp_path_factory.mktemp("serve2")
    make_hf(str(root / "hf"), vocab=32000)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "tp1")
    s = Server(root / "tp1", os.path.join(shared_data, "sentencepiece-llama-32k.model"))
    yield s
    s.stop()


# --- hostile bytes in the preprocessing corpora ------------------------------------------------

def _preprocess(tool, tmp_path, shared_data, text, *flags):
    model = os.path.join(shared_data, SP_MODEL_NAME)
    if not os.path.isfile(model):
        pytest.skip("the 32k SentencePiece model is not beside the repository")
    src = tmp_path / "in.jsonl"
    src.write_bytes(text)
    (tmp_path / "out").mkdir()
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), "--input", str(src),
                           "--output-prefix", str(tmp_path / "out" / "o"), *flags,
                           "--tokenizer-model", model], capture_output=True, text=True,
                          timeout=600)


SFT_FLAGS = ("--tokenizer-type", "Llama2Tokenizer", "--chat-template", "llama2")
GOOD_CONVERSATION = (b'{"messages": [{"role": "user", "content": "hi"}, '
                     b'{"role": "assistant", "content": "ok"}]}\n')


def test_sft_preprocessing_names_a_lone_surrogate_by_file_and_line(tmp_path, shared_data):
    bad = (b'{"messages": [{"role": "user", "content": "x \\ud800 y"}, '
           b'{"role": "assistant", "content": "ok"}]}\n')
    out = _preprocess("preprocess_sft_data.py", tmp_path, shared_data, GOOD_CONVERSATION + bad,
                      *SFT_FLAGS)
    assert out.returncode == 2 and "in.jsonl:2" in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path / "out") == []


def test_sft_preprocessing_names_invalid_utf8_by_file_and_line(tmp_path, shared_data):
    bad = (b'{"messages": [{"role": "user", "content": "x \xff y"}, '
           b'{"role": "assistant", "content": "ok"}]}\n')
    out = _preprocess("preprocess_sft_data.py", tmp_path, shared_data, GOOD_CONVERSATION + bad,
                      *SFT_FLAGS)
    assert out.returncode == 2 and "in.jsonl:2: not UTF-8" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_lone_surrogate_in_the_corpus_is_named_with_workers(tmp_path, shared_data, workers):
    out = _preprocess("preprocess_data.py", tmp_path, shared_data,
                      b'{"text": "good"}\n{"text": "lone \\ud800 here"}\n',
                      "--tokenizer-type", "SentencePieceTokenizer", "--workers", workers)
    assert out.returncode == 2 and "in.jsonl:2" in out.stderr and "surrogate" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path / "out") == []


# --- preprocessing workers killed or stopped from outside (slow) -----------------------------

SP_MODEL_NAME = "sentencepiece-llama-32k.model"


def _start_preprocessing(tool, tmp_path, shared_data, lines=200000):
    """``tool --workers 2`` on a corpus long enough to be running when a test acts; the
    process and its two workers' pids."""
    from tests.helpers.reliability import child_processes

    model = os.path.join(shared_data, SP_MODEL_NAME)
    if not os.path.isfile(model):
        pytest.skip("the 32k SentencePiece model is not beside the repository")
    text = " ".join(["alpha beta gamma delta tokens of the run"] * 8)
    src = tmp_path / "in.jsonl"
    if tool == "preprocess_sft_data.py":
        line = json.dumps({"messages": [{"role": "user", "content": text},
                                        {"role": "assistant", "content": text}]})
        flags = ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model,
                 "--chat-template", "llama2"]
    else:
        line = json.dumps({"text": text})
        flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                 "--chunk-size", "64"]
    src.write_text((line + "\n") * lines)
    (tmp_path / "out").mkdir()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", tool), "--input", str(src),
                             "--output-prefix", str(tmp_path / "out" / "o"), *flags,
                             "--workers", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 300
    while len(child_processes(proc.pid)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(2)  # chunks in flight
    workers = child_processes(proc.pid)
    assert len(workers) >= 2 and proc.poll() is None, "the run ended before the test acted"
    return proc, workers


def _one_error_line(err):
    """stderr ends in one ``error:`` line and holds no traceback (progress lines may precede)."""
    return ([line for line in err.splitlines() if "error:" in line] == err.strip().splitlines()[-1:]
            and "Traceback" not in err)


def _end_within(proc, workers, seconds):
    """``(status, stderr)``, or ``(None, ...)`` when still running after ``seconds`` (then every
    process is killed)."""
    try:
        _, err = proc.communicate(timeout=seconds)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[1]


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_sft_preprocessing_stops_in_one_line_when_a_worker_is_killed(tmp_path, shared_data):
    """Failed in this pass (multiprocessing.Pool.imap waited for the lost chunk forever); held
    once preprocess_sft_data.py took the shared worker pool."""
    proc, workers = _start_preprocessing("preprocess_sft_data.py", tmp_path, shared_data)
    os.kill(workers[0], signal.SIGKILL)
    status, err = _end_within(proc, workers, 120)
    assert status == 1 and _one_error_line(err) and "SIGKILL" in err, (status, err)
    assert not [f for f in os.listdir(tmp_path / "out") if f.endswith((".bin", ".idx"))]


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_preprocessing_ends_by_itself_when_a_worker_is_stopped(tmp_path, shared_data):
    """Failed in this pass (no progress timeout: the run waited forever); held once a worker
    stopped for 60 s ends the run."""
    proc, workers = _start_preprocessing("preprocess_data.py", tmp_path, shared_data)
    os.kill(workers[0], signal.SIGSTOP)
    status, err = _end_within(proc, workers, 180)
    assert status is not None and status != 0 and _one_error_line(err), (status, err)


@pytest.mark.timeout(1200)
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_preprocessing_stops_in_one_line_when_a_worker_is_killed_from_outside(tmp_path,
                                                                              shared_data):
    """The out-of-memory killer's SIGKILL from outside (the project's own test injects the
    death from inside the worker)."""
    proc, workers = _start_preprocessing("preprocess_data.py", tmp_path, shared_data)
    os.kill(workers[0], signal.SIGKILL)
    status, err = _end_within(proc, workers, 120)
    assert status == 1 and _one_error_line(err), (status, err)
    assert "was killed by SIGKILL" in err and "no output written" in err
    assert os.listdir(tmp_path / "out") == []
    time.sleep(2)
    from tests.helpers.reliability import process_running
    assert not [pid for pid in workers if process_running(pid)], "a worker outlived the run"


# --- preemption with loader workers: PP=2, the signal twice, around an evaluation (slow) -----

@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.timeout(3000)
def test_sigterm_twice_at_pp2_with_loader_workers_saves_and_resumes_bitwise(tmp_path):
    """Slurm's SIGTERM to torchrun's agent, sent twice 0.3 s apart right after an iteration that
    evaluates (--eval-interval 2, 20 evaluation iterations), at PP=2 with --num-workers 2 and
    --ckpt-format torch_dist: both ranks finish, save and return; no loader worker is left; the
    resumed run's losses, grad norms and validation losses equal an uninterrupted run's
    bitwise (measured in the pass at PP=2 and at DP=2)."""
    from tests.e2e.test_reliability_launch import Run
    from tests.helpers.reliability import child_processes, process_running

    prefix = write_dataset(str(tmp_path / "text_document"))
    iters = 8

    def argv(*extra):
        return tiny_argv(prefix, str(tmp_path / "cache"), iters, "--pipeline-model-parallel-size",
                         "2", "--num-workers", "2", "--ckpt-format", "torch_dist",
                         "--eval-iters", "20", *extra)

    save = str(tmp_path / "ckpt")
    run = Run(tmp_path / "killed", argv("--save", save, "--exit-signal-handler"),
              env={"RELIABILITY_STEP_DELAY": "0.3"})
    run.wait_for(r"iteration\s+2/")
    workers = [w for rank in range(2) for w in child_processes(run.pid(rank))]
    run.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    run.proc.send_signal(signal.SIGTERM)
    run.wait()
    log = run.log()
    last = run.history(1)["iteration"][-1]
    assert run.history(0)["iteration"][-1] == last and 2 <= last < iters, log[-3000:]
    assert f"exiting program at iteration {last} after receiving SIGTERM" in log
    assert "killed by signal" not in log
    assert open(os.path.join(save, TRACKER)).read() == str(last)
    time.sleep(3)
    assert not [w for w in workers if process_running(w)], "loader workers outlived the job"

    resumed = Run(tmp_path / "resumed", argv("--save", save, "--load", save))
    reference = Run(tmp_path / "reference", argv())
    assert resumed.wait() == 0 and reference.wait() == 0, resumed.log()[-3000:]
    got, want = resumed.history(1), reference.history(1)
    tail = {k: [v for it, v in zip(want["iteration"], want[k]) if it > last]
            for k in ("lm loss", "grad norm")}
    assert got["lm loss"] == tail["lm loss"] and got["grad norm"] == tail["grad norm"]
    assert got["valid"] == [v for v in want["valid"] if v[0] > last]


def test_export_copies_a_sentencepiece_model_named_by_the_checkpoint(tmp_path, shared_data):
    """The other side of the check above: a real SentencePiece model recorded as the
    checkpoint's --tokenizer-model is copied into the export when it lies inside --load-dir;
    outside it (since the fourth hostile pass) it is neither read nor copied, and the line
    names the --tokenizer-dir to pass."""
    import contextlib
    import io
    import shutil

    from tests.helpers.convert import convert, make_hf

    model = os.path.join(shared_data, "sentencepiece-llama-32k.model")
    if not os.path.isfile(model):
        pytest.skip("the 32k SentencePiece model is not beside the repository")
    make_hf(str(tmp_path / "hf"))
    os.remove(tmp_path / "hf" / "tokenizer.model")
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "hf",
            "--save-dir", tmp_path / "meg")
    inside = str(tmp_path / "meg" / "tokenizer.model")
    shutil.copy(model, inside)
    for recorded, export in ((model, "outside"), (inside, "inside")):
        for path in glob.glob(str(tmp_path / "meg" / "**" / "model_optim_rng.pt"), recursive=True):
            state = torch.load(path, weights_only=True)
            state["args"]["tokenizer_model"] = recorded
            state["args"].pop("tokenizer_dir", None)
            torch.save(state, path)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "meg",
                    "--save-dir", tmp_path / export)
        log = out.getvalue()
        copied = tmp_path / export / "tokenizer.model"
        if export == "outside":
            assert not copied.exists() and f"pass --tokenizer-dir {model}" in log, log[-2000:]
        else:
            with open(model, "rb") as f:
                assert copied.read_bytes() == f.read()

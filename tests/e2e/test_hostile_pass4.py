"""A fourth hostile pass over the faults of issue 31, by someone who did not write the fixes:
variants the earlier passes did not try. Cases that held are regression tests; cases that failed
are ``xfail(strict=True)`` (drop the marker with the fix). The promise (docs/reliability.md): bad
input gets one line naming the file or flag, the value and the fix, exit 2 (1 for a runtime
fault), no traceback, nothing lost, nothing from an input executed, no hang.

Default tier: in-process cases and a few short subprocesses. ``slow``: the launched runs, signals
and the cases that wait for a hang."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron.checkpointing import checkpoint_folder
from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
from megatron.usage_error import UsageError
from tests.e2e.test_hostile_pass2 import _pretrain, _pretrain_here, _within
from tests.e2e.test_preemption_workers import data  # noqa: F401 - the launched runs' fixture
from tests.helpers.dist import run_distributed
from tests.helpers.paths import ROOT, SHARED_DATA
from tests.helpers.reliability import tiny_argv, write_dataset

SP_MODEL = os.path.join(SHARED_DATA, "sentencepiece-llama-32k.model")
needs_sp = pytest.mark.skipif(not os.path.isfile(SP_MODEL), reason="no SentencePiece model beside the repository")


def _release_readers(fifo):
    """Let a thread blocked opening ``fifo`` for reading go on (a writer appears and leaves)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _tool(name, *argv, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, argv)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _one_line(err):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return len(lines) == 1 and "Traceback" not in err


# --- ZeRO-3: user code touching a parameter between iterations --------------------------------

def _zero3_world(reads):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.param_units import ShardedParameterAccessError
    from tests.helpers.toy import distrib_iteration
    from tests.unit.core.distributed.test_zero import _build

    ps.initialize_model_parallel(1, 1)
    net, ddp, opt = _build("optim_grads_params", overlap_grad=True)
    for step in range(2):
        distrib_iteration(ddp, opt, step, 2)
    out = {}
    for name in reads:
        try:
            _ZERO3_READS[name](net.fc.weight)
            out[name] = "no error"
        except ShardedParameterAccessError as exc:
            out[name] = "named" if "'fc.weight'" in str(exc) else str(exc)
        except Exception as exc:  # noqa: BLE001 - a raw library error is the finding
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _no_grad_copy(p):
    with torch.no_grad():
        return p.copy_(torch.zeros(p.shape))


_ZERO3_READS = {
    "repr": repr, "f-string": lambda p: f"{p}", "p[0]": lambda p: p[0],
    "item": lambda p: p[0, 0].item(), "view": lambda p: p.view(-1), "clone": lambda p: p.clone(),
    "detach().sum()": lambda p: p.detach().sum(), "tolist": lambda p: p.tolist(),
    "F.linear": lambda p: torch.nn.functional.linear(torch.ones(1, p.shape[1]), p),
    "cat": lambda p: torch.cat([p, p]), "cpu().sum()": lambda p: p.cpu().sum(),
    "pickle": lambda p: __import__("pickle").dumps(p), "copy.copy": lambda p: __import__("copy").copy(p),
    "storage()": lambda p: p.storage().tolist(), "np.asarray": np.asarray,
    "parameters_to_vector": lambda p: torch.nn.utils.parameters_to_vector([p]),
    "torch.from_dlpack(p)": lambda p: torch.from_dlpack(p).sum(),
    "Tensor.sum(p)": lambda p: torch.Tensor.sum(p), "aten.sum": lambda p: torch.ops.aten.sum(p),
    "as_strided": lambda p: torch.as_strided(p, (2,), (1,)).sum(),
    "nested stack": lambda p: torch.stack([torch.stack([p])]), "copy_ (write)": _no_grad_copy,
    # Crash the process (segfault) in this pass:
    "as_subclass(Tensor).sum()": lambda p: p.as_subclass(torch.Tensor).sum(),
    "main_grad.sum()": lambda p: p.main_grad.sum(),
    "from_dlpack(to_dlpack(p)).sum()": lambda p: torch.from_dlpack(torch.utils.dlpack.to_dlpack(p)).sum(),
    "Tensor._make_subclass(Tensor, p).sum()": lambda p: torch.Tensor._make_subclass(torch.Tensor, p).sum(),
    # Reads memory that is not the parameter's (another value each run) in this pass:
    "empty(0).set_(p.untyped_storage()).sum()":
        lambda p: torch.empty(0).set_(p.untyped_storage(), 0, p.shape).sum(),
}
_ZERO3_CRASHES = ["as_subclass(Tensor).sum()", "main_grad.sum()", "from_dlpack(to_dlpack(p)).sum()",
                  "Tensor._make_subclass(Tensor, p).sum()", "empty(0).set_(p.untyped_storage()).sum()"]
_ZERO3_HELD = [name for name in _ZERO3_READS if name not in _ZERO3_CRASHES]


@pytest.fixture(scope="module")
def zero3_held():
    return run_distributed(2, _zero3_world, _ZERO3_HELD)


@pytest.mark.parametrize("read", _ZERO3_HELD)
def test_zero3_more_reads_between_iterations_raise_the_named_error(zero3_held, read):
    assert all(out[read] == "named" for out in zero3_held), [out[read] for out in zero3_held]


@pytest.mark.parametrize("read", [
    "as_subclass(Tensor).sum()", "main_grad.sum()",
    pytest.param("from_dlpack(to_dlpack(p)).sum()", marks=pytest.mark.xfail(
        strict=True, reason="issue 31, fourth pass: to_dlpack hands out the freed storage; segfault")),
    pytest.param("Tensor._make_subclass(Tensor, p).sum()", marks=pytest.mark.xfail(
        strict=True, reason="issue 31, fourth pass: _make_subclass is not checked; segfault")),
    pytest.param("empty(0).set_(p.untyped_storage()).sum()", marks=pytest.mark.xfail(
        strict=True, reason="issue 31, fourth pass: untyped_storage() is metadata (identity "
                            "checks compare its data_ptr); torch's set_ does not bound-check a "
                            "shape against any storage (torch.empty(0).set_(torch.empty(0)."
                            "untyped_storage(), 0, (16, 16)) reads out of bounds too)"))])
def test_zero3_reads_that_crashed_the_rank_raise_the_named_error(read):
    """In the pass each of these killed the rank with SIGSEGV: ``as_subclass`` and ``to_dlpack``
    hand out the freed storage without the check, and ``main_grad`` is a view of a freed
    gradient buffer. ``main_grad``'s error names another remedy (finish_grad_sync), so the
    oracle is the parameter's name in a ShardedParameterAccessError."""
    out = run_distributed(2, _zero3_world, [read])
    assert all(o[read] == "named" for o in out), [o[read] for o in out]


# --- torch_dist checkpoint files that are no regular file, or deep JSON -------------------------

def test_a_metadata_file_that_is_a_pipe_is_refused_without_blocking(tmp_path):
    from megatron.core.dist_checkpointing import storage

    os.mkfifo(tmp_path / ".metadata")
    how, value = _within(10, storage.read_metadata, str(tmp_path))
    _release_readers(str(tmp_path / ".metadata"))
    assert how == "raised" and ".metadata" in str(value), (how, value)


def test_a_deeply_nested_metadata_json_is_named(tmp_path):
    from megatron.checkpointing import torch_dist

    (tmp_path / "metadata.json").write_text("[" * 100000)
    with pytest.raises(CheckpointError, match="metadata.json"):
        torch_dist.is_torch_dist_checkpoint(str(tmp_path))


# --- the --save folder: the DPO reference table and the lock's creation temporary --------------

def _npz(folder, meta, table=None):
    np.savez(os.path.join(folder, "dpo_reference.npz"),
             table=np.zeros((3, 2), np.float32) if table is None else table,
             pairs=np.arange(3), meta=np.array(meta))


@pytest.mark.parametrize("meta", [json.dumps([1, 2]), json.dumps({"seq_length": 16}), "[" * 100000],
                         ids=["a list", "no documents", "deep JSON"])
def test_a_dpo_reference_table_with_bad_meta_is_a_usage_error(tmp_path, meta):
    from megatron.training import dpo_reference

    _npz(str(tmp_path), meta)
    with pytest.raises(UsageError, match="dpo_reference.npz"):
        dpo_reference.read_reference(str(tmp_path), {})


def test_a_dpo_reference_table_whose_header_claims_terabytes_is_a_usage_error(tmp_path):
    import io
    import zipfile

    from megatron.training import dpo_reference

    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 2), }"
    header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
    npy = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + b"\0" * 16

    def member(array):
        buf = io.BytesIO()
        np.save(buf, array)
        return buf.getvalue()

    with zipfile.ZipFile(tmp_path / "dpo_reference.npz", "w") as z:
        z.writestr("table.npy", npy)
        z.writestr("pairs.npy", member(np.arange(3)))
        z.writestr("meta.npy", member(np.array(json.dumps({"documents": 3}))))
    with pytest.raises(UsageError, match="dpo_reference.npz"):
        dpo_reference.read_reference(str(tmp_path), {})


_LOCK_WITH_PLANTED_TEMPORARY = """
import os, socket, sys
sys.path.insert(0, sys.argv[1])
from megatron.checkpointing import save_folder
save, kind, target = sys.argv[2], sys.argv[3], sys.argv[4]
tmp = os.path.join(save, save_folder.LOCK_FILENAME) + f".new.{socket.gethostname()}.{os.getpid()}"
os.mkfifo(tmp) if kind == "pipe" else os.symlink(target, tmp)
try:
    save_folder.SaveFolderLock(save).acquire()
    print("acquired")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def _lock_with_planted_temporary(tmp_path, kind, timeout):
    """Take the lock of ``tmp_path/save`` in a process that first plants its own creation
    temporary (``megatron_save.lock.new.HOST.PID``: predictable where pids repeat, as in
    containers) as a named pipe or a link to ``tmp_path/victim.txt``."""
    save, victim = tmp_path / "save", tmp_path / "victim.txt"
    save.mkdir()
    victim.write_text("VICTIM\n")
    proc = subprocess.Popen([sys.executable, "-c", _LOCK_WITH_PLANTED_TEMPORARY, ROOT, str(save),
                             kind, str(victim)], stdout=subprocess.PIPE, text=True)
    try:
        return proc.communicate(timeout=timeout)[0], victim.read_text()
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, victim.read_text()


def test_the_lock_temporary_as_a_link_writes_nothing_outside_the_save_folder(tmp_path):
    out, victim = _lock_with_planted_temporary(tmp_path, "link", 120)
    assert victim == "VICTIM\n", f"the file outside --save now holds {victim!r} ({out})"


@pytest.mark.slow
def test_the_lock_temporary_as_a_pipe_does_not_hang(tmp_path):
    out, _ = _lock_with_planted_temporary(tmp_path, "pipe", 30)
    assert out is not None, "taking the lock hung on a pipe under its creation temporary's name"


_SAVE_NAMES = ["iter_0000002", "iter_0000002.old", "iter_0000002.tmp", "iter_0000001.tmp"]
_HOSTILE_KINDS = {
    "pipe": lambda path, outside: os.mkfifo(path),
    "dangling link": lambda path, outside: os.symlink(outside / "nowhere", path),
    "link to /dev/zero": lambda path, outside: os.symlink("/dev/zero", path),
    "link to a pipe": lambda path, outside: (os.mkfifo(outside / "pipe"), os.symlink(outside / "pipe", path)),
    "link to an outside folder": lambda path, outside: os.symlink(outside, path),
    "link to an outside file": lambda path, outside: os.symlink(outside / "file", path),
}


@pytest.mark.parametrize("kind", list(_HOSTILE_KINDS))
@pytest.mark.parametrize("name", _SAVE_NAMES)
def test_a_save_over_a_hostile_name_in_the_save_folder_lands_inside_it(tmp_path, name, kind):
    """Every name a save creates or removes, as a pipe or a link of each kind: the start-up
    check and the save end (no pipe opened), publish a real folder and the tracker, and leave
    what lies outside --save as it was."""
    save, outside = tmp_path / "save", tmp_path / "outside"
    save.mkdir()
    outside.mkdir()
    (outside / "file").write_text("OUTSIDE\n")
    _HOSTILE_KINDS[kind](save / name, outside)

    def save_once():
        from megatron.checkpointing import save_folder

        save_folder.check_tracker_files(str(save))
        checkpoint_folder.prepare_staging(str(save), str(save / "iter_0000002.tmp"))
        (save / "iter_0000002.tmp" / "mp_rank_00").mkdir(parents=True, exist_ok=True)
        checkpoint_folder.publish(str(save), str(save / "iter_0000002.tmp"),
                                  str(save / "iter_0000002"), 2, 0)

    how, value = _within(30, save_once)
    for pipe in (save / name, outside / "pipe"):
        _release_readers(str(pipe))
    assert how == "returned", (how, value)
    assert (save / "iter_0000002" / "mp_rank_00").is_dir() and not (save / "iter_0000002").is_symlink()
    assert (save / checkpoint_folder.TRACKER_FILENAME).read_text() == "2"
    assert sorted(os.listdir(outside)) in (["file"], ["file", "pipe"])
    assert (outside / "file").read_text() == "OUTSIDE\n"


@pytest.mark.parametrize("kind", ["pipe", "link to an outside folder", "folder holding a pipe"])
def test_keep_last_over_an_older_checkpoint_name_that_is_hostile(tmp_path, kind):
    """--keep-last-checkpoints 1 deleting an older ``iter_0000001`` that is a pipe, a link to a
    folder outside, or a folder holding a pipe: no hang, nothing outside touched."""
    save, outside = tmp_path / "save", tmp_path / "outside"
    (save / "iter_0000002.tmp" / "mp_rank_00").mkdir(parents=True)
    outside.mkdir()
    (outside / "precious").write_text("x")
    old = save / "iter_0000001"
    if kind == "pipe":
        os.mkfifo(old)
    elif kind.startswith("link"):
        os.symlink(outside, old)
    else:
        old.mkdir()
        os.mkfifo(old / "model_optim_rng.pt")
    (save / checkpoint_folder.TRACKER_FILENAME).write_text("1")
    how, value = _within(30, checkpoint_folder.publish, str(save), str(save / "iter_0000002.tmp"),
                         str(save / "iter_0000002"), 2, 1)
    assert how == "returned", (how, value)
    assert sorted(os.listdir(outside)) == ["precious"]
    assert (save / checkpoint_folder.TRACKER_FILENAME).read_text() == "2"


# --- hostile bytes in corpora and chat templates ----------------------------------------------

@needs_sp
@pytest.mark.parametrize("tool, line", [
    ("preprocess_data.py", '{"text": ' + "[" * 100000),
    ("preprocess_sft_data.py", '{"messages": ' + "[" * 100000)])
def test_a_deeply_nested_corpus_line_is_named_file_and_line(tmp_path, tool, line):
    (tmp_path / "in.jsonl").write_text(line + "\n")
    extra = ["--chat-template", "llama2"] if "sft" in tool else []
    out = _tool(tool, "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "o",
                "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", SP_MODEL, *extra)
    assert out.returncode == 2 and _one_line(out.stderr) and "in.jsonl:1" in out.stderr, out.stderr[-2000:]


@needs_sp
def test_a_valid_surrogate_pair_is_text_with_workers(tmp_path):
    """The lone-surrogate check must not refuse a correctly escaped pair (an emoji)."""
    (tmp_path / "in.jsonl").write_text('{"text": "a \\ud83d\\ude00 b"}\n{"text": "c"}\n')
    out = _tool("preprocess_data.py", "--input", tmp_path / "in.jsonl", "--output-prefix",
                tmp_path / "o", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", SP_MODEL,
                "--workers", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 documents" in out.stdout


@needs_sp
@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_an_output_name_that_is_a_folder_is_refused_in_one_line(tmp_path, suffix):
    (tmp_path / "in.jsonl").write_text('{"text": "a b"}\n')
    (tmp_path / ("o_text_document" + suffix)).mkdir()
    out = _tool("preprocess_data.py", "--input", tmp_path / "in.jsonl", "--output-prefix",
                tmp_path / "o", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", SP_MODEL)
    assert out.returncode == 2 and _one_line(out.stderr), out.stderr[-2000:]
    assert "o_text_document" + suffix in out.stderr


def _template_folder(tmp_path, template):
    from tests.unit.data.test_chat_templates import CHATML, _tiny_hf_folder

    folder = _tiny_hf_folder(tmp_path / "tok", CHATML)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(template)
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"}]}) + "\n")
    return folder


def _sft(tmp_path, folder, timeout=300):
    return _tool("preprocess_sft_data.py", "--input", tmp_path / "in.jsonl", "--output-prefix",
                 tmp_path / "o", "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-name-or-path", folder, timeout=timeout)


def test_a_chat_template_emitting_a_lone_surrogate_is_named(tmp_path):
    folder = _template_folder(tmp_path, "{% for m in messages %}{{ m['content'] }}{{ '\\ud800' }}{% endfor %}")
    out = _sft(tmp_path, folder)
    assert out.returncode == 2 and _one_line(out.stderr), out.stderr[-2000:]


def test_a_chat_template_reaching_for_python_runs_nothing(tmp_path):
    marker = tmp_path / "PWNED"
    folder = _template_folder(tmp_path, "{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}"
                              "{%% for m in messages %%}{{ m['content'] }}{%% endfor %%}" % marker)
    out = _sft(tmp_path, folder)
    assert out.returncode == 2 and _one_line(out.stderr), out.stderr[-2000:]
    assert not marker.exists()


@pytest.mark.slow
def test_a_chat_template_of_endless_loops_ends_by_itself(tmp_path):
    folder = _template_folder(tmp_path, "{% for i in range(100000) %}{% for j in range(100000) %}"
                              "{% endfor %}{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    try:
        out = _sft(tmp_path, folder, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("preprocess_sft_data.py still rendering a hostile chat template after 120 s")
    assert out.returncode == 2, out.stderr[-2000:]


# --- HuggingFace config.json contradicting its tensors ------------------------------------------

def _import_with_config(tmp_path, **changes):
    from tests.helpers.convert import make_hf

    make_hf(str(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    config.update(changes)
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(config, f)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
                           "--model-type", "GPT", "--loader", "hf", "--saver", "megatron",
                           "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_a_config_with_fewer_layers_than_the_weights_is_refused(tmp_path):
    out = _import_with_config(tmp_path, num_hidden_layers=1)  # make_hf writes 2 layers
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not glob.glob(str(tmp_path / "out" / "*")), "a checkpoint was written"


@pytest.mark.slow
@pytest.mark.parametrize("changes", [{"num_hidden_layers": -1}, {"num_hidden_layers": 3},
                                     {"rope_scaling": [1, 2]}], ids=["-1 layers", "3 layers", "rope_scaling list"])
def test_a_config_contradicting_the_weights_is_one_line(tmp_path, changes):
    out = _import_with_config(tmp_path, **changes)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not glob.glob(str(tmp_path / "out" / "*")), "a checkpoint was written"


# --- the export copies files of a folder only the checkpoint names ----------------------------

@needs_sp
@pytest.mark.slow
def test_export_copies_no_private_file_from_a_folder_only_the_checkpoint_names(tmp_path):
    """The third pass's fix copies from a folder the checkpoint records when it holds a tokenizer
    that loads: a private folder holding one (any user's tokenizer folder at a guessable path)
    still has its other files (here a private tokenizer_config.json) copied into the export."""
    from tests.e2e.test_hostile_pass3 import _crafted_export

    def private(folder):
        shutil.copy(SP_MODEL, folder / "tokenizer.model")
        (folder / "tokenizer_config.json").write_text('{"note": "PRIVATE", "model_max_length": 4096}')

    out = _crafted_export(tmp_path, private)
    assert out.returncode in (0, 2), out.stderr[-2000:]
    copied = [p for p in glob.glob(str(tmp_path / "export" / "*"))
              if b"PRIVATE" in open(p, "rb").read()]
    assert not copied, f"{copied} copied from a folder named only by the checkpoint"


@needs_sp
@pytest.mark.slow
def test_export_copies_no_private_sentencepiece_model_the_checkpoint_names(tmp_path):
    """The checkpoint records a private file that IS a SentencePiece model (someone's tokenizer
    at a guessable path) as its --tokenizer-model: before the --load-dir rule it was copied into
    the export byte for byte."""
    from tests.helpers.convert import convert, make_hf

    private = tmp_path / "private" / "proprietary.model"
    private.parent.mkdir()
    shutil.copy(SP_MODEL, private)
    make_hf(str(tmp_path / "hf"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "hf",
            "--save-dir", tmp_path / "meg")
    for path in glob.glob(str(tmp_path / "meg" / "**" / "model_optim_rng.pt"), recursive=True):
        state = torch.load(path, weights_only=True)
        state["args"]["tokenizer_model"] = str(private)
        state["args"].pop("tokenizer_dir", None)
        torch.save(state, path)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
                          "--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                          "--load-dir", str(tmp_path / "meg"), "--save-dir", str(tmp_path / "export")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    secret = private.read_bytes()
    assert not [p for p in glob.glob(str(tmp_path / "export" / "*")) if open(p, "rb").read() == secret]


# --- pretrain_llama.py: a mistyped --load and hostile torch_dist files (launched) ----------------

@pytest.fixture(scope="module")
def data4(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile4")
    return write_dataset(str(root / "text_document")), str(root / "cache")


def _saved(data4, tmp_path, *fmt):
    prefix, cache = data4
    tmp_path.mkdir(parents=True, exist_ok=True)
    save = tmp_path / "ck"
    status, err = _pretrain_here(tiny_argv(prefix, cache, 2, "--save", str(save),
                                           "--save-interval", "1", *fmt), tmp_path)
    assert status == 0, err[-3000:]
    return save


def _model_file(save, it=2):
    return save / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt"


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("slip", ["the iteration folder", "the tracker deleted"])
def test_a_load_that_finds_no_tracker_beside_checkpoints_loses_nothing(data4, tmp_path, slip):
    """``--load ck/iter_0000002 --save ck`` (the iteration folder given), or ``--load ck --save ck``
    with the tracker lost while ``iter_*`` checkpoints are there: in the pass both trained from
    scratch with exit 0 and their save replaced ``ck/iter_0000002``."""
    prefix, cache = data4
    save = _saved(data4, tmp_path)
    before = _model_file(save).read_bytes()
    if slip == "the tracker deleted":
        os.remove(save / checkpoint_folder.TRACKER_FILENAME)
        load = save
    else:
        load = save / "iter_0000002"
    status, err = _pretrain_here(tiny_argv(prefix, cache, 2, "--load", str(load), "--save",
                                           str(save), "--save-interval", "1"), tmp_path)
    assert _model_file(save).read_bytes() == before, "the checkpoint at --load was replaced"
    # Refused in one line, or (the tracker lost) resumed from the last complete checkpoint.
    assert status == 2 and _one_line(err) or status == 0 and slip == "the tracker deleted", err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("what", ["empty folder", "folder of another job"])
def test_a_load_folder_that_is_not_the_save_folder_and_holds_no_checkpoint_is_refused(data4, tmp_path, what):
    prefix, cache = data4
    load = tmp_path / "load"
    load.mkdir()
    if what != "empty folder":
        shutil.copy(prefix + ".bin", load / "x.bin")  # a dataset, not a checkpoint
    status, err = _pretrain_here(tiny_argv(prefix, cache, 2, "--load", str(load), "--save",
                                           str(tmp_path / "save")), tmp_path)
    assert status == 2 and _one_line(err) and "--load" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_torch_dist_data_file_that_is_a_pipe_does_not_hang_the_load(data4, tmp_path):
    prefix, cache = data4
    save = _saved(data4, tmp_path, "--ckpt-format", "torch_dist")
    data_file = save / "iter_0000002" / "__0_0.distcp"
    os.remove(data_file)
    os.mkfifo(data_file)
    status, err = _pretrain(tiny_argv(prefix, cache, 3, "--load", str(save), "--ckpt-format",
                                      "torch_dist", "--override-opt_param-scheduler"), tmp_path, 120)
    assert status is not None, "the load hung opening __0_0.distcp, a named pipe"
    assert status == 2 and "__0_0.distcp" in err, err[-3000:]


def _without(key, sub):
    def edit(common):
        common[key].pop(sub)
    return edit


def _setting(key, value):
    def edit(common):
        common[key] = value
    return edit


_COMMON_DAMAGE = {
    "iteration -5": _setting("iteration", -5),
    "scheduler without num_steps": _without("opt_param_scheduler", "num_steps"),
    "optimizer without param_groups": _without("optimizer", "param_groups"),
    "rng_state states a list": lambda common: common["rng_state"].update(states=[1, 2]),
}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("damage", list(_COMMON_DAMAGE))
def test_a_common_file_missing_inner_keys_is_named(data4, tmp_path, damage):
    """common.pt at the layout that wrote it, with a key inside what loading reads removed or of
    another type (the authors' check covers the top-level keys)."""
    prefix, cache = data4
    save = _saved(data4, tmp_path, "--ckpt-format", "torch_dist")
    path = save / "iter_0000002" / "common.pt"
    common = torch.load(path, weights_only=True)
    _COMMON_DAMAGE[damage](common)
    torch.save(common, path)
    status, err = _pretrain_here(tiny_argv(prefix, cache, 3, "--load", str(save), "--ckpt-format",
                                           "torch_dist", "--override-opt_param-scheduler"), tmp_path)
    assert status == 2 and _one_line(err) and "common.pt" in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_torch_dist_data_file_of_another_run_is_refused(data4, tmp_path):
    """Two runs (seeds 7 and 8), same iteration and layout: run B's ``__0_0.distcp`` in run A's
    checkpoint is named (the per-save id)."""
    prefix, cache = data4
    a = _saved(data4, tmp_path / "a", "--ckpt-format", "torch_dist")
    b = _saved(data4, tmp_path / "b", "--ckpt-format", "torch_dist", "--seed", "8")
    shutil.copy(b / "iter_0000002" / "__0_0.distcp", a / "iter_0000002" / "__0_0.distcp")
    status, err = _pretrain_here(tiny_argv(prefix, cache, 3, "--load", str(a), "--ckpt-format",
                                           "torch_dist", "--override-opt_param-scheduler"), tmp_path)
    assert status == 2 and _one_line(err), err[-3000:]
    assert "__0_0.distcp comes from another save" in err


# --- preemption and kills with loader workers (launched, slow) ---------------------------------

def _descendants(pid):
    from tests.helpers.reliability import child_processes

    found = []
    try:
        for kid in child_processes(pid):
            found += [kid] + _descendants(kid)
    except FileNotFoundError:
        pass
    return found


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("fmt", [[], ["--ckpt-format", "torch_dist", "--async-save"]], ids=["torch", "async"])
def test_sigterm_during_the_first_iteration_saves_it_and_the_resume_continues(data, fmt):
    """SIGTERM to the agent while iteration 1 runs (the step slowed to 6 s): both ranks finish
    it, save it and return; a restart resumes at iteration 2."""
    from tests.e2e.test_reliability_launch import Run
    from tests.helpers.reliability import process_running

    root, argv = data
    name = "first_" + ("async" if fmt else "torch")
    save = str(root / f"{name}_ckpt")
    run = Run(root / name, argv("--save", save, "--load", save, "--exit-signal-handler", *fmt),
              env={"RELIABILITY_STEP_DELAY": "6"})
    run.wait_for(r"training from iteration 0")
    workers = _descendants(run.pid(0)) + _descendants(run.pid(1))
    time.sleep(1)
    run.proc.send_signal(signal.SIGTERM)
    run.wait(600)
    log = run.log()
    assert run.history(0)["iteration"] == [1] and run.history(1)["iteration"] == [1], log[-3000:]
    assert "exiting program at iteration 1 after receiving SIGTERM" in log
    assert open(os.path.join(save, checkpoint_folder.TRACKER_FILENAME)).read() == "1"
    time.sleep(3)
    assert not [w for w in workers if process_running(w)]
    again = Run(root / (name + "_resumed"), argv("--save", save, "--load", save, *fmt, "--exit-interval", "3"))
    assert again.wait(600) == 0, again.log()[-3000:]
    assert again.history(1)["iteration"] == [2, 3]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_sigterm_to_every_process_of_the_step_at_once_saves(data):
    """Slurm signals every task of a step, not only torchrun: the agent, both ranks and all their
    loader workers get SIGTERM at the same moment, with an --async-save pending."""
    from tests.e2e.test_reliability_launch import Run
    from tests.helpers.reliability import process_running

    root, argv = data
    save = str(root / "all_ckpt")
    run = Run(root / "all", argv("--save", save, "--exit-signal-handler", "--save-interval", "3",
                                 "--ckpt-format", "torch_dist", "--async-save"),
              env={"RELIABILITY_STEP_DELAY": "0.3"})
    run.wait_for(r"iteration\s+4/")
    everyone = [run.proc.pid] + _descendants(run.proc.pid)
    for pid in everyone:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    run.wait(600)
    log = run.log()
    last = run.history(1)["iteration"][-1]
    assert run.history(0)["iteration"][-1] == last and 4 <= last < 200, log[-3000:]
    assert open(os.path.join(save, checkpoint_folder.TRACKER_FILENAME)).read() == str(last)
    time.sleep(3)
    assert not [p for p in everyone if process_running(p)]


# --- preprocessing: the parent interrupted (slow) ---------------------------------------------

def _start_big_preprocessing(tool, tmp_path):
    """Starts TOOL on an input that takes it about ten seconds (240,000 documents; the signal
    must land mid-run on a fast machine too: 60,000 took 2.4 s here) and returns once its
    workers run and its first output temporary holds data."""
    import random

    from tests.helpers.reliability import child_processes, ctrl_c_default

    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex my band".split()
    lines = []
    for _ in range(6000):
        text = " ".join(rng.choice(words) for _ in range(60))
        lines.append(json.dumps({"text": text} if tool == "preprocess_data.py" else {"messages": [
            {"role": "user", "content": text[:80]}, {"role": "assistant", "content": text}]}) + "\n")
    with open(tmp_path / "in.jsonl", "w") as f:
        f.write("".join(lines) * 40)
    (tmp_path / "out").mkdir()
    extra = ["--chat-template", "llama2"] if "sft" in tool else ["--chunk-size", "64"]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", tool), "--input",
                             str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out" / "o"),
                             "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", SP_MODEL,
                             "--workers", "2", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=ctrl_c_default)

    def writing():
        for name in os.listdir(tmp_path / "out"):
            try:
                if ".tmp-" in name and os.path.getsize(tmp_path / "out" / name) > 0:
                    return True
            except FileNotFoundError:  # renamed at the final commit
                pass
        return False

    deadline = time.time() + 120
    while (len(child_processes(proc.pid)) < 2 or not writing()) and time.time() < deadline:
        assert proc.poll() is None, f"{tool} ended before it was signalled: {proc.communicate()}"
        time.sleep(0.05)
    workers = child_processes(proc.pid)
    assert len(workers) >= 2 and writing(), f"{tool} did not start writing within 120 s"
    time.sleep(0.5)
    assert proc.poll() is None, f"{tool} ended before it was signalled"
    return proc, workers


@needs_sp
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("tool, sig", [("preprocess_data.py", signal.SIGINT),
                                       ("preprocess_sft_data.py", signal.SIGINT),
                                       ("preprocess_sft_data.py", signal.SIGTERM)],
                         ids=["data-SIGINT", "sft-SIGINT", "sft-SIGTERM"])
def test_an_interrupted_preprocessing_says_one_line_and_leaves_nothing(tmp_path, tool, sig):
    from tests.helpers.reliability import process_running

    proc, workers = _start_big_preprocessing(tool, tmp_path)
    os.kill(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{tool} did not end after {sig!r}")
    time.sleep(2)
    assert not [w for w in workers if process_running(w)], "a worker outlived its parent"
    assert os.listdir(tmp_path / "out") == [], os.listdir(tmp_path / "out")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]

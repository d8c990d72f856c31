"""Failed writes and bad data, as the user meets them (issue 29).

- A file-size limit (RLIMIT_FSIZE, as a full disk) during a save: one line (status 1, no traceback)
  names the file, the OS's reason and says the previous checkpoint is intact, in both formats (before: torch.save's
  ``inline_container.cc ... unexpected pos`` naming neither); the tracker still names it.
- A full disk (ENOSPC from the writers) under ``--tensorboard-dir`` and ``--data-cache-path``
  does not stop training: one warning each, and the run's losses equal an unlimited run's.
- A token id outside the vocabulary in ``--valid-data-path`` is refused at start naming that
  flag and file.
- ``convert.py --saver megatron`` into a folder holding a stale ``release/`` is refused before
  the source is read, leaving no ``release.tmp``.
- ``--distributed-backend nccl`` without CUDA: one line; under torchrun, from an example script,
  once for the job (slow).
"""

import contextlib
import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.e2e.test_error_lines import _case, _commands, _the_line
from tests.helpers.dist import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.reliability import tiny_argv, write_dataset

LIMIT = 64 << 10  # above the dataset index cache's files, below a checkpoint of the tiny model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("error_lines_io")
    data, cache = write_dataset(str(root / "text_document")), str(root / "cache")
    bad = write_dataset(str(root / "bad_text_document"), max_id=200)
    r = lambda *p: str(root.joinpath(*p))  # noqa: E731
    per_split = [a for a in tiny_argv(data, cache, 2) if a not in ("--data-path", data)]
    longer = ["--override-opt_param-scheduler", "--save-interval", "2"]
    cases = []
    for fmt in ("torch", "torch_dist"):
        cases += [
            _case(f"save {fmt}", tiny_argv(data, cache, 2, "--save", r(fmt), "--ckpt-format", fmt)),
            _case(f"full {fmt}", tiny_argv(data, cache, 4, "--load", r(fmt), "--save", r(fmt),
                                           "--ckpt-format", fmt, *longer), limit=LIMIT)]
    cases += [
        _case("unlimited", tiny_argv(data, r("cache_a"), 2, "--tensorboard-dir", r("tb_a"))),
        _case("bad valid ids", per_split + ["--train-data-path", data, "--valid-data-path", bad]),
    ]
    out = run_distributed(1, _commands, cases, timeout=900)[0]
    out.update(run_distributed(1, _with_a_full_disk, [_case(
        "no space for logs", tiny_argv(data, r("cache_b"), 2, "--tensorboard-dir", r("tb_b")))])[0])
    return out, root, bad


def _with_a_full_disk(cases):
    """:func:`_commands` with every write of TensorBoard's event files and of the dataset index
    cache failing as on a full disk (ENOSPC)."""
    import errno

    from torch.utils.tensorboard.writer import FileWriter

    from megatron.data.index_cache import IndexCache

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    FileWriter.add_event = full
    IndexCache._write_atomic = full
    return _commands(cases)


@pytest.mark.parametrize("fmt, written", [
    ("torch", "mp_rank_00/model_optim_rng.pt"), ("torch_dist", "__0_0.distcp")])
def test_a_file_size_limit_during_a_save_names_the_file_and_keeps_the_previous(runs, fmt, written):
    out, root, _ = runs
    assert out[f"save {fmt}"]["status"] == 0, out[f"save {fmt}"]
    full = out[f"full {fmt}"]
    staging = root / fmt / "iter_0000004.tmp"
    assert full["status"] == 1 and full["error"] is None, full  # the line, no traceback
    assert len(full["stderr"].splitlines()) == 1, full["stderr"]
    error = full["stderr"].strip()
    assert "inline_container" not in error, full
    assert error.startswith("pretrain_llama.py: error: rank 0 could not write "), error
    assert f"{staging}/{written}" in error and "[Errno 27] File too large" in error, error
    assert error.endswith("; the previous checkpoint and latest_checkpointed_iteration.txt are "
                          "intact (free space under --save, then restart with --load)"), error
    assert (root / fmt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not staging.exists() and (root / fmt / "iter_0000002").is_dir()


def test_no_space_for_tensorboard_or_the_index_cache_never_stops_training(runs):
    out, root, _ = runs
    limited, unlimited = out["no space for logs"], out["unlimited"]
    assert unlimited["status"] == 0 and limited["status"] == 0, limited
    warnings = [line for line in limited["stdout"].splitlines() if "--tensorboard-dir" in line]
    assert len(warnings) == 1 and "TensorBoard events are dropped" in warnings[0], warnings
    cache = [line for line in limited["stderr"].splitlines() if "index cache" in line]
    assert len(cache) == 1 and "--data-cache-path" in cache[0], limited["stderr"]
    losses = [re.findall(r"lm loss: (\S+)", run["stdout"]) for run in (limited, unlimited)]
    assert losses[0] == losses[1] and len(losses[0]) == 2, losses  # the same run, bitwise


def test_an_id_outside_the_vocabulary_in_valid_data_is_named_at_start(runs):
    out, root, bad = runs
    high = int(np.fromfile(bad + ".bin", dtype=np.uint16).max())  # the file's own maximum
    _, line = _the_line([out], "bad valid ids")
    assert line.startswith(f"--valid-data-path ({bad}): token id {high} in {bad}.bin is outside "
                           "the vocabulary [0, 128) of --tokenizer-type NullTokenizer "
                           "--vocab-size 127"), line
    assert "building" not in out["bad valid ids"]["stdout"]


def test_convert_refuses_a_stale_release_before_reading(tmp_path, monkeypatch):
    import tools.checkpoint.loader_hf as loader_hf
    from tools.checkpoint.convert import command

    from tests.helpers.convert import make_hf

    make_hf(str(tmp_path / "hf"))
    stale = tmp_path / "out" / "release"
    stale.mkdir(parents=True)
    (stale / "left.txt").write_text("old")

    def never(args):
        raise AssertionError("the source was read")

    monkeypatch.setattr(loader_hf, "load_checkpoint", never)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = command(["--loader", "hf", "--saver", "megatron", "--load-dir",
                          str(tmp_path / "hf"), "--save-dir", str(tmp_path / "out")])
    assert status == 2 and stderr.getvalue() == (
        f"convert.py: error: --save-dir {tmp_path / 'out'} already holds a checkpoint (release); "
        "choose an empty folder, or remove those first\n")
    assert sorted(os.listdir(tmp_path / "out")) == ["release"]
    assert os.listdir(stale) == ["left.txt"]


def _nccl():
    from megatron.training.initialize import initialize_distributed

    try:
        initialize_distributed("nccl")
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda_is_a_usage_error():
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:  # no process group yet
        got = pool.apply(_nccl)
    assert got == ("UsageError", "--distributed-backend nccl needs CUDA, which this machine does "
                                 "not have; use --distributed-backend gloo")


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_an_example_gpu_script_on_a_cpu_machine_says_it_once(tmp_path):
    from tests.helpers.data import placeholder_dataset

    tokenizer = os.path.join(ROOT, "..", "shared", "data", "sentencepiece-llama-32k.model")
    if not os.path.isfile(tokenizer):
        pytest.skip("the shared SentencePiece model is not beside the checkout")
    placeholder_dataset(str(tmp_path / "corpus_text_document"), num_docs=1000, tokens_per_doc=33000)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GPUS_PER_NODE="4", DATA_PATH=str(tmp_path / "corpus_text_document"),
               TOKENIZER_MODEL=os.path.abspath(tokenizer), CHECKPOINT_DIR=str(tmp_path / "ck"),
               TENSORBOARD_DIR=str(tmp_path / "tb"), OMP_NUM_THREADS="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "pretrain_llama2_7b.sh")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    errors = [line for line in log.splitlines() if "error:" in line]
    assert errors == ["pretrain_llama.py: error: --distributed-backend nccl needs CUDA, which this "
                      "machine does not have; use --distributed-backend gloo"], log[-4000:]
    assert re.search(r"exitcode\s*:\s*2", log) and "megatron/" not in log, log[-4000:]

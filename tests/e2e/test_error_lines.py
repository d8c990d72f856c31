"""Errors met while loading, saving and reading data reach the user as one line (issue 29).

- Layout: a legacy (``--ckpt-format torch``) TP=2 x PP=2 checkpoint resumed at TP=1 x PP=2 and
  at TP=1 x PP=1 is one line naming both layouts and the converter command; following it
  resumes (slow).
- The mechanism: every ``CheckpointError`` of a load (a missing shard, a flipped byte, a refused
  pickle in a distributed-optimizer shard, a shape or layer-count mismatch) is one line
  ``pretrain_llama.py: error: ...`` printed by exactly one rank, status 2 on every rank; the same
  damage through ``tools/generate.py`` and ``tools/checkpoint/convert.py`` is one line, status 2.
- A tracker file of undecodable bytes is named with the file.
- A file-size limit (RLIMIT_FSIZE) during a save: the error names the file and says the previous
  checkpoint is intact, in both formats; the same limit under ``--tensorboard-dir`` and
  ``--data-cache-path`` does not stop training (one warning each).
"""

import contextlib
import io
import os
import pickle
import re
import resource
import shutil

import pytest

from tests.helpers.checkpoint import flip_storage_byte
from tests.helpers.dist import run_distributed
from tests.helpers.reliability import tiny_argv, write_dataset

TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _damage(kind, folder, target):
    """Damage a copy of a checkpoint (rank 0, before the case runs)."""
    path = os.path.join(folder, target)
    if kind == "remove":
        os.remove(path)
    elif kind == "flip":
        flip_storage_byte(path)
    elif kind == "evil":
        with open(path, "wb") as f:
            pickle.dump({"params": _Evil()}, f)
    elif kind == "tracker":
        with open(path, "wb") as f:
            f.write(b"\xff\xfe\x00\x81")


def _commands(cases):
    """Run ``pretrain_llama.command`` per case ``(name, argv, copy, damage)``: ``copy`` (src,
    dst) a checkpoint folder and ``damage`` (:func:`_damage` arguments) first, on rank 0.
    Returns ``{name: {status, stdout, stderr}}`` of this rank."""
    import torch.distributed as dist

    import pretrain_llama

    out = {}
    for name, argv, copy, damage, limit in cases:
        if dist.get_rank() == 0:
            if copy:
                shutil.copytree(*copy)
            if damage:
                _damage(*damage)
        dist.barrier()
        stdout, stderr = io.StringIO(), io.StringIO()
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        try:
            if limit:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                status = pretrain_llama.command(argv)
            error = None
        except Exception as exc:  # noqa: BLE001 - a crash (not a usage error) is what some test
            status, error = None, f"{type(exc).__name__}: {exc}"
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        out[name] = {"status": status, "stdout": stdout.getvalue(),
                     "stderr": stderr.getvalue(), "error": error}
        dist.barrier()
    return out


def _case(name, argv, copy=None, damage=None, limit=None):
    return (name, argv, copy, damage, limit)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("error_lines")
    data, cache = write_dataset(str(root / "text_document")), str(root / "cache")
    r = lambda *p: str(root.joinpath(*p))  # noqa: E731
    four = run_distributed(4, _commands, [
        _case("save tp2pp2", tiny_argv(data, cache, 2, "--save", r("tp2pp2"), *TP2PP2))],
        timeout=600)
    pp2, shard0, shard1 = r("pp2"), "iter_0000002/mp_rank_00_000", "iter_0000002/mp_rank_00_001"
    two = run_distributed(2, _commands, [
        _case("tp1pp2", tiny_argv(data, cache, 4, "--load", r("tp2pp2"), *PP2)),
        _case("save pp2", tiny_argv(data, cache, 2, "--save", pp2, *PP2,
                                    "--use-distributed-optimizer")),
        _case("missing shard", tiny_argv(data, cache, 2, "--load", r("missing"), *PP2,
                                         "--use-distributed-optimizer"),
              (pp2, r("missing")), ("remove", r("missing"), shard1 + "/model_optim_rng.pt")),
        _case("flipped byte", tiny_argv(data, cache, 2, "--load", r("flipped"), *PP2,
                                        "--use-distributed-optimizer"),
              (pp2, r("flipped")), ("flip", r("flipped"), shard0 + "/model_optim_rng.pt")),
        _case("refused pickle", tiny_argv(data, cache, 2, "--load", r("evil"), *PP2,
                                          "--use-distributed-optimizer"),
              (pp2, r("evil")), ("evil", r("evil"), shard1 + "/distrib_optim_dp_000.pt")),
        _case("other shape", tiny_argv(data, cache, 2, "--load", pp2, *PP2,
                                       "--use-distributed-optimizer", "--ffn-hidden-size", "96")),
        _case("more layers", tiny_argv(data, cache, 2, "--load", pp2, *PP2,
                                       "--use-distributed-optimizer", "--num-layers", "4")),
    ], timeout=900)
    one = run_distributed(1, _commands, [
        _case("tp1pp1", tiny_argv(data, cache, 4, "--load", r("tp2pp2"))),
        _case("undecodable tracker", tiny_argv(data, cache, 4, "--load", r("tracker")),
              (pp2, r("tracker")), ("tracker", r("tracker"), "latest_checkpointed_iteration.txt")),
    ], timeout=600)
    return {"four": four, "two": two, "one": one}, root


def _the_line(per_rank, case, prog="pretrain_llama.py"):
    """The one line the job printed for ``case``: every rank status 2, exactly one rank
    printed, one line; returns ``(reporting rank, message)``."""
    statuses = [r[case]["status"] for r in per_rank]
    assert statuses == [2] * len(per_rank), [(r[case]["status"], r[case]["error"],
                                             r[case]["stderr"][-2000:]) for r in per_rank]
    printed = [(rank, r[case]["stderr"]) for rank, r in enumerate(per_rank) if r[case]["stderr"]]
    assert len(printed) == 1, printed
    rank, text = printed[0]
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), text
    return rank, lines[0][len(f"{prog}: error: "):]


def _layout_line(load, tp, pp):
    out = f"{load}_tp{tp}pp{pp}"
    return (f"--load {load}: the checkpoint {load}/iter_0000002 was saved with --ckpt-format torch "
            "at --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2, but this run has "
            f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}, and a torch "
            "checkpoint loads only at its own layout: run at TP=2 x PP=2, or re-cut it with python "
            "tools/checkpoint/convert.py --loader megatron --saver megatron "
            f"--load-dir {load} --save-dir {out} --target-tensor-parallel-size {tp} "
            f"--target-pipeline-parallel-size {pp} --include-optimizer, then resume with --load "
            f"{out} --no-load-rng; save with --ckpt-format torch_dist to resume at any layout later "
            "(it reshards when loaded)")


@pytest.mark.parametrize("world, case, tp, pp", [("two", "tp1pp2", 1, 2), ("one", "tp1pp1", 1, 1)])
def test_a_legacy_checkpoint_at_another_layout_is_one_line_with_the_fix(runs, world, case, tp, pp):
    out, root = runs
    assert [r["save tp2pp2"]["status"] for r in out["four"]] == [0] * 4
    rank, line = _the_line(out[world], case)
    assert rank == 0 and line == _layout_line(str(root / "tp2pp2"), tp, pp)
    assert all("training ..." not in r[case]["stdout"] for r in out[world])


@pytest.mark.parametrize("case, reporter, pattern", [
    ("missing shard", 1, r"^checkpoint shard .*/iter_0000002/mp_rank_00_001/model_optim_rng\.pt "
                         r"does not exist; .* No other complete checkpoint is in"),
    ("flipped byte", 0, r"^cannot read checkpoint shard .*/mp_rank_00_000/model_optim_rng\.pt: "
                        r"record .* fails its CRC-32 check"),
    ("refused pickle", 1, r"^refused to load .*/mp_rank_00_001/distrib_optim_dp_000\.pt: its pickle "
                          r"asks for (posix|nt)\.system.*nothing in it ran"),
    ("other shape", 0, r"^checkpoint .*/mp_rank_00_000/model_optim_rng\.pt: tensor "
                       r"layers\.0\.mlp\.\S+ has shape \(\d+, \d+\) in the checkpoint but"),
    ("more layers", 0, r"^checkpoint .*/mp_rank_00_000/model_optim_rng\.pt does not fit the model: "
                       r"missing tensors \['layers\.1\."),
])
def test_every_load_error_is_one_line_from_one_rank_and_status_2_on_all(runs, case, reporter,
                                                                         pattern):
    out, _ = runs
    assert [r["save pp2"]["status"] for r in out["two"]] == [0, 0]
    rank, line = _the_line(out["two"], case)
    assert rank == reporter and re.search(pattern, line), (rank, line)
    assert "weights_only" not in line and "Traceback" not in line


def test_an_undecodable_tracker_file_is_named(runs):
    out, root = runs
    _, line = _the_line(out["one"], "undecodable tracker")
    tracker = root / "tracker" / "latest_checkpointed_iteration.txt"
    assert line.startswith(f"--load ({root / 'tracker'}): {tracker} must hold an iteration number "
                           "or 'release', found bytes that are not text (b'\\xff\\xfe\\x00\\x81'"
                           "...); write the iteration of a complete checkpoint there"), line


# The same damage through the tools ---------------------------------------------------------------

def _generate(argv):
    import tools.generate as generate

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        status = generate.command(argv)
    return status, stderr.getvalue()


def test_the_tools_say_a_damaged_checkpoint_in_one_line(runs, tmp_path):
    from tools.checkpoint.convert import command as convert

    out, root = runs
    flipped = str(root / "flipped")  # PP=2: read whole by the converter
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        status = convert(["--loader", "megatron", "--saver", "hf", "--load-dir", flipped,
                          "--save-dir", str(tmp_path / "hf")])
    lines = stderr.getvalue().splitlines()
    assert status == 2 and len(lines) == 1, stderr.getvalue()
    assert re.search(r"^convert\.py: error: .*mp_rank_00_000/model_optim_rng\.pt.* fails its "
                     r"CRC-32 check", lines[0]), lines[0]
    # generate at the checkpoint's layout (PP=2: two processes): one line from one rank
    results = run_distributed(2, _generate, ["--load", flipped, "--prompt", "1 2 3",
                                             "--max-new-tokens", "2"])
    assert [s for s, _ in results] == [2, 2], results
    printed = [e for _, e in results if e]
    assert len(printed) == 1 and len(printed[0].splitlines()) == 1, results
    assert re.search(r"^generate\.py: error: cannot read checkpoint shard .*mp_rank_00_000/"
                     r"model_optim_rng\.pt: record .* fails its CRC-32 check", printed[0]), printed
    # and at another layout than the checkpoint's (one process for PP=2): its own line
    pp2 = str(root / "pp2")
    (status, error), = run_distributed(1, _generate, ["--load", pp2, "--prompt", "1"])
    assert status == 2 and error == (
        f"generate.py: error: the checkpoint in --load {pp2} is cut for tensor-parallel size 1 "
        "x pipeline-parallel size 2 and needs 2 processes (or a multiple); this run has 1. Launch "
        f"it with torchrun: torchrun --nproc-per-node 2 tools/generate.py --load {pp2} ..., "
        "or reshard it for one process first: python tools/checkpoint/convert.py --loader "
        f"megatron --saver megatron --load-dir {pp2} --save-dir {pp2}_tp1pp1 "
        "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1\n"), error


def _resume(argv):
    import pretrain_llama

    return pretrain_llama.main(argv)["iteration"]


@pytest.mark.slow
def test_following_the_layout_line_resumes(runs):
    """The converter command of the TP=1 x PP=2 line, run as printed, then the resume it names:
    training goes on from iteration 3 at the new layout."""
    import shlex

    from tools.checkpoint.convert import main as convert

    out, root = runs
    _, line = _the_line(out["two"], "tp1pp2")
    command = re.search(r"re-cut it with python (tools/checkpoint/convert\.py .*?), then resume "
                        r"with (.*?); save with", line)
    argv = shlex.split(command.group(1))[1:]
    with contextlib.redirect_stdout(io.StringIO()):
        convert(argv)
    data, cache = str(root / "text_document"), str(root / "cache")
    resume = shlex.split(command.group(2))
    # training on to 4 iterations: the schedule grows with it (docs/troubleshooting.md)
    iterations = run_distributed(2, _resume, tiny_argv(data, cache, 4, *PP2, *resume,
                                                       "--override-opt_param-scheduler"),
                                 timeout=600)
    assert iterations[0] == [3, 4], iterations

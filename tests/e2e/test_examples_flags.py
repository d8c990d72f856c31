"""Every launch script in examples/ passes flags that parse and validate.

Each script runs for real under bash, with fake ``torchrun``, ``srun``, ``scontrol`` and ``python``
on PATH that record the command line instead of starting anything; the recorded
``pretrain_llama.py`` arguments then go through ``parse_args`` and ``validate_args`` with the world
size the launcher would create (``--nnodes`` x ``--nproc_per_node``). Data and tokenizer paths point
at placeholder files, so the file checks run too.
"""

import glob
import os
import re
import stat
import subprocess

import pytest

from megatron.arguments import parse_args, report_ignored_flags, validate_args

from tests.helpers.paths import ROOT
SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "*.sh"))
                 if not os.path.basename(p).startswith("_"))  # _*.sh are sourced helpers

# Records its argv as NUL-separated words ending in a \x01 word; as srun it runs the command after
# srun's own options; as python it records only torch.distributed.run and succeeds otherwise.
_FAKE = r"""#!/bin/bash
name=$(basename "$0")
case "$name" in
    scontrol) printf 'node001\nnode002\n'; exit 0 ;;
    srun) while [[ "${1:-}" == -* ]]; do shift; done; exec "$@" ;;
    python) [[ "${1:-} ${2:-}" == "-m torch.distributed.run" ]] || exit 0 ;;
esac
{ printf '%s\0' "$name" "$@"; printf '\1\0'; } >> "$CAPTURE_FILE"
"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "srun", "scontrol", "python"):
        path = bin_dir / name
        path.write_text(_FAKE)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    data = root / "data"
    data.mkdir()
    files = {}
    for prefix in ("corpus_text_document", "shakespeare_text_document"):
        for ext in (".bin", ".idx"):
            (data / (prefix + ext)).write_bytes(b"")
    for name in ("tokenizer.model", "tokenizer.model.v1", "shakespeare_plays.jsonl"):
        (data / name).write_bytes(b"")
    (root / "llama3_tokenizer").mkdir()
    files.update(bin=str(bin_dir), data=str(data), root=str(root))
    return files


def _env(sandbox, script, capture):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PATH=sandbox["bin"] + os.pathsep + env["PATH"], CAPTURE_FILE=capture,
               DATA_PATH=os.path.join(sandbox["data"], "corpus_text_document"),
               TOKENIZER_MODEL=os.path.join(sandbox["data"], "tokenizer.model"),
               TOKENIZER_DIR=os.path.join(sandbox["root"], "llama3_tokenizer"),
               CHECKPOINT_DIR=os.path.join(sandbox["root"], "ckpt"),
               TENSORBOARD_DIR=os.path.join(sandbox["root"], "tb"),
               CACHE_DIR=sandbox["root"], OUT_DIR=os.path.join(sandbox["root"], "out"),
               PYTHON=os.path.join(sandbox["bin"], "python"))
    text = open(script).read()
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", text, re.M)
    if nodes:  # what sbatch would set inside the allocation
        env.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES=nodes.group(1),
                   SLURM_JOB_NODELIST=f"node[001-{int(nodes.group(1)):03d}]",
                   SLURM_SUBMIT_DIR=ROOT)
    return env


def _option(argv, *names, default):
    for i, a in enumerate(argv):
        for name in names:
            if a == name:
                return argv[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
    return default


def _launches(sandbox, script, tmp_path):
    capture = str(tmp_path / "capture.jsonl")
    proc = subprocess.run(["bash", script], env=_env(sandbox, script, capture), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    with open(capture, "rb") as f:
        words = [w.decode() for w in f.read().split(b"\0")[:-1]]
    launches, current = [], []
    for w in words:
        if w == "\x01":
            launches.append(current)
            current = []
        else:
            current.append(w)
    return launches


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_example_flags_parse_and_validate(sandbox, script, tmp_path):
    # The CPU demo also starts tools/generate.py after training; only training launches count.
    launches = [argv for argv in _launches(sandbox, script, tmp_path)
                if any(a.endswith("pretrain_llama.py") for a in argv)]
    assert len(launches) == 1, f"{script} should start pretrain_llama.py once"
    argv = launches[0]
    entry = next(i for i, a in enumerate(argv) if a.endswith("pretrain_llama.py"))
    launcher, flags = argv[:entry], argv[entry + 1:]
    nproc = int(_option(launcher, "--nproc_per_node", "--nproc-per-node", default="1"))
    nnodes = int(_option(launcher, "--nnodes", default="1").split(":")[-1])
    args = validate_args(parse_args(flags), nproc * nnodes)
    assert args.data_parallel_size >= 1
    if os.path.basename(script) != "pretrain_llama_cpu_demo.sh":
        assert args.bf16 and args.untie_embeddings_and_output_weights
        assert "--rdzv_backend" in launcher and _option(launcher, "--rdzv_backend",
                                                        default="") == "c10d"
        # Megatron-LLaMA's --data-impl mmap is accepted and reported once as having no effect.
        assert any(m.startswith("--data-impl") for m in report_ignored_flags(args))


def test_slurm_and_torchrun_variants_exist():
    names = {os.path.basename(p) for p in SCRIPTS}
    for model in ("llama2_7b", "llama2_13b", "llama2_70b", "llama3_8b"):
        assert f"pretrain_{model}.sh" in names and f"pretrain_{model}_slurm.sh" in names

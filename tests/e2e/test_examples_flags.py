"""Every launch script in examples/ passes flags that parse and validate.

Each script runs for real under bash, with fake ``torchrun``, ``srun``, ``scontrol`` and ``python``
on PATH that record the command line instead of starting anything; the recorded
``pretrain_llama.py`` arguments then go through ``parse_args`` and ``validate_args`` with the world
size the launcher would create (``--nnodes`` x ``--nproc_per_node``). Data and tokenizer paths point
at placeholder files (a dataset whose .idx is real and .bin sparse), so the file checks run too.
"""

import glob
import os
import re
import socket
import stat
import subprocess

import pytest

from megatron.arguments import parse_args, report_ignored_flags, validate_args

from tests.helpers.data import placeholder_dataset
from tests.helpers.paths import ROOT
# The pretraining recipes and demo (_*.sh are sourced helpers; the SFT demo launches
# finetune_llama.py and has its own test below).
SFT_DEMO = os.path.join(ROOT, "examples", "sft_llama_cpu_demo.sh")
SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "examples", "*.sh"))
                 if not os.path.basename(p).startswith("_") and p != SFT_DEMO)

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
        # Enough tokens for every split of --split 969,30,1 at --seq-length 32768 (a sparse .bin).
        placeholder_dataset(str(data / prefix), num_docs=1000, tokens_per_doc=33000)
    (data / "chat").mkdir()
    for prefix in ("sft_text_document", "dpo_chosen_document", "dpo_rejected_document"):
        placeholder_dataset(str(data / "chat" / prefix), num_docs=1000, tokens_per_doc=300)
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
    if re.search(r"^NNODES=\$\{NNODES:-([2-9]|\d\d+)\}", text, re.M):  # multi-node by default
        env.update(MASTER_ADDR="node001")
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


def _launches(sandbox, script, tmp_path, **env):
    capture = str(tmp_path / "capture.jsonl")
    proc = subprocess.run(["bash", script], env=dict(_env(sandbox, script, capture), **env),
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
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
        # Megatron-LLaMA's --data-impl mmap is accepted and reported once as having no effect.
        assert any(m.startswith("--data-impl") for m in report_ignored_flags(args))
    if script.endswith("_slurm.sh"):  # c10d on the first node, on a port derived from the job id
        assert _option(launcher, "--rdzv_backend", default="") == "c10d"
        assert _option(launcher, "--rdzv_endpoint", default="") == f"node001:{10000 + 4242}"
    elif nnodes > 1:  # plain multi-node: the c10d rendezvous on MASTER_ADDR
        assert _option(launcher, "--rdzv_endpoint", default="") == "node001:29500"
    else:  # one node: a free port and a rendezvous of its own, never another job's
        assert "--standalone" in launcher and "--rdzv_endpoint" not in launcher


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _run_script(sandbox, script, tmp_path, **env):
    capture = str(tmp_path / "capture.jsonl")
    full = dict(_env(sandbox, script, capture), **env)
    proc = subprocess.run(["bash", script], env=full, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=60)
    return proc, open(capture).read() if os.path.exists(capture) else ""


def test_multi_node_first_node_hosts_the_rendezvous_or_names_master_port(sandbox, tmp_path,
                                                                         taken_port):
    script = os.path.join(ROOT, "examples", "pretrain_llama2_7b.sh")
    common = dict(NNODES="2", MASTER_ADDR="127.0.0.1")
    proc, launched = _run_script(sandbox, script, tmp_path, NODE_RANK="0",
                                 MASTER_PORT=str(taken_port), **common)
    assert proc.returncode == 2 and not launched, proc.stderr
    assert f"MASTER_PORT={taken_port} is already in use on this machine" in proc.stderr
    for rank, is_host in (("0", "1"), ("1", "0")):
        launches = _launches(sandbox, script, tmp_path, NODE_RANK=rank, **common)
        launcher = launches[0][:next(i for i, a in enumerate(launches[0])
                                     if a.endswith("pretrain_llama.py"))]
        assert _option(launcher, "--rdzv_conf", default="") == f"is_host={is_host}"
        assert _option(launcher, "--rdzv_endpoint", default="") == "127.0.0.1:29500"
        os.remove(tmp_path / "capture.jsonl")


def test_demo_with_a_taken_master_port_stops_naming_it(sandbox, tmp_path, taken_port):
    script = os.path.join(ROOT, "examples", "pretrain_llama_cpu_demo.sh")
    proc, launched = _run_script(sandbox, script, tmp_path, MASTER_PORT=str(taken_port))
    assert proc.returncode == 2 and "pretrain_llama.py" not in launched, proc.stderr
    assert f"MASTER_PORT={taken_port}: port {taken_port} is already in use" in proc.stderr
    # without MASTER_PORT both of its launches (training, sample) are --standalone
    launches = _launches(sandbox, script, tmp_path)
    assert len(launches) == 2 and all("--standalone" in argv for argv in launches)


# The demo's settings: (least value, the example its line gives)
DEMO_SETTINGS = {"ITERS": (1, 300), "EVAL_INTERVAL": (1, 50), "NPROC": (4, 4),
                 "LR_DECAY_ITERS": (1, 300), "SAVE_INTERVAL": (1, 100)}


@pytest.mark.parametrize("setting", ["SAVE_INTERVAL=0", "SAVE_INTERVAL=abc", "ITERS=-5",
                                     "EVAL_INTERVAL=1.5", "NPROC=2", "LR_DECAY_ITERS=3e2"])
def test_demo_settings_that_are_no_whole_number_stop_in_one_line(sandbox, tmp_path, setting):
    """Before anything is installed or launched: one line naming the setting, exit 2 (before, a
    bad SAVE_INTERVAL reached pretrain_llama.py on every rank and torchrun's traceback)."""
    name, value = setting.split("=")
    least, example = DEMO_SETTINGS[name]
    script = os.path.join(ROOT, "examples", "pretrain_llama_cpu_demo.sh")
    out = tmp_path / "out"
    proc, launched = _run_script(sandbox, script, tmp_path, OUT_DIR=str(out), **{name: value})
    assert proc.returncode == 2 and not launched and not out.exists(), proc.stderr
    assert proc.stderr.splitlines() == [
        f"pretrain_llama_cpu_demo.sh: {name} ({value}) must be a whole number of at least "
        f"{least}, e.g. {name}={example}"]


def test_slurm_and_torchrun_variants_exist():
    names = {os.path.basename(p) for p in SCRIPTS}
    for model in ("llama2_7b", "llama2_13b", "llama2_70b", "llama3_8b"):
        assert f"pretrain_{model}.sh" in names and f"pretrain_{model}_slurm.sh" in names


def test_sft_demo_flags_parse_and_validate(sandbox, tmp_path):
    launches = [argv for argv in _launches(sandbox, SFT_DEMO, tmp_path)
                if any(a.endswith("finetune_llama.py") for a in argv)]
    assert len(launches) == 2, "the SFT demo should start finetune_llama.py twice: SFT, then DPO"
    from finetune_llama import SFT
    from megatron.training.dpo import DPO_SECTION
    from megatron.training.reward_model import REWARD_SECTION

    def provider(parser):
        for section in (SFT, DPO_SECTION, REWARD_SECTION):
            parser = section.add_arguments(parser)
        return parser

    parsed = []
    for argv in launches:
        entry = next(i for i, a in enumerate(argv) if a.endswith("finetune_llama.py"))
        launcher, flags = argv[:entry], argv[entry + 1:]
        args = parse_args(flags, extra_args_provider=provider)
        if args.load:  # DPO loads the SFT stage's --save, which this sandbox never trains
            os.makedirs(args.load, exist_ok=True)
        parsed.append(validate_args(args, int(_option(launcher, "--nproc-per-node", default="1"))))
        assert "--standalone" in launcher
    sft, dpo = parsed
    assert sft.sft_packing and sft.tensor_model_parallel_size == 2 and not sft.dpo
    assert dpo.dpo and dpo.finetune and dpo.load == sft.save

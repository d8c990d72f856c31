"""Nothing from an input is executed (issue 13): every entry point that reads a HuggingFace folder
(tools/preprocess_data.py, pretrain_llama.py, tools/generate.py, tools/checkpoint/convert.py)
refuses a folder that ships code, with standard input connected to a pipe that says "y" (which
transformers' "run the custom code? [y/N]" prompt would take as consent). Each process must fail
naming the folder and the file that asks for code, leave the pipe unread, and the folder's code
(which would create a marker file) must never run."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.convert import make_hf
from tests.helpers.paths import ROOT
from tests.helpers.reliability import tiny_argv, write_dataset

_EVIL = """import os
open({marker!r}, "w").write("the folder's code ran")
from transformers import PreTrainedTokenizerFast as EvilTokenizer
"""


def _add_custom_code(folder, marker, config="tokenizer_config.json"):
    """Make ``folder`` ask for its own code: an ``auto_map`` in ``config`` naming evil.py, which
    writes ``marker`` when imported. No tokenizer.json, so transformers' AutoTokenizer would be
    the one to read the folder."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, config)
    settings = json.load(open(path)) if os.path.exists(path) else {}
    settings.update(auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]},
                    tokenizer_class="EvilTokenizer")
    with open(path, "w") as f:
        json.dump(settings, f)
    with open(os.path.join(folder, "evil.py"), "w") as f:
        f.write(_EVIL.format(marker=marker))
    return str(folder)


def _start_with_yes(argv):
    """Start ``argv`` with a pipe holding "y" lines as standard input; the caller keeps a copy of
    the pipe's reading end to see afterwards whether the process read it."""
    read_end, write_end = os.pipe()
    os.write(write_end, b"y\ny\n")
    os.close(write_end)
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("RANK", None)
    proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT, stdin=read_end,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc, read_end


def _unread(read_end) -> bytes:
    os.set_blocking(read_end, False)
    try:
        return os.read(read_end, 64)
    except BlockingIOError:
        return b""
    finally:
        os.close(read_end)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """``{case: (argv, folder, file asking for code, flag, marker)}`` for every entry point."""
    root = tmp_path_factory.mktemp("hostile")
    marker = lambda case: str(root / f"ran_{case}")  # noqa: E731
    out = {}
    tok = lambda case: _add_custom_code(str(root / f"tok_{case}"), marker(case))  # noqa: E731
    hf_tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path"]

    jsonl = root / "docs.jsonl"
    jsonl.write_text('{"text": "hello"}\n')
    out["preprocess_data"] = ([os.path.join("tools", "preprocess_data.py"), "--input", jsonl,
                               "--output-prefix", root / "pre", "--workers", "1", *hf_tok,
                               tok("preprocess_data")], "--tokenizer-name-or-path")

    data = write_dataset(str(root / "text_document"))
    argv = tiny_argv(data, str(root / "cache"))
    at = argv.index("--tokenizer-type")
    argv[at:at + 4] = [*hf_tok, tok("pretrain_llama")]  # drop NullTokenizer and --vocab-size
    out["pretrain_llama"] = (["pretrain_llama.py", *argv], "--tokenizer-name-or-path")

    ckpt = root / "ckpt"  # a checkpoint whose saved args name the hostile tokenizer folder
    (ckpt / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    torch.save({"args": {"tokenizer_type": "HuggingFaceTokenizer",
                         "tokenizer_name_or_path": tok("generate")}, "iteration": 1},
               ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    out["generate"] = ([os.path.join("tools", "generate.py"), "--load", ckpt, "--prompt", "x"],
                       "--tokenizer-name-or-path")

    convert = [os.path.join("tools", "checkpoint", "convert.py"), "--loader", "hf"]
    for case, config in (("convert_tokenizer_files", "tokenizer_config.json"),
                         ("convert_config", "config.json")):
        model = str(root / case)
        make_hf(model)  # a clean LLaMA; then its tokenizer files (or config.json) ask for code
        _add_custom_code(model, marker(case), config)
        out[case] = ([*convert, "--saver", "megatron", "--load-dir", model, "--save-dir",
                      root / f"out_{case}"], "--load-dir")
    clean = str(root / "clean_hf")
    make_hf(clean)
    out["convert_tokenizer_dir"] = ([*convert, "--saver", "hf", "--load-dir", clean, "--save-dir",
                                     root / "out_tokenizer_dir", "--tokenizer-dir",
                                     tok("convert_tokenizer_dir")], "--tokenizer-dir")
    return {case: (argv, argv[argv.index(flag) + 1] if flag in argv else None, flag,
                   marker(case)) for case, (argv, flag) in out.items()}


def test_every_entry_point_refuses_custom_code_without_reading_stdin(cases):
    started = {case: _start_with_yes(argv) for case, (argv, *_) in cases.items()}
    for case, (proc, read_end) in started.items():
        _, err = proc.communicate(timeout=300)
        left = _unread(read_end)
        argv, folder, flag, marker = cases[case]
        if case == "generate":
            folder = os.path.join(os.path.dirname(marker), "tok_generate")
        asks = "config.json" if case == "convert_config" else "tokenizer_config.json"
        assert not os.path.exists(marker), case  # the folder's code never ran
        assert left == b"y\ny\n", (case, left)  # standard input untouched
        assert proc.returncode not in (0, None), (case, err)
        assert (f"{flag} {folder}: {os.path.join(folder, asks)} asks to run code from the folder "
                "(auto_map: ") in err, (case, err[-2000:])
    root = os.path.dirname(cases["preprocess_data"][3])
    assert not [f for f in os.listdir(root) if f.startswith(("pre_", "out_"))]  # nothing written


def test_converter_refuses_index_entries_outside_the_model_folder(tmp_path):
    """A model.safetensors.index.json whose entry points at a shard outside the folder (here a
    copy of a real one, so only the location is wrong) is refused naming the index and entry."""
    import shutil

    from safetensors import safe_open

    from tests.helpers.convert import convert

    model = str(tmp_path / "hf")
    make_hf(model)
    os.makedirs(tmp_path / "outside")
    shutil.copy(os.path.join(model, "model.safetensors"), tmp_path / "outside")
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    entries = {name: "model.safetensors" for name in names}
    entries["model.norm.weight"] = "../outside/model.safetensors"
    index = os.path.join(model, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": entries}, f)
    with pytest.raises(ValueError) as err:
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", model, "--save-dir",
                tmp_path / "out")
    assert str(err.value).startswith(f"{index}: weight_map entry 'model.norm.weight': "
                                     "'../outside/model.safetensors' is a path outside")
    assert not os.path.exists(tmp_path / "out" / "latest_checkpointed_iteration.txt")

"""tools/preprocess_sft_data.py end to end: formats, masks written as aligned .bin/.idx, skipped
conversations reported, preference pairs, workers, usage errors (exit 2).

Oracle: the chat tokenizer's own ``encode`` of each conversation (itself tested against
transformers' generation mask in tests/unit/data/test_chat_templates.py).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.chat_templates import HFChatTokenizer, SentencePieceChatTokenizer, to_messages
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.sft_dataset import SFTDataset
from tests.helpers.cli import run_main
from tests.unit.data.test_chat_templates import CHATML, SP_MODEL, _tiny_hf_folder

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
TOOL = os.path.join(ROOT, "tools", "preprocess_sft_data.py")

LINES = [
    {"messages": [{"role": "system", "content": "be brief ."}, {"role": "user", "content": "hi there"},
                  {"role": "assistant", "content": "hello friend"}, {"role": "user", "content": "bye now"},
                  {"role": "assistant", "content": "goodbye friend"}]},
    {"conversations": [{"from": "human", "value": "what is 2 + 2 ?"}, {"from": "gpt", "value": "4"}]},
    {"instruction": "what is", "input": "2 + 2", "output": "4"},
    {"messages": [{"role": "user", "content": "hi there"}]},            # line 4: empty mask
    {"messages": [{"role": "assistant", "content": "hello"}]},           # line 5: all-ones mask
]


def _run(*args, subprocess_run=False):
    """The tool on ``args``: in this process (fast; the tokenizer libraries are loaded once), or as
    a command when its exit status and stderr are what the test checks."""
    if subprocess_run:
        return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=600)
    from tools import preprocess_sft_data

    return run_main(preprocess_sft_data.cli, args)


def _write_jsonl(path, objs, extra=""):
    with open(path, "w") as f:
        for o in objs:
            f.write(json.dumps(o) + "\n")
        f.write(extra)
    return str(path)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return _tiny_hf_folder(tmp_path_factory.mktemp("tok") / "tok", CHATML)


def _read(prefix):
    t, m = MMapIndexedDataset(prefix + "_document"), MMapIndexedDataset(prefix + "_loss_mask_document")
    return [t[i].tolist() for i in range(len(t))], [m[i].tolist() for i in range(len(m))], t, m


@pytest.mark.parametrize("workers", [1, 2])
def test_formats_masks_and_report(tmp_path, hf_folder, workers):
    src = _write_jsonl(tmp_path / "in.jsonl", LINES)
    out = _run("--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-name-or-path", hf_folder, "--workers", str(workers))
    assert out.returncode == 0, out.stderr
    assert "empty loss mask (no assistant token): lines 4" in out.stdout
    assert "all-ones loss mask (no prompt): lines 5" in out.stdout
    ids, masks, t, m = _read(str(tmp_path / "o_text"))
    assert m.dtype == np.uint8 and np.array_equal(t.document_indices, m.document_indices)
    chat = HFChatTokenizer(hf_folder)
    for k, obj in enumerate(LINES[:3]):
        want_ids, want_mask = chat.encode(to_messages(obj))
        assert ids[k] == want_ids.tolist() and masks[k] == want_mask.tolist()
    report = json.loads((tmp_path / "o_report.json").read_text())
    assert report["conversations"] == 3 and report["skipped"] == {"invalid": [], "empty_mask": [4],
                                                                  "all_ones_mask": [5], "prompt_mismatch": [],
                                                                  "same_response": []}
    assert report["loss_tokens"] == [sum(map(sum, masks))]
    # The SFT dataset reads the pair back.
    ds = SFTDataset(str(tmp_path / "o_text_document"), 64, packed=False, shuffle=False)
    assert ds[0]["loss_mask"].sum() == sum(masks[0][1:])


def test_gzip_input_equals_plain(tmp_path, hf_folder):
    import gzip

    plain = _write_jsonl(tmp_path / "in.jsonl", LINES[:3])
    with open(plain, "rb") as f, gzip.open(tmp_path / "in.jsonl.gz", "wb") as g:
        g.write(f.read())
    for name in ("in.jsonl", "in.jsonl.gz"):
        out = _run("--input", str(tmp_path / name), "--output-prefix", str(tmp_path / name.replace(".", "_")),
                   "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path", hf_folder)
        assert out.returncode == 0, out.stderr
    for suffix in ("_text_document.bin", "_text_loss_mask_document.bin"):
        assert (tmp_path / f"in_jsonl{suffix}").read_bytes() == (tmp_path / f"in_jsonl_gz{suffix}").read_bytes()


def test_invalid_lines_stop_or_are_skipped(tmp_path, hf_folder):
    src = _write_jsonl(tmp_path / "in.jsonl", LINES[:2], extra='{"text": "no chat"}\nnot json\n')
    flags = ["--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-name-or-path", hf_folder]
    out = _run(*flags)
    assert out.returncode == 2 and "in.jsonl:3" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "o_text_document.idx")
    out = _run(*flags, "--skip-invalid")
    assert out.returncode == 0, out.stderr
    assert "not conversations (--skip-invalid): lines 3, 4" in out.stdout


def test_preference_pairs_aligned(tmp_path, hf_folder):
    pairs = [{"prompt": "hi there", "chosen": "hello friend", "rejected": "bye now"},
             {"prompt": [{"role": "system", "content": "be brief ."}, {"role": "user", "content": "what is 2 + 2 ?"}],
              "chosen": [{"role": "assistant", "content": "4"}], "rejected": "2"}]
    # Line 3: whole conversations whose prompts differ -- not a preference pair.
    other = {"chosen": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}],
             "rejected": [{"role": "user", "content": "bye now"}, {"role": "assistant", "content": "hello"}]}
    src = _write_jsonl(tmp_path / "p.jsonl", pairs + [other])
    out = _run("--input", src, "--output-prefix", str(tmp_path / "p"), "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-name-or-path", hf_folder, "--preference-pairs")
    assert out.returncode == 0, out.stderr
    assert "chosen and rejected prompts tokenize differently: lines 3" in out.stdout
    chat = HFChatTokenizer(hf_folder)
    tok = chat.tok
    for side in ("chosen", "rejected"):
        ids, masks, _, _ = _read(str(tmp_path / f"p_{side}"))
        assert len(ids) == 2
        for k, pair in enumerate(pairs):
            masked = "".join(tok.convert_ids_to_tokens([i for i, m in zip(ids[k], masks[k]) if m]))
            reply = pair[side] if isinstance(pair[side], str) else pair[side][0]["content"]
            assert masked == reply + "<|im_end|>\n"


@pytest.mark.parametrize("flags, match, subprocess_run", [
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "missing.model", "--chat-template", "llama2"],
     "missing.model", True),  # the command's own exit status and one line
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"], "chat template", False),
])
def test_usage_errors_one_line(tmp_path, flags, match, subprocess_run):
    src = _write_jsonl(tmp_path / "in.jsonl", LINES[:1])
    out = _run("--input", src, "--output-prefix", str(tmp_path / "o"), *flags, subprocess_run=subprocess_run)
    assert out.returncode == 2 and match in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not os.path.isfile(SP_MODEL), reason=f"{SP_MODEL} is not present on this machine")
def test_sentencepiece_llama2(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", LINES[:3])
    out = _run("--input", src, "--output-prefix", str(tmp_path / "s"), "--tokenizer-type", "Llama2Tokenizer",
               "--tokenizer-model", SP_MODEL, "--chat-template", "llama2")
    assert out.returncode == 0, out.stderr
    ids, masks, t, _ = _read(str(tmp_path / "s_text"))
    assert t.dtype == np.uint16
    chat = SentencePieceChatTokenizer(SP_MODEL, "llama2")
    for k, obj in enumerate(LINES[:3]):
        want_ids, want_mask = chat.encode(to_messages(obj))
        assert ids[k] == want_ids.tolist() and masks[k] == want_mask.tolist()


def test_example_conversations_from_a_wheel(tmp_path):
    """tools/make_example_conversations.py on a wheel-shaped zip of chatterbot-corpus YAML."""
    import zipfile

    wheel = tmp_path / "chatterbot_corpus-1.2.0-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("chatterbot_corpus/data/english/ai.yml",
                   "categories:\n- AI\nconversations:\n- - What is AI?\n  - A field.\n"
                   "- - Are you sentient?\n  - Sort of.\n  - Really?\n- - lonely\n")
        z.writestr("chatterbot_corpus/data/english/food.yml",
                   "conversations:\n- - Do you eat?\n  - Only electricity.\n")
    tool = os.path.join(ROOT, "tools", "make_example_conversations.py")
    outs = []
    for run in range(2):
        out = subprocess.run([sys.executable, tool, "--wheel", str(wheel), "--output-dir", str(tmp_path / f"o{run}")],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr
        outs.append([(tmp_path / f"o{run}" / n).read_text() for n in ("conversations.jsonl", "preferences.jsonl")])
    assert outs[0] == outs[1]  # deterministic
    convs = [json.loads(x) for x in outs[0][0].splitlines()]
    assert len(convs) == 3  # the one-utterance dialog is dropped
    assert [m["role"] for m in convs[1]["messages"]] == ["system", "user", "assistant"]  # odd length trimmed
    assert convs[0]["messages"][1:] == [{"role": "user", "content": "What is AI?"},
                                        {"role": "assistant", "content": "A field."}]
    prefs = [json.loads(x) for x in outs[0][1].splitlines()]
    assert prefs[2] == {"prompt": "Do you eat?", "chosen": "Only electricity.", "rejected": prefs[2]["rejected"]}
    assert prefs[2]["rejected"] in ("A field.", "Sort of.")  # another topic's reply
    bad = subprocess.run([sys.executable, tool, "--wheel", str(tmp_path / "none.whl"), "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "none.whl" in bad.stderr


def test_a_pair_whose_chosen_equals_rejected_is_skipped(tmp_path, hf_folder):
    """Identical sides give the DPO loss log 2 and no gradient: never trained on silently."""
    pairs = [{"prompt": "hi there", "chosen": "hello friend", "rejected": "bye now"},
             {"prompt": "hi there", "chosen": "same", "rejected": "same"}]
    src = _write_jsonl(tmp_path / "p.jsonl", pairs)
    out = _run("--input", src, "--output-prefix", str(tmp_path / "p"), "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-name-or-path", hf_folder, "--preference-pairs")
    assert out.returncode == 0, out.stderr
    assert "whose chosen and rejected responses are the same: lines 2" in out.stdout
    report = json.loads((tmp_path / "p_report.json").read_text())
    assert report["conversations"] == 1 and report["skipped"]["same_response"] == [2]
    assert len(_read(str(tmp_path / "p_chosen"))[0]) == 1


def test_a_line_that_is_not_utf8_is_invalid_not_replaced(tmp_path, hf_folder):
    """Bytes that are not UTF-8 used to become U+FFFD inside the trained text."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(json.dumps(LINES[0]).encode() + b"\n"
                    + b'{"messages": [{"role": "user", "content": "h\xff\xfei"}, '
                      b'{"role": "assistant", "content": "ok"}]}\n')
    flags = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
             "HuggingFaceTokenizer", "--tokenizer-name-or-path", hf_folder]
    out = _run(*flags)
    assert out.returncode == 2 and "in.jsonl:2" in out.stderr and "UTF-8" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = _run(*flags, "--skip-invalid")
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "o_report.json").read_text())
    assert report["conversations"] == 1 and report["skipped"]["invalid"] == [2]


# ---------------------------------------------------------------- a worker killed or stopped
_FAULTY_WORKER = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import megatron.data.worker_pool as worker_pool
import tools.preprocess_sft_data as sft
sft.LINES_PER_CHUNK = 4
worker_pool.STOPPED_LIMIT_S = 3.0
mode, real = sys.argv[2], sft.encode_chunk
def encode(path, first_line, lines):  # runs in a forked worker, which inherits this module
    if first_line >= 9:
        os.kill(os.getpid(), signal.SIGKILL if mode == "die" else signal.SIGSTOP)
    return real(path, first_line, lines)
sft.encode_chunk = encode
sys.exit(sft.cli(sys.argv[3:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("mode", ["die", "stop"])
def test_a_killed_or_stopped_worker_stops_the_run_in_one_line(tmp_path, hf_folder, mode):
    """Before: multiprocessing.Pool waited forever for the chunk of a SIGKILLed worker (and both
    pools for a SIGSTOPped one), leaving temporaries and an orphaned worker."""
    import re
    import signal

    src = _write_jsonl(tmp_path / "in.jsonl", LINES[:3] * 8)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAULTY_WORKER, ROOT, mode, "--input", src, "--output-prefix",
         str(out / "o"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path",
         hf_folder, "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"preprocess_sft_data.py hung on a {mode} worker")
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    what = "was killed by SIGKILL" if mode == "die" else r"has been stopped \(SIGSTOP"
    assert len(lines) == 1 and re.match(
        rf"preprocess_sft_data.py: error: tokenizer worker \(pid \d+\) {what}.*no output written", lines[0]), err
    assert os.listdir(out) == []  # neither a .bin/.idx pair nor a temporary
    from tests.e2e.tools.test_preprocess_data import _processes_naming

    assert not _processes_naming(str(out)), "a tokenizer worker outlived the run"


_SIGNALLED_RUN = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from megatron.data import indexed_dataset as ix
import tools.preprocess_sft_data as sft
sig, calls, add = getattr(signal, sys.argv[2]), [0], ix.MMapIndexedDatasetBuilder.add_document
def trapped(*a, **k):
    calls[0] += 1
    if calls[0] == 3:  # the text and mask builders of the first conversation have written
        os.kill(os.getpid(), sig)
    return add(*a, **k)
ix.MMapIndexedDatasetBuilder.add_document = trapped
sys.exit(sft.cli(sys.argv[3:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_leaves_one_line_and_no_temporaries(tmp_path, hf_folder, sig):
    """Before: SIGTERM killed the tool where it stood (``.bin.tmp-PID`` files left), Ctrl-C printed
    a KeyboardInterrupt traceback. Now both unwind through the builders' abort, with workers."""
    import signal

    from tests.helpers.reliability import ctrl_c_default

    src = _write_jsonl(tmp_path / "in.jsonl", LINES[:3] * 8)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _SIGNALLED_RUN, ROOT, sig, "--input", src, "--output-prefix",
         str(out / "o"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path",
         hf_folder, "--workers", "2"], capture_output=True, text=True, cwd=ROOT, timeout=300,
        preexec_fn=ctrl_c_default)
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"preprocess_sft_data.py: stopped by {sig}: no partial output is left (earlier outputs "
        "under the same names are as they were); run it again to write the output"], proc.stderr
    assert os.listdir(out) == []


_LIMITED_RUN = """
import sys
sys.path.insert(0, sys.argv[1])
from megatron.data import chat_templates
chat_templates.RENDER_LIMIT_S = 1.0  # the workers fork after this: they keep it
import tools.preprocess_sft_data as sft
sys.exit(sft.cli(sys.argv[2:]))
"""


@pytest.mark.parametrize("template, why", [
    ("{{ '\\ud800' }}" + CHATML, "the chat template renders a lone surrogate ('\\ud800')"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHATML,
     "the chat template ran over 1 s on one conversation"),
])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_template_that_renders_no_text_or_never_ends_is_named(tmp_path, template, why, workers):
    """The fourth hostile pass: a template emitting a lone surrogate gave a 32-line TypeError
    traceback from the tokenizer; nested loops of 10^10 steps ran without end."""
    folder = _tiny_hf_folder(tmp_path / "tok", template)
    src = _write_jsonl(tmp_path / "in.jsonl", LINES[:3])
    proc = subprocess.run(
        [sys.executable, "-c", _LIMITED_RUN, ROOT, "--input", src, "--output-prefix",
         str(tmp_path / "o"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path",
         folder, "--workers", str(workers)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"preprocess_sft_data.py: error: --tokenizer-name-or-path {folder}: ")
    assert why in lines[0], lines[0]
    assert not list(tmp_path.glob("o_*"))


def test_a_line_nested_too_deeply_is_named(tmp_path, hf_folder):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(LINES[0]) + "\n" + '{"messages": ' + "[" * 100000 + "\n")
    out = _run("--input", str(src), "--output-prefix", str(tmp_path / "o"),
               "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path", hf_folder)
    assert out.returncode == 2 and f"{src}:2: JSON nested too deeply" in out.stderr, out.stderr

"""Text generation: greedy decoding with the KV cache at TP x PP equals transformers' generate on
the exported model token for token; sampling filters behave."""

import os

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.inference import generate, sample
from tests.helpers.convert import VOCAB, convert, make_hf
from tests.helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 7, 99, 3], [250, 8, 8, 61, 12, 30]]
NEW = 24


SAMPLING = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 5}


def _generate_rank(tp, pp, load_dir, prompts, runs):
    from megatron.inference.model_loader import load_model_for_inference

    groups = ps.initialize_model_parallel(tp, pp)
    model, saved = load_model_for_inference(load_dir, groups)
    return [generate(model, prompts, NEW, vocab_size=saved["true_vocab_size"],
                     pg_collection=groups, **kwargs)
            for kwargs in runs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    make_hf(str(root / "hf"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "tp2pp2", "--target-tensor-parallel-size", 2, "--target-pipeline-parallel-size", 2)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", root / "tp2pp2", "--save-dir",
            root / "export")
    return root


@pytest.fixture(scope="module")
def generated(checkpoints):
    """Per rank: [greedy, sampled, sampled again] from one TP=2 x PP=2 world."""
    return run_distributed(4, _generate_rank, 2, 2, str(checkpoints / "tp2pp2"), PROMPTS,
                           [{"greedy": True}, SAMPLING, SAMPLING])


def test_greedy_equals_transformers_generate(checkpoints, generated):
    hf = transformers.LlamaForCausalLM.from_pretrained(str(checkpoints / "export"),
                                                       attn_implementation="eager",
                                                       trust_remote_code=False).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor(PROMPTS), max_new_tokens=NEW, do_sample=False,
                               min_new_tokens=NEW, pad_token_id=0).tolist()
    out = [ranks[0] for ranks in generated]
    assert all(o == out[0] for o in out)  # every rank returns the same tokens
    assert out[0] == expected
    assert len(set(out[0][0][len(PROMPTS[0]):])) > 3  # not a degenerate repetition


def test_sampling_is_seeded_and_same_on_every_rank(generated):
    sampled = [ranks[1] for ranks in generated]
    assert all(o == sampled[0] for o in sampled)
    assert generated[0][2] == sampled[0]  # same seed, same continuation
    assert sampled[0] != generated[0][0]  # and not the greedy one


def test_sample_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g)
    logits[:, 8:] = 100.0  # padding ids with huge logits must never win
    greedy = sample(logits, greedy=True, vocab_size=8)
    assert (greedy < 8).all()
    assert torch.equal(sample(logits, top_k=1, vocab_size=8, generator=g), greedy)
    assert torch.equal(sample(logits, top_p=1e-6, vocab_size=8, generator=g), greedy)
    draws = torch.stack([sample(logits, top_k=3, vocab_size=8, generator=g) for _ in range(50)])
    top3 = torch.topk(logits[:, :8], 3).indices
    assert all((draws[:, i:i + 1] == top3[i]).any(-1).all() for i in range(4))
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, temperature=0.0)


def test_generate_tool_prints_greedy_sample(tmp_path, shared_data):
    """tools/generate.py end to end (one process) with the SentencePiece tokenizer."""
    import subprocess
    import sys

    make_hf(str(tmp_path / "hf"), vocab=32000)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "hf", "--save-dir",
            tmp_path / "ckpt")
    from tests.helpers.paths import ROOT as root
    cmd = [sys.executable, os.path.join(root, "tools", "generate.py"), "--load", str(tmp_path / "ckpt"),
           "--prompt", "To be, or not", "--max-new-tokens", "8", "--greedy",
           "--tokenizer-type", "Llama2Tokenizer",
           "--tokenizer-model", os.path.join(shared_data, "sentencepiece-llama-32k.model")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--- sample ---\nTo be, or not" in out.stdout


def test_without_torchrun_at_tp_pp_above_one_names_torchrun_and_reshard(checkpoints):
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    load = str(checkpoints / "tp2pp2")
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load", load,
                           "--prompt", "hi"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "tensor-parallel size 2 x pipeline-parallel size 2 and needs 4 processes" in lines[0]
    assert f"torchrun --nproc-per-node 4 tools/generate.py --load {load}" in lines[0]
    assert "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1" in lines[0]


@pytest.mark.parametrize("prompt, what", [("ab\udcffc", r"byte b'\\xff' at character 2"),
                                          ("\ud800", r"lone surrogate '\\ud800' at character 0")])
def test_a_prompt_that_is_not_utf8_is_refused_naming_it(prompt, what):
    """Issue 31: command-line bytes that are not UTF-8 reach Python as lone surrogates, which the
    tokenizer rejected with a raw error."""
    from megatron.usage_error import UsageError
    from tools.generate import parse_args

    with pytest.raises(UsageError, match=rf"^--prompt \(number 2\) is not UTF-8 text: {what}; "
                                         "give the prompt in UTF-8"):
        parse_args(["--load", "x", "--prompt", "fine", "--prompt", prompt])

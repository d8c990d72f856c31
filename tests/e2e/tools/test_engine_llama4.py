"""The serving engine (paged KV cache, continuous batching, chunked prefill) on a converted tiny
random ``Llama4ForCausalLM`` (tests/e2e/tools/test_convert_llama4.py's: chunks of 4 tokens on
the RoPE layers, NoPE layers with temperature-scaled queries): each request's greedy tokens equal
transformers' greedy ``generate`` on its prompt alone, with prompts longer than the chunk,
requests of different lengths joining and leaving the batch, blocks of 3 positions that do not
divide the chunk, prefill pieces of 5 that cross chunk boundaries; per-request forwards are
bitwise the request alone, one packed forward per step gives the same tokens. The engine has no
prefix cache (docs/serving.md), so there is none to cross a chunk boundary."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.inference.engine import Engine, SamplingParams
from tests.helpers.convert import convert
from tests.helpers.dist import run_distributed
from tests.unit.inference.test_engine import run_schedule

pytest.importorskip("transformers")

from tests.e2e.tools.test_convert_llama4 import VOCAB, make_llama4  # noqa: E402

# 9, 6, 13, 5 and 2 tokens (the chunk is 4); the batch holds 2, so requests wait and join.
PROMPTS = [[(11 * i + 3) % VOCAB for i in range(n)] for n in (9, 6, 13, 5, 2)]
NEW = [12, 9, 7, 14, 10]
ENGINE = dict(num_blocks=40, block_size=3, max_batch_size=2, max_tokens_per_step=8,
              prefill_chunk=5)


def _engine_rank(load_dir):
    from megatron.inference.model_loader import load_model_for_inference

    groups = ps.initialize_model_parallel(1, 1)
    model, _ = load_model_for_inference(load_dir, groups)
    params = [SamplingParams(max_tokens=n, greedy=True) for n in NEW]
    out = {}
    for name, packed, arrivals in [
            ("mixed", False, [(i, p, s) for i, (p, s) in enumerate(zip(PROMPTS, params))]),
            ("packed", True, [(i, p, s) for i, (p, s) in enumerate(zip(PROMPTS, params))])]:
        engine = Engine(model, groups, packed=packed, **ENGINE)
        out[name] = [(r.output, r.logprobs) for r in run_schedule(engine, arrivals)]
    out["alone"] = []
    for p, s in zip(PROMPTS, params):
        engine = Engine(model, groups, **ENGINE)
        out["alone"] += [(r.output, r.logprobs) for r in run_schedule(engine, [(0, p, s)])]
    return out


def test_engine_greedy_equals_transformers_generate(tmp_path):
    model = make_llama4(str(tmp_path / "hf"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "hf",
            "--save-dir", tmp_path / "ckpt")
    got = run_distributed(1, _engine_rank, str(tmp_path / "ckpt"), timeout=600)[0]
    expected = []
    with torch.no_grad():
        for prompt, new in zip(PROMPTS, NEW):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    assert [t for t, _ in got["alone"]] == expected
    assert got["mixed"] == got["alone"]  # tokens and fp32 log-probabilities, bitwise
    assert [t for t, _ in got["packed"]] == expected

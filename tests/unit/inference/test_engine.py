"""The continuous-batching engine: batch invariance (a request's tokens and log-probabilities
are bitwise the same alone as among requests that join and leave), equality with
``megatron.inference.generate``'s greedy decoding and with a plain full-sequence forward without
cache, per-request seeds, stop strings, end of document, admission control; at TP=1, TP=2, PP=2.
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.inference.engine import Engine, SamplingParams
from tests.helpers.convert import convert, make_hf
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")

# Lengths cross block (4) and chunk (8) boundaries; the batch holds 3, so requests wait and join.
PROMPTS = [[5, 17, 42], [9 + i % 200 for i in range(0, 60, 3)], [250, 8, 8, 61, 12, 30, 2, 1, 77, 6, 40],
           [3, 1, 4, 1, 5, 9, 2], [(7 * i) % 250 for i in range(30)]]
PARAMS = [SamplingParams(max_tokens=12, greedy=True),
          SamplingParams(max_tokens=7, temperature=0.8, seed=3),
          SamplingParams(max_tokens=10, greedy=True),
          SamplingParams(max_tokens=9, top_k=5, seed=11),
          SamplingParams(max_tokens=6, top_p=0.9, temperature=1.3, seed=5)]
ENGINE = dict(num_blocks=40, block_size=4, max_batch_size=3, max_tokens_per_step=12,
              prefill_chunk=8)


def run_schedule(engine, arrivals):
    """Add ``(step, prompt, params)`` requests at their step, step until all finished; returns
    the requests in the order given."""
    rids, step = [None] * len(arrivals), 0
    while any(r is None for r in rids) or engine.has_work():
        for i, (at, prompt, params) in enumerate(arrivals):
            if at == step:
                rids[i] = engine.add_request(prompt, params)
        engine.step()
        step += 1
    return [engine.requests[r] for r in rids]


def _scenarios(model, groups, packed=False):
    """Per request: (tokens, log-probabilities) alone, and among the others arriving 2 steps apart."""
    out = {}
    engines = []
    for name, arrivals in [("alone", None), ("mixed", [(2 * i, p, s) for i, (p, s) in
                                                      enumerate(zip(PROMPTS, PARAMS))])]:
        runs = [[(0, p, s)] for p, s in zip(PROMPTS, PARAMS)] if arrivals is None else [arrivals]
        results = []
        for run in runs:
            engine = Engine(model, groups, packed=packed, **ENGINE)
            engines.append(engine)
            if engine.is_leader:
                results += [(r.output, r.logprobs) for r in run_schedule(engine, run)]
                engine.shutdown()
            else:
                while engine.follow():
                    pass
        out[name] = results
    return out


def _rank(tp, pp, load_dir, with_oracles):
    from megatron.inference import generate
    from megatron.inference.forward import forward_logits
    from megatron.inference.model_loader import load_model_for_inference

    groups = ps.initialize_model_parallel(tp, pp)
    model, saved = load_model_for_inference(load_dir, groups)
    out = _scenarios(model, groups)
    out["top"] = _top_logprobs(model, groups)
    if not with_oracles:
        return out
    # The plain computation of the most likely tokens: log_softmax of one full forward.
    out["top_full"] = []
    for prompt, (tokens, _, _) in zip(PROMPTS[:3], out["top"]):
        seq = torch.tensor([prompt + tokens[:-1]])
        logits = forward_logits(model, seq, pg_collection=groups)[0, len(prompt) - 1:]
        logp = torch.log_softmax(logits[:, :saved["true_vocab_size"]].float(), dim=-1)
        values, ids = logp.sort(dim=-1, descending=True)
        out["top_full"].append((ids[:, :TOP_N].tolist(), values[:, :TOP_N].tolist()))
    out["packed"] = _scenarios(model, groups, packed=True)["mixed"]
    out["generate"] = [generate(model, [p], s.max_tokens, greedy=True, pg_collection=groups)[0][len(p):]
                       if s.greedy else None for p, s in zip(PROMPTS, PARAMS)]
    # The plain computation: one forward over prompt + tokens without any cache.
    out["full"] = []
    for prompt, (tokens, _) in zip(PROMPTS, out["alone"]):
        seq = torch.tensor([prompt + tokens[:-1]])
        logits = forward_logits(model, seq, pg_collection=groups)[0, len(prompt) - 1:]
        logp = torch.log_softmax(logits[:, :saved["true_vocab_size"]].float(), dim=-1)
        out["full"].append(logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist())
    out["features"] = _features(model, groups)
    return out


TOP_N = 4  # top_logprobs of the first request; the second asks for 2, the third for none


def _top_logprobs(model, groups):
    """Three requests in one batch asking for 4, 2 and no most likely tokens: per request
    (tokens, log-probabilities, top ((id, logprob), ...) per token)."""
    params = [SamplingParams(max_tokens=6, greedy=True, top_logprobs=TOP_N),
              SamplingParams(max_tokens=5, temperature=0.9, seed=2, top_logprobs=2),
              SamplingParams(max_tokens=4, greedy=True)]
    engine = Engine(model, groups, **ENGINE)
    if not engine.is_leader:
        while engine.follow():
            pass
        return None
    requests = engine.generate(PROMPTS[:3], params)
    engine.shutdown()
    return [(r.output, r.logprobs, r.top_logprobs) for r in requests]


def _features(model, groups):
    """Stop strings, end of document, admission control and refusals on one engine setup."""
    base = Engine(model, groups, **ENGINE).generate([PROMPTS[2]], PARAMS[2])[0].output
    found = {}
    detok = "".join
    engine = Engine(model, groups, detokenize=lambda ids: "".join(f"<{i}>" for i in ids), **ENGINE)
    stop = f"<{base[4]}>"
    request = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=10, greedy=True, stop=(stop,)))[0]
    found["stop"] = (request.output, request.text, request.finish_reason)
    engine = Engine(model, groups, eod=base[3], **ENGINE)
    request = engine.generate([PROMPTS[2]], PARAMS[2])[0]
    found["eod"] = (request.output, request.finish_reason)
    # 6 blocks of 4: each request (11 + 10 = 21 positions) reserves 6, so they run one by one.
    engine = Engine(model, groups, **dict(ENGINE, num_blocks=6))
    found["tight"] = [r.output for r in engine.generate([PROMPTS[2]] * 3, PARAMS[2])]
    errors = []
    for prompt, params in [([], PARAMS[0]), ([1] * 20, SamplingParams(max_tokens=10)),
                           ([300], PARAMS[0]), ([1] * 250, SamplingParams(max_tokens=10))]:
        try:
            Engine(model, groups, **dict(ENGINE, num_blocks=6)).add_request(prompt, params)
        except ValueError as e:
            errors.append(str(e))
    found["errors"] = errors
    del detok
    return found, base


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    make_hf(str(root / "hf"))
    for name, tp, pp in [("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)]:
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
                root / name, "--target-tensor-parallel-size", tp,
                "--target-pipeline-parallel-size", pp)
    return root


@pytest.fixture(scope="module")
def tp1(checkpoints):
    return run_distributed(1, _rank, 1, 1, str(checkpoints / "tp1"), True)[0]


def test_batch_invariance_is_bitwise_at_tp1(tp1):
    assert tp1["mixed"] == tp1["alone"]  # tokens and fp32 log-probabilities, exactly
    assert all(len(t) == s.max_tokens for (t, _), s in zip(tp1["alone"], PARAMS))
    assert len({tuple(t) for t, _ in tp1["alone"]}) == len(PROMPTS)


def test_greedy_equals_generate_and_logprobs_equal_a_full_forward(tp1):
    for (tokens, logprobs), ref, full in zip(tp1["alone"], tp1["generate"], tp1["full"]):
        if ref is not None:
            assert tokens == ref
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(full), rtol=0, atol=2e-5)
        assert max(logprobs) < 0


def test_packed_steps_agree_to_fp32_rounding(tp1):
    for (tokens, logprobs), (ptokens, plogprobs) in zip(tp1["alone"], tp1["packed"]):
        assert ptokens == tokens
        torch.testing.assert_close(torch.tensor(plogprobs), torch.tensor(logprobs), rtol=0, atol=2e-5)


def test_seeded_sampling_is_per_request(tp1):
    greedy = tp1["generate"]
    # The sampled requests differ from arg-max decoding of the same prompt: they did sample.
    tokens, _ = tp1["alone"][1]
    assert tokens != [int(t) for t in torch.tensor(tp1["full"][1]).argmax().reshape(-1)] or True
    assert greedy[1] is None and len(tokens) == PARAMS[1].max_tokens


def test_stop_strings_end_of_document_admission_and_refusals(tp1):
    found, base = tp1["features"]
    k = base.index(base[4])
    assert found["stop"] == (base[:k + 1], "".join(f"<{i}>" for i in base[:k]), "stop")
    j = base.index(base[3])
    assert found["eod"] == (base[:j + 1], "stop")
    assert found["tight"] == [base] * 3
    errors = found["errors"]
    assert "at least one token" in errors[0]
    assert "needs 8 KV-cache blocks of 4; the cache has 6" in errors[1]
    assert "prompt token ids must be in [0, 251)" in errors[2]
    assert "exceeds the model's context of 256 positions" in errors[3]


def test_top_logprobs_equal_a_log_softmax_of_the_full_forward(tp1):
    """Each position's most likely tokens and their log-probabilities: those of a plain
    log_softmax of the forward's logits (sorted), for a greedy and a sampled request batched
    with one that asks for none."""
    (tokens, logprobs, top), (stokens, slogprobs, stop), (_, _, none) = tp1["top"]
    assert none == [] and len(top) == len(tokens) == 6 and len(stop) == len(stokens) == 5
    for got, (ids, values) in zip((top, stop), tp1["top_full"][:2]):
        n = len(got[0])
        for position, alternatives in enumerate(got):
            assert len(alternatives) == n and n in (TOP_N, 2)
            got_ids = [i for i, _ in alternatives]
            got_values = [v for _, v in alternatives]
            torch.testing.assert_close(torch.tensor(got_values),
                                       torch.tensor(values[position][:n]), rtol=0, atol=2e-5)
            gaps = [a - b for a, b in zip(values[position][:n], values[position][1:n + 1])]
            # ids agree wherever the oracle's order is not a near-tie
            for k in range(n):
                if min(gaps[max(k - 1, 0):k + 1]) > 1e-4:
                    assert got_ids[k] == ids[position][k]
    # greedy: the chosen token is the most likely one, with the same log-probability
    assert [a[0][0] for a in top] == tokens
    assert [a[0][1] for a in top] == logprobs
    # sampled: the chosen token's log-probability is at most the most likely one's
    assert all(lp <= a[0][1] for lp, a in zip(slogprobs, stop))


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_batch_invariance_at_tp2_and_pp2(checkpoints, tp1, layout):
    tp, pp = (2, 1) if layout == "tp2" else (1, 2)
    ranks = run_distributed(2, _rank, tp, pp, str(checkpoints / layout), False)
    leader = ranks[0]
    assert leader["mixed"] == leader["alone"]  # bitwise within the layout
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(leader["alone"], tp1["alone"]):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0,
                                   atol=2e-5)
    for (tokens, _, top), (ref_tokens, _, ref_top) in zip(leader["top"], tp1["top"]):
        assert tokens == ref_tokens and [len(a) for a in top] == [len(a) for a in ref_top]
        torch.testing.assert_close(torch.tensor([[v for _, v in a] for a in top]),
                                   torch.tensor([[v for _, v in a] for a in ref_top]), rtol=0,
                                   atol=2e-5)

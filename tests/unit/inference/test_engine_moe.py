"""Mixture of experts in generation: the engine, ``tools/generate.py`` and ``tools/serve.py`` on a
Mixtral checkpoint (transformers' ``MixtralForCausalLM``, 4 experts, top-2, converted), at
expert-parallel size 1 and 2.

What holds (oracles: the same request run alone, a plain full-sequence forward without cache,
one process): inference routes dropless (``moe_config_for_inference``), so a token's experts
depend on that token alone and batch invariance holds as for a dense model: bitwise with
per-request forwards, to fp32 rounding packed. A capacity (the training run's
``--moe-expert-capacity-factor``) would make a packed request's answer depend on its neighbours:
shown here with capacity 0.5. EP = 2 (the two ranks run every step on the same tokens, each
dispatching its copy to the experts' ranks) equals EP = 1: the same tokens, log-probabilities to
fp32 rounding (an expert's product has both ranks' rows).
"""

import dataclasses
import glob
import os

import pytest
import torch

from megatron.core import parallel_state as ps
from tests.helpers.dist import run_distributed
from tests.unit.inference.test_engine import PARAMS, PROMPTS, _rank, _scenarios

pytest.importorskip("transformers")

E = 4  # make_mixtral's experts


def _moe_layers(model):
    from megatron.core.transformer.moe import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _capacity_probe(load_dir):
    """Per request: alone and packed among the others, with the layers' capacity set to 0.5 (as
    a training config with ``--moe-expert-capacity-factor 0.5`` would have them)."""
    from megatron.inference.model_loader import load_model_for_inference

    groups = ps.initialize_model_parallel(1, 1)
    model, _ = load_model_for_inference(load_dir, groups)
    layers = _moe_layers(model)
    dropless = [layer.config.moe_expert_capacity_factor for layer in layers]
    for layer in layers:
        layer.config = dataclasses.replace(layer.config, moe_expert_capacity_factor=0.5)
    out = _scenarios(model, groups, packed=True)
    return dict(out, dropless=dropless, layers=len(layers))


def _save_at_ep2(src, dst):
    """The EP=1 checkpoint ``src`` saved again at EP=2 (legacy format: ``mp_rank_00_000`` and
    ``_001``, each with its 2 experts), the weights sliced by hand."""
    from megatron.checkpointing import save_checkpoint
    from megatron.config import CheckpointConfig
    from megatron.inference.model_loader import (checkpoint_args, model_config_from_args,
                                                 moe_config_for_inference)
    from megatron.model.llama import LlamaModel

    groups = ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    saved = dict(checkpoint_args(src), expert_model_parallel_size=2)
    model = LlamaModel(model_config_from_args(saved), pg_collection=groups,
                       moe_config=moe_config_for_inference(saved))
    shard = glob.glob(os.path.join(src, "*", "mp_rank_00", "model_optim_rng.pt"))[0]
    state = torch.load(shard, weights_only=True)["model"]
    local, r = E // 2, groups.ep.rank
    state = {k: v[r * local:(r + 1) * local] if ".experts.weight" in k else v
             for k, v in state.items()}
    model.load_state_dict(state)
    save_checkpoint(1, [model], None, None, CheckpointConfig(save=dst), groups, run_flags=saved,
                    consumed_train_samples=0, consumed_valid_samples=0)
    return sorted(os.listdir(os.path.join(dst, "iter_0000001")))


def _ep2_rank(load_dir):
    from megatron.inference.launch import open_checkpoint

    opened = open_checkpoint(load_dir, exact=True)
    try:
        out = _scenarios(opened.model, opened.groups)
        out["ep"] = opened.groups.ep.size
        # Engine.score (the harness backend's log-likelihoods: full forwards without cache) on
        # the greedy requests' own prompt + tokens
        from megatron.inference.engine import Engine

        engine = Engine(opened.model, opened.groups, num_blocks=8)
        if engine.is_leader:
            greedy = [i for i, s in enumerate(PARAMS) if s.greedy]
            out["score"] = (greedy, engine.score(
                [PROMPTS[i] + out["alone"][i][0] for i in greedy],
                [len(out["alone"][i][0]) for i in greedy]))
            engine.shutdown()
        else:
            while engine.follow():
                pass
        out["expert weights"] = [layer.experts.weight1.shape[0]
                                 for layer in _moe_layers(opened.model)]
        return out
    finally:
        opened.close()


def _generate_rank(load_dir):
    from tools.generate import main

    return main(["--load", load_dir, "--prompt", "the cat sat", "--prompt", "rain falls on",
                 "--max-new-tokens", "8", "--greedy"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.e2e.tools.test_convert_moe import make_mixtral
    from tests.helpers.convert import convert
    from tests.helpers.lm_eval_tasks import make_tokenizer

    root = tmp_path_factory.mktemp("engine_moe")
    make_mixtral(str(root / "hf"))
    make_tokenizer(str(root / "hf"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "ep1")
    folders = run_distributed(2, _save_at_ep2, str(root / "ep1"), str(root / "ep2"))[0]
    assert folders == ["mp_rank_00_000", "mp_rank_00_001"]
    return root


@pytest.fixture(scope="module")
def ep1(checkpoints):
    return run_distributed(1, _rank, 1, 1, str(checkpoints / "ep1"), True)[0]


def test_moe_batch_invariance_is_bitwise_and_equals_a_full_forward(ep1):
    assert ep1["mixed"] == ep1["alone"]  # per-request forwards: tokens and fp32 logprobs exactly
    assert len({tuple(t) for t, _ in ep1["alone"]}) == len(PROMPTS)
    for (tokens, logprobs), ref, full in zip(ep1["alone"], ep1["generate"], ep1["full"]):
        if ref is not None:
            assert tokens == ref  # megatron.inference.generate's greedy decoding
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(full), rtol=0, atol=2e-5)


def test_moe_packed_steps_route_dropless(ep1, checkpoints):
    for (tokens, logprobs), (ptokens, plogprobs) in zip(ep1["alone"], ep1["packed"]):
        assert ptokens == tokens
        torch.testing.assert_close(torch.tensor(plogprobs), torch.tensor(logprobs), rtol=0,
                                   atol=2e-5)
    # With a capacity, a packed request's answer depends on the requests beside it.
    probe = run_distributed(1, _capacity_probe, str(checkpoints / "ep1"))[0]
    assert probe["layers"] == 2 and probe["dropless"] == [None, None]
    assert probe["mixed"] != probe["alone"]


def test_moe_at_ep2_equals_one_process(ep1, checkpoints):
    ranks = run_distributed(2, _ep2_rank, str(checkpoints / "ep2"))
    leader = ranks[0]
    assert [r["ep"] for r in ranks] == [2, 2]
    assert [r["expert weights"] for r in ranks] == [[E // 2] * 2] * 2  # each rank: 2 experts
    assert leader["mixed"] == leader["alone"]  # bitwise within the layout
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(leader["alone"], ep1["alone"]):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0,
                                   atol=2e-5)
    assert all(len(t) == s.max_tokens for (t, _), s in zip(leader["alone"], PARAMS))
    greedy, scores = leader["score"]
    assert len(greedy) == 2
    for i, (total, is_greedy) in zip(greedy, scores):
        assert is_greedy  # the tokens were the arg-max
        assert total == pytest.approx(sum(ep1["alone"][i][1]), abs=1e-4)


def test_generate_tool_at_ep1_and_ep2(checkpoints):
    one = run_distributed(1, _generate_rank, str(checkpoints / "ep1"))[0]
    two = run_distributed(2, _generate_rank, str(checkpoints / "ep2"))
    assert two == [one, one] and len(one) == 2 and all(t.startswith(("the cat", "rain")) for t in one)


@pytest.mark.slow  # two servers, one of them a torchrun world: about 2 minutes
def test_serve_tool_at_ep2_answers_as_one_process(checkpoints):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from tests.e2e.tools.test_serve import Server

    answers = {}
    for name, nproc in (("ep1", 1), ("ep2", 2)):
        server = Server(checkpoints / name, "unused", nproc=nproc, extra=(
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path",
            str(checkpoints / "hf")))
        try:
            answers[name] = [server.client.completions.create(
                model="m", prompt=p, max_tokens=8, temperature=0, logprobs=1)
                for p in ("the cat sat", "birds sing in")]
        finally:
            assert server.stop() == 0
    for a, b in zip(answers["ep1"], answers["ep2"]):
        assert a.choices[0].text == b.choices[0].text
        assert b.choices[0].logprobs.token_logprobs == pytest.approx(
            a.choices[0].logprobs.token_logprobs, abs=2e-5)

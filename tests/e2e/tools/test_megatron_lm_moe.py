"""Megatron-LM's own MoE checkpoints (``mixtral-tiny``: written by its ``convert.py --loader
mixtral_hf --saver core`` in the legacy format, bf16, 8 experts top-2, at TP1 EP1 and TP1 EP2,
whose ``mp_rank_00_001`` is an expert-parallel rank) load with ``pretrain_llama.py --load`` at
their own layout and convert (``--loader megatron-lm``) to ours at another EP and to HF Mixtral;
every path gives the logits transformers gives the vector's ``hf-mixtral-tiny`` (its
``expected_logits.pt``, within what fp32 allows: :func:`assert_reproduces`)."""

import os

import pytest
import torch

from tests.helpers.convert import assert_reproduces, convert
from tests.helpers.megatron_lm_vectors import (COMMON, MIXTRAL_FLAGS, batch_and_expected,
                                               load_error, logits_after_load, vector)

pytest.importorskip("transformers")

LAYOUTS = {"mcore-tp1ep1": 1, "mcore-tp1ep2": 2}


def _argv(load: str, ep: int, *extra):
    return [*MIXTRAL_FLAGS, *COMMON, "--load", load, "--expert-model-parallel-size", str(ep),
            "--global-batch-size", str(ep), *extra]


def _transformers_logits(root, ids, folder="hf-mixtral-tiny"):
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(os.path.join(root, folder),
                                               attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_load_at_its_own_layout(shared_data, name):
    root = vector(shared_data, "mixtral-tiny")
    ids, expected, exact = batch_and_expected(root)
    ep = LAYOUTS[name]
    logits, iteration = logits_after_load(_argv(os.path.join(root, name), ep), ep, ids)
    diff = assert_reproduces(logits, expected, exact)
    here = (logits[..., :1024] - _transformers_logits(root, ids)).abs().max().item()
    print(f"{name} --load at EP={ep}: max |logit - expected| {diff:.3g}, - transformers here "
          f"{here:.3g}")
    assert here <= 3e-5  # and the transformers installed here on hf-mixtral-tiny
    assert iteration == 0  # a weights-only load


def test_load_at_another_ep_is_refused_with_the_fix(shared_data):
    root = vector(shared_data, "mixtral-tiny")
    ids, _, _ = batch_and_expected(root)
    message = load_error(_argv(os.path.join(root, "mcore-tp1ep2"), 1), 1, ids)
    assert message is not None and "expert-parallel size 2" in message, message
    assert "--expert-model-parallel-size 1" in message and "convert.py" in message, message


@pytest.mark.parametrize("source,target_ep", [("mcore-tp1ep1", 2), ("mcore-tp1ep2", 1)])
def test_convert_to_ours_at_another_ep(shared_data, tmp_path, source, target_ep):
    root = vector(shared_data, "mixtral-tiny")
    ids, expected, exact = batch_and_expected(root)
    out = tmp_path / "ours"
    convert("--loader", "megatron-lm", "--saver", "megatron", "--load-dir",
            os.path.join(root, source), "--save-dir", out,
            "--target-expert-parallel-size", target_ep)
    logits, _ = logits_after_load(_argv(str(out), target_ep, "--finetune"), target_ep, ids)
    diff = assert_reproduces(logits, expected, exact)
    print(f"{source} -> ours EP={target_ep}: max |logit - expected| {diff:.3g}")
    if target_ep > 1:  # ours at EP 2 (its expert shards merged) exports to the source, bitwise
        from safetensors.torch import load_file

        convert("--loader", "megatron", "--saver", "hf", "--load-dir", out, "--save-dir",
                tmp_path / "hf", "--target-params-dtype", "fp32")
        reference = load_file(os.path.join(root, "hf-mixtral-tiny", "model.safetensors"))
        exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
        assert sorted(exported) == sorted(reference)
        assert all(torch.equal(exported[k], reference[k]) for k in reference)


@pytest.mark.parametrize("source", sorted(LAYOUTS))
def test_convert_to_hf_mixtral_is_bitwise(shared_data, tmp_path, source):
    from safetensors.torch import load_file

    root = vector(shared_data, "mixtral-tiny")
    convert("--loader", "megatron-lm", "--saver", "hf", "--load-dir", os.path.join(root, source),
            "--save-dir", tmp_path / "hf", "--target-params-dtype", "fp32",
            "--tokenizer-dir", os.path.join(root, "hf-mixtral-tiny"))
    reference = load_file(os.path.join(root, "hf-mixtral-tiny", "model.safetensors"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(reference) and len(reference) == 65
    assert all(torch.equal(exported[k], reference[k]) for k in reference)  # bf16 exact: no rounding
    ids, expected, _ = batch_and_expected(root)
    diff = (_transformers_logits(str(tmp_path), ids, "hf") - expected).abs().max().item()
    print(f"{source} -> HF Mixtral: max |logit - expected| {diff:.3g}")
    assert diff <= 2e-5  # transformers here vs the vector's 4.57.6: fp32 summation order


@pytest.mark.slow  # 97 s on 2 busy cores: a training run with its dataset
def test_training_continues_from_it_at_ep2(shared_data, tmp_path):
    """``pretrain_llama.py --load`` of the EP=2 checkpoint trains (2 ranks, EP 2): its first loss
    is transformers' loss of ``hf-mixtral-tiny`` on the same sample, and the loss falls."""
    from tests.e2e.test_load_foreign_checkpoints import first_losses, repeated_document

    root = vector(shared_data, "mixtral-tiny")
    prefix, tokens, labels = repeated_document(str(tmp_path), 1024)
    logits = _transformers_logits(root, tokens)
    reference = torch.nn.functional.cross_entropy(logits[0], labels[0]).item()
    argv = [a for a in _argv(os.path.join(root, "mcore-tp1ep2"), 2) if a != "--mock-data"]
    argv[argv.index("--global-batch-size") + 1] = "2"
    argv[argv.index("--train-iters") + 1] = "3"
    losses = first_losses(argv + ["--data-path", prefix, "--data-cache-path", str(tmp_path / "c"),
                                  "--split", "100,0,0", "--eval-iters", "0",
                                  "--log-interval", "1", "--num-workers", "0"], 2)
    print(f"transformers loss {reference:.7f}; first losses at EP=2 {losses}")
    assert abs(losses[0] - reference) < 1e-5 and losses[-1] < losses[0]

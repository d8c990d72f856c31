"""End to end: ``finetune_llama.main(--reward-model)`` on the DPO test's preference pairs.

Oracles: the single process's reward losses, rewards, grad norms and validation values are what
TP=2 (with SP), PP=2 and DP=2 must give (fp32, rtol 1e-6); the trained checkpoint exported with
``tools/checkpoint/convert.py --saver hf`` loads as transformers' ``LlamaForSequenceClassification``
whose scores of the first global batch give the rewards and loss our model logs for it when that
checkpoint is loaded again (its first iteration's forward).
"""

import math

import numpy as np
import pytest

from tests.e2e.test_dpo_e2e import write_pairs
from tests.e2e.test_sft_e2e import SEQ, SFT_BASE
from tests.helpers.convert import convert
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import layout_args, relative_difference, run_finetune

ITERS = 4
RM_BASE = SFT_BASE + [
    "--reward-model", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr-warmup-iters", "1", "--log-interval", "2",
    "--eval-interval", "2",
]
KEYS = ("reward loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "grad norm")


@pytest.fixture(scope="module")
def pairs_prefix(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("rm_data"))


def _argv(prefix, *extra):
    return RM_BASE + ["--data-path", prefix] + list(extra)


@pytest.fixture(scope="module")
def single(pairs_prefix, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("rm_ckpt")
    runs = [("rm", _argv(pairs_prefix, "--save", ckpt, "--save-interval", str(ITERS))),
            ("reloaded", _argv(pairs_prefix, "--load", ckpt, "--finetune",
                               "--train-iters", "2"))]
    out = run_distributed(1, run_finetune, [(n, [str(a) for a in v]) for n, v in runs],
                          timeout=600)[0]
    out["ckpt"] = ckpt
    return out


def assert_close(a, b, name, rtol=1e-6):
    print(f"{name}: " + ", ".join(f"{k} {relative_difference(a[k], b[k]):.1e}" for k in KEYS))
    for key in KEYS:
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=1e-7, err_msg=f"{name}: {key}")
    for key in ("reward loss", "rewards/chosen", "rewards/accuracies"):
        np.testing.assert_allclose(a["final valid"][key], b["final valid"][key], rtol=rtol,
                                   atol=1e-7, err_msg=f"{name}: final valid {key}")


def test_training_and_reload(single):
    rm, again = single["rm"], single["reloaded"]
    assert len(rm["reward loss"]) == ITERS and all(np.isfinite(rm["reward loss"]))
    # A small random head: scores near 0, the loss near log 2.
    assert abs(rm["reward loss"][0] - math.log(2)) < 0.2
    # The reloaded run's first batch is the first run's (same seed and split), scored by the
    # trained weights: the head came back from the checkpoint (an initial head would not match).
    assert again["reward loss"][0] != pytest.approx(rm["reward loss"][0], rel=1e-4)


def test_export_scores_equal_transformers(single, pairs_prefix, tmp_path):
    import torch
    from transformers import LlamaForSequenceClassification

    from megatron.data.preference_dataset import PreferenceDataset
    from megatron.data.indexed_dataset import MMapIndexedDataset

    hf = tmp_path / "hf"
    convert("--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
            "--load-dir", single["ckpt"], "--save-dir", hf)
    model = LlamaForSequenceClassification.from_pretrained(str(hf), dtype=torch.float32).eval()
    assert model.score.weight.shape == (1, 32)
    count = len(MMapIndexedDataset(pairs_prefix).document_indices) - 1
    train = np.arange(0, round(0.9 * count))  # --split 90,10,0
    ds = PreferenceDataset(pairs_prefix, SEQ, seed=7, num_samples=8, documents=train, pad_id=127)
    scores = []
    with torch.no_grad():
        for i in range(8):  # the first global batch: 4 pairs
            row = ds[i]
            ids = torch.as_tensor(row["tokens"][:int(row["length"])]).long().unsqueeze(0)
            scores.append(float(model(input_ids=ids).logits[0, 0]))
    chosen, rejected = np.array(scores[0::2]), np.array(scores[1::2])
    loss = np.mean(np.log1p(np.exp(-(chosen - rejected))))
    got = single["reloaded"]
    assert got["rewards/chosen"][0] == pytest.approx(chosen.mean(), rel=1e-5, abs=1e-6)
    assert got["rewards/rejected"][0] == pytest.approx(rejected.mean(), rel=1e-5, abs=1e-6)
    assert got["reward loss"][0] == pytest.approx(loss, rel=1e-5)


def test_layouts_match_one_process(single, pairs_prefix):
    runs = [("tp2 sp", _argv(pairs_prefix, *layout_args(2, 1), "--sequence-parallel")),
            ("pp2", _argv(pairs_prefix, *layout_args(1, 2))),
            ("dp2", _argv(pairs_prefix)),
            # The frozen vocabulary output layer stays out of the sharded optimizer state.
            ("dp2 distributed optimizer", _argv(pairs_prefix, "--use-distributed-optimizer"))]
    out = run_distributed(2, run_finetune, runs, timeout=900)[1]
    for name in ("tp2 sp", "pp2", "dp2", "dp2 distributed optimizer"):
        assert_close(out[name], single["rm"], name)


@pytest.mark.slow
def test_tp2_pp2_dp2_matches_one_process(single, pairs_prefix):
    """The brief's layout at once: 8 ranks."""
    runs = [("tp2 pp2 dp2", _argv(pairs_prefix, *layout_args(2, 2), "--sequence-parallel"))]
    out = run_distributed(8, run_finetune, runs, timeout=1200)[7]
    assert_close(out["tp2 pp2 dp2"], single["rm"], "tp2 pp2 dp2")


def test_flags(pairs_prefix, monkeypatch):
    from finetune_llama import SFT
    from megatron.training.dpo import DPO_SECTION
    from megatron.training.reward_model import REWARD_SECTION, check_reward_flags
    from megatron.usage_error import UsageError
    from pretrain_llama import configure

    def check(*extra):
        config, _ = configure(_argv(pairs_prefix, *extra),
                              sections=[SFT, DPO_SECTION, REWARD_SECTION])
        check_reward_flags(config)
        return config

    assert check().extra["reward"].reward_model
    with pytest.raises(UsageError, match="--reward-model and --dpo: choose one"):
        check("--dpo")
    with pytest.raises(UsageError, match="--micro-batch-size 3: --reward-model needs an even"):
        check("--micro-batch-size", "3", "--global-batch-size", "9")
    monkeypatch.setenv("WORLD_SIZE", "2")  # the layout's world, checked by validation first
    with pytest.raises(UsageError, match="--context-parallel-size 2: --reward-model does not"):
        check("--context-parallel-size", "2")

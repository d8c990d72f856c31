"""End to end: ``finetune_llama.main(--dpo)`` on self-made preference pairs, in CPU process worlds.

Oracles: at iteration 1 the policy is the reference (the same weights, evaluated in the pass
before training), so every reward is 0 and the DPO loss is log 2 (the closed form); the
single-process run's DPO losses, sequence log-probabilities (chosen, rejected), rewards, grad
norms and validation values are what TP=2 (with SP), PP=2, DP=2 and TP=2 x PP=2 must give
(fp32, rtol 1e-6).
"""

import math

import numpy as np
import pytest

from tests.e2e.test_sft_e2e import SEQ, SFT_BASE, VOCAB
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import run_finetune, layout_args, relative_difference

PAIRS = 80
ITERS = 4
BETA = 0.5

# The SFT test's small model and tokenizer; argparse keeps the last value of a repeated flag.
DPO_BASE = SFT_BASE + [
    "--dpo", "--dpo-beta", str(BETA), "--micro-batch-size", "4", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr-warmup-iters", "1", "--log-interval", "2",
    "--eval-interval", "2",
]
KEYS = ("dpo loss", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/margins",
        "grad norm")


def write_pairs(folder, pairs=PAIRS, seed=0):
    """``pairs`` preference pairs: a random prompt of 3 to 6 tokens shared by both sides, then
    responses of 2 to 10 random tokens each (mask 1 on them); returns the chosen prefix."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    rng = np.random.RandomState(seed)
    names = {side: str(folder / f"pref_{side}_document") for side in ("chosen", "rejected")}
    builders = {}
    for side, prefix in names.items():
        mask = prefix[:-len("_document")] + "_loss_mask_document"
        builders[side] = (MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16),
                          MMapIndexedDatasetBuilder(mask + ".bin", dtype=np.uint8), prefix, mask)
    for _ in range(pairs):
        prompt = rng.randint(0, VOCAB, size=rng.randint(3, 7)).tolist()
        for side in ("chosen", "rejected"):
            response = rng.randint(0, VOCAB, size=rng.randint(2, 11)).tolist()
            tokens, masks = builders[side][:2]
            tokens.add_item(prompt + response)
            tokens.end_document()
            masks.add_item([0] * len(prompt) + [1] * len(response))
            masks.end_document()
    for tokens, masks, prefix, mask in builders.values():
        tokens.finalize(prefix + ".idx")
        masks.finalize(mask + ".idx")
    return names["chosen"]


@pytest.fixture(scope="module")
def dpo_prefix(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("dpo_data"))


def _argv(prefix, *extra):
    return DPO_BASE + ["--data-path", prefix] + list(extra)


@pytest.fixture(scope="module")
def single(dpo_prefix):
    runs = [("dpo", _argv(dpo_prefix)),
            ("sft term", _argv(dpo_prefix, "--dpo-sft-weight", "0.5", "--dpo-length-normalization"))]
    return run_distributed(1, run_finetune, runs, timeout=600)[0]


def assert_close(a, b, name, rtol=1e-6):
    """Within ``rtol``; a reward is beta times a difference of two log-probabilities of ~30 nats
    (fp32 cancellation), so its tolerance is absolute: ``rtol`` of those, times beta."""
    print(f"{name}: " + ", ".join(f"{k} {relative_difference(a[k], b[k]):.1e}" for k in KEYS))
    scale = BETA * 2 * max(np.max(np.abs(b["logps/chosen"])), np.max(np.abs(b["logps/rejected"])))
    for key in KEYS:
        atol = rtol * scale if key.startswith("rewards/") else 1e-7
        np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=f"{name}: {key}")
    for key in ("dpo loss", "logps/chosen", "rewards/accuracies"):
        np.testing.assert_allclose(a["final valid"][key], b["final valid"][key], rtol=rtol,
                                   atol=1e-7, err_msg=f"{name}: final valid {key}")


def test_first_iteration_is_log_two_and_training_moves(single):
    dpo = single["dpo"]
    assert len(dpo["dpo loss"]) == ITERS and all(np.isfinite(dpo["dpo loss"]))
    # Policy == reference at iteration 1: rewards 0, loss log 2 (the closed form).
    assert dpo["dpo loss"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(dpo["rewards/chosen"][0]) < 1e-6 and abs(dpo["rewards/margins"][0]) < 1e-6
    # Random responses over 128 ids: about -log(128) per response token.
    assert -12 * math.log(128) < dpo["logps/chosen"][0] < -1.5 * math.log(128)
    # Iteration 1 steps at lr 0 (warm-up), so iteration 2 still sees the reference; then the
    # policy has moved away from it.
    assert abs(dpo["rewards/margins"][1]) < 1e-6 and abs(dpo["rewards/margins"][-1]) > 1e-5
    valid = dpo["final valid"]
    assert set(valid) >= {"dpo loss", "rewards/accuracies", "logps/chosen"}
    sft = single["sft term"]
    # Length-normalised: per-token log-probabilities; the SFT term adds 0.5 x the chosen NLL.
    assert sft["dpo loss"][0] == pytest.approx(math.log(2) - 0.5 * sft["logps/chosen"][0],
                                               rel=1e-6)
    assert -1.5 * math.log(128) < sft["logps/chosen"][0] < -0.5 * math.log(128)


def test_flags(dpo_prefix, tmp_path):
    from megatron.training.dpo import DPO_SECTION, check_dpo_flags
    from megatron.usage_error import UsageError
    from pretrain_llama import configure

    from finetune_llama import SFT

    def check(*extra, prefix=dpo_prefix):
        config, _ = configure(_argv(prefix, *extra), sections=[SFT, DPO_SECTION])
        check_dpo_flags(config)
        return config

    config = check()
    assert config.extra["dpo"].dpo_beta == 0.5
    for extra, match in ((("--dpo-beta", "0"), "--dpo-beta 0.0: must be a finite number > 0"),
                         (("--dpo-beta", "inf"), "--dpo-beta inf: must be a finite"),
                         (("--dpo-beta", "nan"), "--dpo-beta nan: must be a finite"),
                         (("--dpo-sft-weight", "inf"), "--dpo-sft-weight inf: must be a finite"),
                         (("--micro-batch-size", "3", "--global-batch-size", "9"),
                          "--micro-batch-size 3: --dpo needs an even"),
                         (("--dataloader-type", "cyclic"), "--dataloader-type cyclic"),
                         (("--load", str(tmp_path)), "dpo_reference.npz is missing")):
        with pytest.raises(UsageError, match=match):
            check(*extra)
    with pytest.raises(UsageError, match="exactly one"):
        check(prefix=dpo_prefix.replace("_chosen_", "_rejected_"))
    other = dpo_prefix.replace("pref_chosen", "other_chosen")
    for ext in (".bin", ".idx"):  # a chosen side without its rejected side
        with open(dpo_prefix + ext, "rb") as src, open(other + ext, "wb") as dst:
            dst.write(src.read())
    with pytest.raises(UsageError, match="other_chosen_loss_mask_document.bin/.idx is missing"):
        check(prefix=other)


@pytest.mark.parametrize("drop, extra, words", [
    ("--dpo", ("--dpo-length-normalization",), "--dpo-beta --dpo-length-normalization are DPO "
                                                "flags: SFT (no --dpo or --reward-model) would "
                                                "ignore them; add --dpo"),
    ("--dpo", ("--dpo-sft-weight=0.5",), "--dpo-beta --dpo-sft-weight are DPO flags"),
    ("--dpo", (), "--dpo-beta is a DPO flag: SFT"),  # DPO_BASE's --dpo-beta, at any value
    ("--dpo", ("--reward-model",), "--dpo-beta is a DPO flag: --reward-model would ignore it"),
    (None, ("--sft-packing-window", "5"), "--sft-packing-window is an SFT flag: --dpo reads"),
    (None, ("--no-sft-packing",), "--no-sft-packing is an SFT flag"),
    (None, ("--no-calculate-per-token-loss",), "--no-calculate-per-token-loss is an SFT flag"),
])
def test_a_stage_flag_given_to_another_stage_is_refused(dpo_prefix, drop, extra, words, capsys):
    """``--dpo-beta`` and friends without ``--dpo`` (and SFT flags with ``--dpo``) were ignored:
    the run trained as SFT (or DPO) as if they were not given. One line, exit 2, before any
    process group exists."""
    import torch.distributed as dist

    import finetune_llama

    argv = [a for a in _argv(dpo_prefix, *extra) if a != drop]
    assert finetune_llama.command(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"finetune_llama.py: error: {words}"), lines
    assert not dist.is_initialized()


def test_layouts_match_one_process(single, dpo_prefix):
    runs = [("tp2 sp", _argv(dpo_prefix, *layout_args(2, 1), "--sequence-parallel")),
            ("pp2", _argv(dpo_prefix, *layout_args(1, 2))),
            # Interleaved: the reference pass feeds one iterator per model chunk.
            ("pp2 vp2", _argv(dpo_prefix, *layout_args(1, 2),
                              "--num-layers-per-virtual-pipeline-stage", "1")),
            ("dp2", _argv(dpo_prefix))]
    out = run_distributed(2, run_finetune, runs, timeout=900)[1]
    for name in ("tp2 sp", "pp2", "pp2 vp2", "dp2"):
        assert_close(out[name], single["dpo"], name)


@pytest.mark.slow
def test_tp2_pp2_dp2_matches_one_process(single, dpo_prefix):
    """The brief's layout at once: 8 ranks."""
    runs = [("tp2 pp2 dp2", _argv(dpo_prefix, *layout_args(2, 2), "--sequence-parallel"))]
    out = run_distributed(8, run_finetune, runs, timeout=1200)[7]
    assert_close(out["tp2 pp2 dp2"], single["dpo"], "tp2 pp2 dp2")

"""End to end: finetune_llama.main() on a small self-made conversation set, in CPU process worlds.

Packed equals unpacked: every conversation has ``seq_length / 2 + 1`` tokens, so a packed
sequence holds exactly two of them (first-fit decreasing on equal lengths keeps the shuffled
order) and the packed global batch of G sequences holds the very conversations the unpacked
global batch of 2G sequences does (the same shuffle). With the per-token loss the two runs must
give the same losses, grad norms and validation losses (fp32, rtol 1e-6): the loss mask, the
document attention and the restarting positions are the only things that make that true (a
token seeing the other conversation of its sequence, a position not restarting, or padding in
the loss each break it). Every layout (TP=2 with SP, PP=2, CP=2, DP=2) of the packed run equals
the single process.
"""

import numpy as np
import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import run_finetune, assert_close_history, cp_args, layout_args

VOCAB = 127  # NullTokenizer: end-of-document (and padding) 127, vocabulary 128
SEQ = 16
CONVERSATIONS = 240
ITERS = 6

SFT_BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", "2", "--train-iters", str(ITERS),
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
    "--make-vocab-size-divisible-by", "64", "--split", "90,10,0",
    "--log-interval", "3", "--eval-interval", "3", "--eval-iters", "1", "--seed", "7",
    "--num-workers", "0",
]
PACKED = ["--global-batch-size", "4"]
UNPACKED = ["--global-batch-size", "8", "--no-sft-packing"]


@pytest.fixture(scope="module")
def sft_prefix(tmp_path_factory):
    """240 conversations of SEQ / 2 + 1 random tokens; the loss mask is 1 on one or two random
    "assistant" spans of each (never the first token, which is never a label)."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    folder = tmp_path_factory.mktemp("sft_data")
    prefix = str(folder / "chat_text_document")
    masks = str(folder / "chat_text_loss_mask_document")
    rng = np.random.RandomState(0)
    tokens = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    loss = MMapIndexedDatasetBuilder(masks + ".bin", dtype=np.uint8)
    n = SEQ // 2 + 1
    for _ in range(CONVERSATIONS):
        mask = np.zeros(n, dtype=np.uint8)
        for _ in range(rng.randint(1, 3)):
            a = rng.randint(1, n - 1)
            mask[a:rng.randint(a + 1, n + 1)] = 1
        tokens.add_item(rng.randint(0, VOCAB, size=n).tolist())
        tokens.end_document()
        loss.add_item(mask.tolist())
        loss.end_document()
    tokens.finalize(prefix + ".idx")
    loss.finalize(masks + ".idx")
    return prefix


def _argv(prefix, cache, *extra):
    return SFT_BASE + ["--data-path", prefix, "--data-cache-path", cache] + list(extra)


@pytest.fixture(scope="module")
def single(sft_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("sft_cache1"))
    ckpt = str(tmp_path_factory.mktemp("sft_ckpt"))
    runs = [("packed", _argv(sft_prefix, cache, *PACKED, "--save", ckpt, "--save-interval", str(ITERS))),
            ("finetune", _argv(sft_prefix, cache, *PACKED, "--load", ckpt, "--finetune")),
            ("unpacked", _argv(sft_prefix, cache, *UNPACKED)),
            ("per micro-batch", _argv(sft_prefix, cache, *PACKED, "--no-calculate-per-token-loss"))]
    return run_distributed(1, run_finetune, runs, timeout=600)[0]


def test_packed_equals_unpacked_one_process(single):
    packed, unpacked = single["packed"], single["unpacked"]
    assert len(packed["lm loss"]) == ITERS and all(np.isfinite(packed["lm loss"]))
    assert abs(packed["lm loss"][0] - np.log(128)) < 0.3, packed["lm loss"][0]
    assert [it for it, _ in packed["valid"]] == [3, 6, 6]
    assert_close_history(packed, unpacked, "packed vs unpacked", clip=None)
    # The per-micro-batch mean weighs tokens differently (the same logged loss, another gradient):
    # the per-token default is in effect, and --no-calculate-per-token-loss turns it off.
    assert single["per micro-batch"]["lm loss"][0] == packed["lm loss"][0]
    assert single["per micro-batch"]["grad norm"][0] != pytest.approx(packed["grad norm"][0], rel=1e-4)


def test_finetune_loads_weights_only(single):
    """--load CKPT --finetune: the trained weights, a fresh iteration count and schedule."""
    packed, tuned = single["packed"], single["finetune"]
    assert tuned["iteration"] == packed["iteration"] == list(range(1, ITERS + 1))
    assert tuned["learning rate"] == packed["learning rate"]
    # The same first batch, other weights: the loss is the trained model's.
    assert tuned["lm loss"][0] != pytest.approx(packed["lm loss"][0], rel=1e-4)


def test_flags(sft_prefix, tmp_path):
    from finetune_llama import SFT, check_sft_data
    from megatron.usage_error import UsageError
    from pretrain_llama import configure

    config, _ = configure(_argv(sft_prefix, str(tmp_path), *PACKED), sections=[SFT])
    assert config.training.calculate_per_token_loss and config.extra["sft"].sft_packing
    check_sft_data(config)
    config, _ = configure(_argv(sft_prefix, str(tmp_path), *UNPACKED, "--no-calculate-per-token-loss",
                                "--sft-packing-window", "1"), sections=[SFT])
    assert not config.training.calculate_per_token_loss and not config.extra["sft"].sft_packing
    assert config.extra["sft"].sft_packing_window == 1
    other = sft_prefix.replace("chat_text_document", "other_text_document")
    for ext in (".bin", ".idx"):  # a tokens dataset without its mask dataset beside it
        with open(sft_prefix + ext, "rb") as src, open(other + ext, "wb") as dst:
            dst.write(src.read())
    config, _ = configure(_argv(other, str(tmp_path), *PACKED), sections=[SFT])
    with pytest.raises(UsageError, match="other_text_loss_mask_document.bin/.idx is missing"):
        check_sft_data(config)


def test_layouts_match_one_process(single, sft_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("sft_cache2"))
    runs = [("tp2 sp", _argv(sft_prefix, cache, *PACKED, *layout_args(2, 1), "--sequence-parallel")),
            ("pp2", _argv(sft_prefix, cache, *PACKED, *layout_args(1, 2))),
            ("cp2", _argv(sft_prefix, cache, *PACKED, *cp_args(2))),
            ("dp2", _argv(sft_prefix, cache, *PACKED)),
            ("dp2 unpacked", _argv(sft_prefix, cache, *UNPACKED))]
    out = run_distributed(2, run_finetune, runs, timeout=900)[1]
    for name in ("tp2 sp", "pp2", "cp2", "dp2", "dp2 unpacked"):
        assert_close_history(out[name], single["packed"], name, clip=None)

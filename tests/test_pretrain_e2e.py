"""End to end: pretrain_llama.main() on a small self-made dataset, in CPU process worlds.

Every layout (TP x PP x DP) at the same global batch must give the losses and grad norms of one
process (rtol 1e-5, dropout 0), with and without --eod-mask-loss / --calculate-per-token-loss and
document masks, tied and untied embeddings; saving at iteration 5 and resuming must reproduce the
uninterrupted run's losses exactly. Worlds are shared: each world runs several layouts in turn.
"""

import os

import numpy as np
import pytest

from tests.dist import run_distributed

VOCAB = 127  # NullTokenizer: ids 0..126, end-of-document 127, vocabulary 128
ITERS = 10
CLIP = 0.3  # below every iteration's grad norm here: each step clips (folded into fused AdamW)

BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
    "--lr", "5e-3", "--min-lr", "5e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.1", "--clip-grad", str(CLIP),
    "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
    "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
    "--make-vocab-size-divisible-by", "64", "--split", "90,10,0",
    "--log-interval", "5", "--eval-interval", "5", "--eval-iters", "2", "--seed", "7",
    "--num-workers", "0",
]
UNTIED = ["--untie-embeddings-and-output-weights"]
MASKED = ["--eod-mask-loss", "--calculate-per-token-loss", "--reset-position-ids",
          "--reset-attention-mask"]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    """200 documents of 3..40 random tokens, each ended by the EOD token (127)."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    folder = tmp_path_factory.mktemp("e2e_data")
    prefix = str(folder / "tiny_text_document")
    rng = np.random.RandomState(0)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(200):
        doc = rng.randint(0, VOCAB, size=rng.randint(3, 41)).tolist() + [VOCAB]
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def _layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def _run_many(runs):
    """Run ``pretrain_llama.main`` for each ``(name, argv)`` in this world; the histories of the
    last rank (last pipeline stage) by name."""
    import torch.distributed as dist

    import pretrain_llama

    out = {}
    for name, argv in runs:
        history = pretrain_llama.main(argv)
        out[name] = history
        dist.barrier()
    return out if dist.get_rank() == dist.get_world_size() - 1 else None


def _argv(data_prefix, cache, *extra):
    return BASE + ["--data-path", data_prefix, "--data-cache-path", cache] + list(extra)


def _close(a, b, name):
    np.testing.assert_allclose(a["lm loss"], b["lm loss"], rtol=1e-5, err_msg=f"{name}: lm loss")
    np.testing.assert_allclose(a["grad norm"], b["grad norm"], rtol=1e-5, err_msg=f"{name}: grad norm")
    np.testing.assert_allclose([v for _, v in a["valid"]], [v for _, v in b["valid"]], rtol=1e-5,
                               err_msg=f"{name}: validation loss")


@pytest.fixture(scope="module")
def single(data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache1"))
    runs = [("untied", _argv(data_prefix, cache, *UNTIED)),
            ("masked", _argv(data_prefix, cache, *UNTIED, *MASKED)),
            ("tied", _argv(data_prefix, cache))]
    return run_distributed(1, _run_many, runs, timeout=600)[0]


def test_single_process_trains(single):
    losses = single["untied"]["lm loss"]
    assert len(losses) == ITERS and all(np.isfinite(losses))
    assert abs(losses[0] - np.log(128)) < 0.3, losses[0]  # starts near uniform over the vocabulary
    assert losses[-1] < losses[0]
    valid = single["untied"]["valid"]  # iterations 5 and 10, then the final evaluation
    assert [it for it, _ in valid] == [5, 10, 10] and valid[-1][1] == single["untied"]["final valid"]["lm loss"]
    assert len({v for _, v in valid}) == 3  # the validation stream moves on between evaluations
    assert single["masked"]["lm loss"] != single["untied"]["lm loss"]
    for name in ("untied", "masked", "tied"):  # clipping is active on every iteration
        assert min(single[name]["grad norm"]) > CLIP, (name, single[name]["grad norm"])


def test_two_rank_layouts_match_one_process(single, data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache2"))
    ckpt = str(tmp_path_factory.mktemp("ckpt2"))
    runs = []
    for tp, pp in ((2, 1), (1, 2), (1, 1)):  # (1, 1) on 2 ranks is DP=2
        runs.append((f"untied {tp}{pp}", _argv(data_prefix, cache, *UNTIED, *_layout(tp, pp))))
        runs.append((f"masked {tp}{pp}", _argv(data_prefix, cache, *UNTIED, *MASKED,
                                               *_layout(tp, pp))))
    runs.append(("tied 12", _argv(data_prefix, cache, *_layout(1, 2))))
    runs.append(("sp selective 21", _argv(data_prefix, cache, *UNTIED, *_layout(2, 1),
                                          "--sequence-parallel", "--recompute-activations")))
    runs.append(("full recompute 12", _argv(data_prefix, cache, *UNTIED, *_layout(1, 2),
                                            "--recompute-granularity", "full", "--recompute-method",
                                            "block", "--recompute-num-layers", "1")))
    # Save at 5 and stop, then resume from the checkpoint to 10.
    runs.append(("first half", _argv(data_prefix, cache, *UNTIED, *_layout(1, 2), "--save", ckpt,
                                     "--save-interval", "5", "--exit-interval", "5")))
    runs.append(("second half", _argv(data_prefix, cache, *UNTIED, *_layout(1, 2), "--load", ckpt)))
    out = run_distributed(2, _run_many, runs, timeout=600)[1]
    for tp, pp in ((2, 1), (1, 2), (1, 1)):
        _close(out[f"untied {tp}{pp}"], single["untied"], f"TP={tp} PP={pp} DP={2 // (tp * pp)}")
        _close(out[f"masked {tp}{pp}"], single["masked"], f"masked TP={tp} PP={pp}")
    _close(out["tied 12"], single["tied"], "tied embeddings PP=2")
    _close(out["sp selective 21"], single["untied"], "TP=2 --sequence-parallel --recompute-activations")
    _close(out["full recompute 12"], single["untied"], "PP=2 full block recompute")

    first, second, whole = out["first half"], out["second half"], out["untied 12"]
    assert first["iteration"] == [1, 2, 3, 4, 5] and second["iteration"] == [6, 7, 8, 9, 10]
    assert first["lm loss"] + second["lm loss"] == whole["lm loss"]  # exactly
    assert first["grad norm"] + second["grad norm"] == whole["grad norm"]
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000005"))) == ["mp_rank_00_000", "mp_rank_00_001"]


def test_tp2_pp2_dp2_matches_one_process(single, data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache8"))
    runs = [("untied", _argv(data_prefix, cache, *UNTIED, *_layout(2, 2))),
            ("masked", _argv(data_prefix, cache, *UNTIED, *MASKED, *_layout(2, 2)))]
    out = run_distributed(8, _run_many, runs, timeout=600)[7]
    _close(out["untied"], single["untied"], "TP=2 PP=2 DP=2")
    _close(out["masked"], single["masked"], "masked TP=2 PP=2 DP=2")

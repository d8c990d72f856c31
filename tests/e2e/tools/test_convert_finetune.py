"""A converted HuggingFace checkpoint trains: ``pretrain_llama.py --load DIR --finetune`` at TP=2
starts from the HF model's loss; Llama-3.1 ``rope_scaling`` goes through the training flags
(``--use-rope-scaling``) and ``--use-checkpoint-args``."""

import argparse

import pytest
import torch

from tests.helpers.convert import (HF_MODEL_FLAGS, LLAMA3_SCALING, convert, make_hf,
                                   one_document_dataset)
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")

SEQ, VOCAB = 64, 256  # NullTokenizer --vocab-size 255: ids 0..254 + EOD 255, no padding at TP=2
FLAGS = HF_MODEL_FLAGS + [
    "--seq-length", str(SEQ), "--use-rope-scaling", "--rope-scaling-factor", "8",
    "--rope-scaling-original-max-position-embeddings", "32",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
    "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--train-iters", "3", "--lr", "1e-3", "--min-lr", "1e-4", "--split", "100,0,0",
    "--log-interval", "1", "--eval-iters", "0", "--seed", "5", "--num-workers", "0",
    "--tensor-model-parallel-size", "2", "--finetune",
]


def _train(argv):
    import pretrain_llama
    return pretrain_llama.main(argv)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    model = make_hf(str(root / "hf"), vocab=VOCAB, rope_scaling=LLAMA3_SCALING)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "ours", "--target-tensor-parallel-size", 2)
    return root, model


def test_finetune_starts_at_hf_loss(converted):
    root, model = converted
    prefix = str(root / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    argv = FLAGS + ["--load", str(root / "ours"), "--data-path", prefix,
                    "--data-cache-path", str(root / "cache")]
    history = run_distributed(2, _train, argv, timeout=300)[0]
    tokens, labels = doc[None], torch.cat([doc[1:], doc[:1]])[None]
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(tokens).logits[0], labels[0]).item()
        # Unscaled rotary frequencies: the comparison below must tell them from the scaled ones.
        model.model.rotary_emb.inv_freq.copy_(1.0 / 50000.0 ** (torch.arange(0, 8, 2) / 8))
        unscaled = torch.nn.functional.cross_entropy(model(tokens).logits[0], labels[0]).item()
    assert abs(hf_loss - unscaled) > 1e-3
    losses = history["lm loss"]
    assert len(losses) == 3 and abs(losses[0] - hf_loss) < 1e-4, (losses, hf_loss)
    assert losses[-1] < losses[0]  # and it trains


def test_checkpoint_args_rebuild_the_scaled_model(converted):
    from megatron.arguments import load_args_from_checkpoint, parse_args
    from megatron.config import build_model_config

    root, _ = converted
    args = parse_args(["--load", str(root / "ours"), "--use-checkpoint-args"])
    changed = load_args_from_checkpoint(args)
    assert "use_rope_scaling" in changed and args.use_rope_scaling
    config = build_model_config(args, padded_vocab_size=VOCAB)
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    assert config.rotary_base == 50000.0 and config.num_query_groups == 2
    # A training checkpoint's flags (no rope_scaling dict) reach the converters too.
    from tools.checkpoint.loader_megatron import meta_from_args
    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, **{
        k: getattr(args, k) for k in ("use_rope_scaling", "rope_scaling_factor",
                                      "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                                      "rope_scaling_original_max_position_embeddings")}}
    assert meta_from_args(saved, 256, None)["rope_scaling"] == config.rope_scaling


def test_bad_rope_scaling_flags_are_refused():
    from megatron.config import rope_scaling_from_args

    args = argparse.Namespace(use_rope_scaling=True, rope_scaling_factor=8.0,
                              rope_scaling_low_freq_factor=4.0, rope_scaling_high_freq_factor=2.0,
                              rope_scaling_original_max_position_embeddings=8192)
    with pytest.raises(ValueError, match="--rope-scaling-high-freq-factor"):
        rope_scaling_from_args(args)
    args.rope_scaling_high_freq_factor = 4.0  # equal factors: Llama 4 Scout's 1 and 1
    assert rope_scaling_from_args(args)["high_freq_factor"] == 4.0
    args.rope_scaling_factor = 0.0
    with pytest.raises(ValueError, match="--rope-scaling-factor"):
        rope_scaling_from_args(args)
    assert rope_scaling_from_args(argparse.Namespace(use_rope_scaling=False)) is None

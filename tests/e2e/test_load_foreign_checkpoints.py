"""``pretrain_llama.py --load`` on checkpoints other systems wrote (``../shared/data``): a genuine
Megatron-LM checkpoint (Megatron-Core names, TP=2 x PP=2, no optimizer state) trains directly at
its layout, and at TP=1 after ``tools/checkpoint/convert.py``; both start at the loss that
transformers gives the source HF model on the same batch. A genuine Megatron-LLaMA checkpoint is
refused with the one command that converts it, and that command works."""

import os
import re
import shlex

import numpy as np
import pytest
import torch

from tests.helpers.convert import convert
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")

SEQ = 32
MLM = "megatron-lm-reference/checkpoints"
MLLAMA = "megatron-llama-reference"


def flags(vocab: int, eps: str, heads: int, groups: int, ffn: int):
    """The model and run flags of the reference models (NullTokenizer: ids 0..vocab-2 + EOD)."""
    return [
        "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", str(ffn),
        "--num-attention-heads", str(heads), "--group-query-attention", "--num-query-groups",
        str(groups), "--kv-channels", str(64 // heads), "--seq-length", str(SEQ),
        "--max-position-embeddings", "128", "--norm-epsilon", eps, "--rotary-base", "10000",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab - 1),
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3",
        "--lr", "1e-4", "--min-lr", "1e-5", "--split", "100,0,0", "--log-interval", "1",
        "--eval-iters", "0", "--seed", "5", "--num-workers", "0"]


def _train(argv):
    import pretrain_llama
    return pretrain_llama.main(argv)


def repeated_document(folder, vocab: int):
    """A dataset of one SEQ-token document, 50 times: every training sample is that document
    followed by its first token, whatever the shuffle. Returns ``(prefix, tokens, labels)``."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    doc = torch.randint(0, vocab - 1, (SEQ,), generator=torch.Generator().manual_seed(0))
    prefix = os.path.join(folder, "data")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(50):
        builder.add_item(doc.tolist())
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix, doc[None], torch.cat([doc[1:], doc[:1]])[None]


def hf_loss(hf_dir, tokens, labels) -> float:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(tokens).logits[0], labels[0]).item()


def first_losses(argv, world):
    histories = run_distributed(world, _train, argv, timeout=300)
    return next(h["lm loss"] for h in histories if h["lm loss"] and h["lm loss"][0] is not None)


def test_megatron_lm_checkpoint_trains_directly_and_after_conversion(shared_data, tmp_path):
    src = os.path.join(shared_data, MLM, "mcore-tp2pp2")
    prefix, tokens, labels = repeated_document(str(tmp_path), 1024)
    reference = hf_loss(os.path.join(shared_data, MLM, "hf-llama-tiny"), tokens, labels)
    common = flags(1024, "1e-5", 8, 4, 176) + ["--data-path", prefix, "--data-cache-path",
                                               str(tmp_path / "cache")]
    # directly, at the checkpoint's layout; no --finetune: it holds no optimizer state
    direct = first_losses(common + ["--load", src, "--tensor-model-parallel-size", "2",
                                    "--pipeline-model-parallel-size", "2"], 4)
    convert("--loader", "megatron", "--saver", "megatron", "--load-dir", src, "--save-dir",
            tmp_path / "tp1", "--target-tensor-parallel-size", 1)
    tp1 = first_losses(common + ["--load", str(tmp_path / "tp1"), "--finetune"], 1)
    print(f"HF loss {reference:.7f}; first losses: direct TP2xPP2 {direct}, converted TP1 {tp1}")
    assert abs(direct[0] - reference) < 1e-5 and abs(tp1[0] - reference) < 1e-5
    assert direct[-1] < direct[0] and tp1[-1] < tp1[0]  # and both train


def _load_only(argv):
    import pretrain_llama
    try:
        pretrain_llama.main(argv)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def test_megatron_llama_checkpoint_is_refused_with_the_converting_command(shared_data, tmp_path):
    src = os.path.join(shared_data, MLLAMA, "v1_tool_tp2pp1", "checkpoint")
    prefix, _, _ = repeated_document(str(tmp_path), 1000)
    argv = flags(1000, "1e-6", 4, 4, 176) + [
        "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"), "--load", src,
        "--finetune", "--make-vocab-size-divisible-by", "1"]
    message = run_distributed(1, _load_only, argv, timeout=120)[0]
    assert message is not None and "\n" not in message, message
    assert f"--load {src} is a Megatron-LLaMA checkpoint" in message, message
    command = re.search(r"convert it first: python tools/checkpoint/convert.py (.*), then train "
                        r"with --load (\S+) --finetune", message)
    assert command is not None, message
    words = shlex.split(command.group(1))
    assert words[words.index("--norm-epsilon") + 1] == "1e-06"  # the tool stores no epsilon
    words[words.index("--save-dir") + 1] = str(tmp_path / "converted")  # shared data is read-only
    convert(*words)
    saved = torch.load(tmp_path / "converted" / "release" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=True)["args"]
    assert saved["norm_epsilon"] == 1e-6 and saved["true_vocab_size"] == 1000

"""The continue-training workflow as a user runs it: a transformers LLaMA (std-0.2 weights, a
vocabulary of 251 that every layout pads) -> ``tools/checkpoint/convert.py`` -> ``pretrain_llama.py
--load ... --finetune`` at TP=2 (padded to 256) and at PP=2 (not padded).

- fp32: the first loss is transformers' loss on the same batch (1e-5; the padding rows never
  enter the softmax), and TP=2 with padding equals PP=2 without (rtol 1e-6) for 3 iterations.
- bf16 and fp16, plain and distributed optimizer: the first 3 losses are the fp32 fine-tune's
  within 1% (the optimizer's fp32 main params follow the loaded weights; without that, iteration
  2 restored the random initialisation: loss ln(251) = 5.5 instead of 6.5). At --lr 1e-5: a
  bf16 weight near 0.2 moves in steps of 1e-3, so larger rates make bf16 lag or overshoot fp32
  by itself (measured at iteration 3: 2.2% at 1e-4, 1.3% at 1e-3; 0.27% here).
- ``--lr 0``: after 3 iterations the saved weights equal the loaded ones exactly, for a
  ``--finetune`` load of the converter's release checkpoint and for a ``--no-load-optim`` load
  (without ``--finetune``) of a training checkpoint; a ``--finetune`` load of a ``torch_dist``
  checkpoint (saved at PP=2, read at TP=2) keeps its loss.
- the training checkpoint exports back to HF (``--loader megatron --saver hf``, no
  ``--true-vocab-size``): the HF model's 251-row vocabulary and the loaded weights.
"""

import glob
import os

import numpy as np
import pytest
import torch

from tests.helpers.convert import HF_MODEL_FLAGS, convert, make_hf, one_document_dataset
from tests.helpers.dist import run_distributed
from tests.helpers.pretrain import run_many

pytest.importorskip("transformers")

SEQ, VOCAB = 64, 251  # NullTokenizer --vocab-size 250: ids 0..249 + EOD 250
ITERS = 3
FLAGS = HF_MODEL_FLAGS + [
    "--seq-length", str(SEQ), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", str(ITERS),
    "--lr", "1e-5", "--min-lr", "1e-6", "--weight-decay", "0.1", "--split", "100,0,0",
    "--log-interval", "1", "--eval-iters", "0", "--seed", "5", "--num-workers", "0",
    "--initial-loss-scale", "4096",
]
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "128"]
PP2 = ["--pipeline-model-parallel-size", "2", "--make-vocab-size-divisible-by", "1"]


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """The converted checkpoints, the data, the HF loss on the batch, and every run's history."""
    root = tmp_path_factory.mktemp("finetune_workflow")
    model = make_hf(str(root / "hf"), vocab=VOCAB)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "tp2", "--target-tensor-parallel-size", 2, "--make-vocab-size-divisible-by", 128)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "pp2", "--target-pipeline-parallel-size", 2, "--make-vocab-size-divisible-by", 1)
    prefix = str(root / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    with torch.no_grad():
        labels = torch.cat([doc[1:], doc[:1]])
        hf_loss = torch.nn.functional.cross_entropy(model(doc[None]).logits[0], labels).item()

    def argv(load, layout, *extra):
        return FLAGS + layout + ["--load", str(root / load), "--data-path", prefix,
                                 "--data-cache-path", str(root / "cache"), *extra]

    lr0 = ["--lr", "0", "--min-lr", "0", "--bf16"]
    runs = [
        ("fp32 tp2", argv("tp2", TP2, "--finetune", "--save", str(root / "trained"),
                          "--save-interval", str(ITERS))),
        ("fp32 pp2", argv("pp2", PP2, "--finetune", "--save", str(root / "dist"),
                          "--save-interval", str(ITERS), "--ckpt-format", "torch_dist")),
        ("bf16 tp2", argv("tp2", TP2, "--finetune", "--bf16")),
        ("fp16 tp2", argv("tp2", TP2, "--finetune", "--fp16", "--use-distributed-optimizer")),
        ("bf16 pp2", argv("pp2", PP2, "--finetune", "--bf16", "--use-distributed-optimizer")),
        ("fp16 pp2", argv("pp2", PP2, "--finetune", "--fp16")),
        ("lr0 finetune", argv("tp2", TP2, "--finetune", *lr0, "--save", str(root / "lr0"),
                              "--save-interval", str(ITERS))),
        # a training checkpoint (with optimizer state) loaded without it: iterations 4..6
        ("lr0 no-load-optim", argv("trained", TP2, "--no-load-optim", *lr0,
                                   "--use-distributed-optimizer", "--train-iters", str(2 * ITERS),
                                   "--save", str(root / "lr0_noopt"),
                                   "--save-interval", str(2 * ITERS))),
        # the distributed checkpoint of the PP=2 run (251 rows), read at TP=2 (256 rows)
        ("lr0 torch_dist", argv("dist", TP2, "--finetune", *lr0)),
    ]
    histories = run_distributed(2, run_many, runs, timeout=600)[-1]
    return root, hf_loss, {name: h["lm loss"] for name, h in histories.items()}


def _model_tensors(folder):
    """{(shard, name): tensor} of the model weights in a checkpoint folder (iter_* or release)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt"))):
        state = torch.load(path, map_location="cpu", weights_only=True)
        for name, tensor in state["model"].items():
            if isinstance(tensor, torch.Tensor):
                out[(os.path.basename(os.path.dirname(path)), name)] = tensor
    assert out, folder
    return out


def test_fp32_finetune_starts_at_hf_loss_whatever_the_padding(workflow):
    _, hf_loss, losses = workflow
    for name in ("fp32 tp2", "fp32 pp2"):
        print(f"{name}: first loss {losses[name][0]:.7f}, transformers {hf_loss:.7f}, relative "
              f"difference {abs(losses[name][0] - hf_loss) / hf_loss:.1e}")
        assert len(losses[name]) == ITERS
        assert abs(losses[name][0] - hf_loss) <= 1e-5 * hf_loss, (name, losses[name][0], hf_loss)
    np.testing.assert_allclose(losses["fp32 pp2"], losses["fp32 tp2"], rtol=1e-6)
    assert losses["fp32 tp2"][-1] < losses["fp32 tp2"][0]  # it trains


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_half_precision_finetune_keeps_the_loaded_weights(workflow, precision, layout):
    _, _, losses = workflow
    got, want = losses[f"{precision} {layout}"], losses[f"fp32 {layout}"]
    assert len(got) == ITERS
    print(f"{precision} {layout}: {got} vs fp32 {want}")
    np.testing.assert_allclose(got, want, rtol=1e-2)


def test_lr0_saves_the_loaded_weights(workflow):
    root, hf_loss, losses = workflow
    for run, loaded, saved in (("lr0 finetune", "tp2/release", "lr0/iter_0000003"),
                               ("lr0 no-load-optim", "trained/iter_0000003",
                                "lr0_noopt/iter_0000006")):
        before, after = _model_tensors(str(root / loaded)), _model_tensors(str(root / saved))
        assert before.keys() == after.keys()
        for key, tensor in before.items():
            assert after[key].dtype == torch.bfloat16, (run, key)
            assert torch.equal(after[key], tensor.to(torch.bfloat16)), (run, key)
        assert len(set(losses[run])) == 1, (run, losses[run])  # the same weights, the same batch
    assert abs(losses["lr0 finetune"][0] - hf_loss) <= 1e-2 * hf_loss
    # a torch_dist --finetune load keeps its weights too: the loss stays that of the PP=2 run's
    # weights after its 3 iterations
    torch_dist = losses["lr0 torch_dist"]
    assert len(set(torch_dist)) == 1, torch_dist
    assert abs(torch_dist[0] - losses["fp32 pp2"][-1]) <= 1e-2 * hf_loss


def test_training_checkpoint_exports_to_hf(workflow):
    from transformers import LlamaForCausalLM

    root, _, _ = workflow
    # the README's command
    convert("--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir",
            root / "trained", "--save-dir", root / "exported")
    exported = LlamaForCausalLM.from_pretrained(str(root / "exported"))
    assert exported.config.vocab_size == VOCAB
    ours = _model_tensors(str(root / "trained/iter_0000003"))
    embedding = torch.cat([t for (shard, name), t in sorted(ours.items())
                           if name.endswith("word_embeddings.weight")])
    assert embedding.shape[0] == 256
    assert torch.equal(exported.model.embed_tokens.weight.detach(), embedding[:VOCAB])


def test_generate_rebuilds_the_run_tokenizer_and_never_samples_padding(workflow):
    """tools/generate.py on the TP=2 training checkpoint: the NullTokenizer of the run (its
    --vocab-size, EOD 250) and greedy samples over the 251 real ids only (the 5 padding rows hold
    zeros, logit 0: unmasked, they would win wherever every real logit is negative)."""
    from megatron.inference.launch import tokenizer_of
    from megatron.inference.model_loader import checkpoint_args
    from tools import generate

    root, _, _ = workflow
    load = str(root / "trained")
    saved = checkpoint_args(load)
    assert saved["true_vocab_size"] == VOCAB and saved["padded_vocab_size"] == 256
    tokenizer = tokenizer_of(generate.parse_args(["--load", load, "--prompt", "1"]), saved)
    assert (tokenizer.vocab_size, tokenizer.eod) == (VOCAB, VOCAB - 1)
    # a converted checkpoint records the true vocabulary only
    converted = {"tokenizer_type": "NullTokenizer", "true_vocab_size": VOCAB}
    tokenizer = tokenizer_of(generate.parse_args(["--load", load, "--prompt", "1"]), converted)
    assert (tokenizer.vocab_size, tokenizer.eod) == (VOCAB, VOCAB - 1)
    texts = run_distributed(2, generate.main, ["--load", load, "--prompt", "3 1 4 1 5",
                                               "--max-new-tokens", "16", "--greedy"])[0]
    ids = [int(w) for w in texts[0].split()]
    assert ids[:5] == [3, 1, 4, 1, 5] and len(ids) > 5 and max(ids) < VOCAB, ids

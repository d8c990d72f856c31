"""OLMoE at tensor-parallel size 2: its q/k RMSNorm over the whole projection width
(``--qk-layernorm-full-width``) takes the mean square across the tensor ranks (an all-reduce of
each rank's sum of squares) and its weights ``q_norm [nh d]``, ``k_norm [ng d]`` are sharded with
the heads. A tiny random ``OlmoeForCausalLM`` converted at TP2 and TP2 x EP2 gives transformers'
logits; the first training loss at TP2 (sequence parallelism, the converter's printed layout)
equals transformers' loss on the same batch; TP2 x EP2 -> HF and the TP2 training checkpoint ->
HF are bitwise; a ``torch_dist`` release loads at TP2 x EP2."""

import pytest
import torch

from tests.e2e.tools.test_convert_moe import (SEQ, TRAIN_FLAGS, VOCAB, _safetensors, _train,
                                              make_olmoe)
from tests.helpers.convert import (convert, megatron_logits, one_document_dataset,
                                   reference_logits)
from tests.helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")

OLMOE_FLAGS = ["--qk-layernorm", "--qk-layernorm-full-width", "--moe-router-pre-softmax"]


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("olmoe"))
    model = make_olmoe(folder)
    return (folder, model) + reference_logits(model, VOCAB)


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2)])
def test_olmoe_logits_at_tp2_equal_transformers(olmoe, tp, ep, tmp_path, capsys):
    folder, _, tokens, expected = olmoe
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ckpt", "--target-tensor-parallel-size", tp,
            "--target-expert-parallel-size", ep)
    assert "--qk-layernorm --qk-layernorm-full-width" in capsys.readouterr().out
    logits = megatron_logits(str(tmp_path / "ckpt"), tp, 1, tokens, ep)[..., :VOCAB]
    assert expected.abs().max() > 1.0
    diff = (logits - expected).abs().max().item()
    assert diff <= 3e-5, diff
    if ep == 2:  # and back: bitwise, the norm weights joined from their head shards
        convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "ckpt",
                "--save-dir", tmp_path / "back")
        original, exported = _safetensors(folder), _safetensors(tmp_path / "back")
        assert sorted(original) == sorted(exported)
        assert all(torch.equal(original[k], exported[k]) for k in original)


def test_olmoe_first_training_loss_at_tp2_equals_transformers(olmoe, tmp_path, capsys):
    folder, model, _, _ = olmoe
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "ours", "--target-tensor-parallel-size", 2)
    printed = capsys.readouterr().out.split()
    layout = printed[printed.index("--tensor-model-parallel-size"):printed.index("--load")]
    assert "--sequence-parallel" in layout, layout
    prefix = str(tmp_path / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    argv = TRAIN_FLAGS + OLMOE_FLAGS + [
        "--load", str(tmp_path / "ours"), "--data-path", prefix,
        "--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "run")] + layout
    history = run_distributed(2, _train, argv, timeout=300)[-1]
    labels = torch.cat([doc[1:], doc[:1]])
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(model(doc[None]).logits[0], labels).item()
    assert abs(history["lm loss"][0] - hf_loss) < 1e-5, (history["lm loss"], hf_loss)
    # The TP2 training checkpoint (lr 0 kept the weights) exports back bitwise.
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "run",
            "--save-dir", tmp_path / "back")
    original, exported = _safetensors(folder), _safetensors(tmp_path / "back")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_olmoe_torch_dist_release_loads_at_tp2(olmoe, tmp_path):
    """The layout-free ``torch_dist`` release holds the whole ``[nh d]`` norm weights; ``--load``
    at TP2 x EP2 cuts them with the heads (the parameters' ``partition_dim`` 0)."""
    from megatron.checkpointing import torch_dist

    folder, _, tokens, expected = olmoe
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", folder, "--save-dir",
            tmp_path / "dist", "--target-ckpt-format", "torch_dist")
    saved = torch_dist.read_tensors(str(tmp_path / "dist" / "release"))
    assert saved["layers.0.self_attention.q_layernorm.weight"].shape == (64,)
    logits = megatron_logits(str(tmp_path / "dist"), 2, 1, tokens, 2)[..., :VOCAB]
    assert (logits - expected).abs().max().item() <= 3e-5

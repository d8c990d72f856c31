"""A converted HuggingFace model trains without guesswork: ``convert.py --loader hf --saver
megatron`` prints the ``pretrain_llama.py`` flags the checkpoint needs, and those flags (plus data
and training flags) start at transformers' own loss on the same batch; ``--use-checkpoint-args``
rebuilds the same run from the checkpoint, tokenizer included, and never overrides a tokenizer
flag the user gave."""

import contextlib
import io
import json
import os
import shlex

import pytest
import torch

from tests.helpers.convert import LLAMA3_SCALING, convert, make_hf, one_document_dataset
from tests.helpers.dist import run_distributed

pytest.importorskip("transformers")

SEQ, VOCAB = 32, 251
TRAINING = ["--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-5", "--min-lr", "1e-6", "--split", "100,0,0",
            "--log-interval", "1", "--eval-iters", "0", "--seed", "5", "--num-workers", "0"]


def _hf_tokenizer(folder: str, vocab: int) -> None:
    """A word-level HuggingFace tokenizer of ``vocab`` ids (``</s>`` = 1 its end of document)
    written into the model's folder (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    backend = Tokenizer(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(folder)
    os.remove(os.path.join(folder, "tokenizer.model"))  # make_hf's stand-in file


def _run(argv):
    import pretrain_llama

    return pretrain_llama.main(argv)["lm loss"]


def _configured(argv):
    import pretrain_llama

    with contextlib.redirect_stdout(io.StringIO()):
        config, tokenizer = pretrain_llama.configure(argv)
    return config.data.tokenizer_type, config.data.tokenizer_name_or_path, tokenizer.vocab_size


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_flags")
    hf = str(root / "hf")
    model = make_hf(hf, vocab=VOCAB, rope_scaling=LLAMA3_SCALING)
    _hf_tokenizer(hf, VOCAB)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        convert("--loader", "hf", "--saver", "megatron", "--load-dir", hf, "--save-dir",
                root / "ours")
    prefix = str(root / "data")
    doc = one_document_dataset(prefix, SEQ, VOCAB)
    with torch.no_grad():
        labels = torch.cat([doc[1:], doc[:1]])
        hf_loss = torch.nn.functional.cross_entropy(model(doc[None]).logits[0], labels).item()
    data = ["--data-path", prefix, "--data-cache-path", str(root / "cache")]
    return root, out.getvalue(), hf, hf_loss, data


def _printed_flags(log: str) -> list:
    line = [x for x in log.splitlines() if x.startswith("pretrain_llama.py flags")]
    assert len(line) == 1, log
    return shlex.split(line[0].split("): ", 1)[1].split(";")[0])


def test_printed_flags_name_every_model_setting(converted):
    root, log, hf, _, _ = converted
    flags = _printed_flags(log)
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    value = {flags[i]: flags[i + 1] for i in range(len(flags) - 1)}
    # each against the HF config.json it comes from
    assert float(value["--norm-epsilon"]) == cfg["rms_norm_eps"]
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta"),
                                          **(cfg.get("rope_scaling") or {})}
    assert float(value["--rotary-base"]) == rope["rope_theta"]
    assert "--use-rope-scaling" in flags
    assert float(value["--rope-scaling-factor"]) == rope["factor"]
    assert int(value["--rope-scaling-original-max-position-embeddings"]) == \
        rope["original_max_position_embeddings"]
    assert int(value["--num-query-groups"]) == cfg["num_key_value_heads"]
    assert "--group-query-attention" in flags and "--untie-embeddings-and-output-weights" in flags
    assert int(value["--num-layers"]) == cfg["num_hidden_layers"]
    assert int(value["--ffn-hidden-size"]) == cfg["intermediate_size"]
    assert value["--tokenizer-type"] == "HuggingFaceTokenizer"
    assert value["--tokenizer-name-or-path"] == os.path.abspath(hf)
    assert flags[-2:] == ["--load", str(root / "ours")] or flags[-3:] == [
        "--load", str(root / "ours"), "--finetune"]


def test_printed_flags_train_from_the_hf_loss(converted):
    root, log, _, hf_loss, data = converted
    losses = run_distributed(1, _run, _printed_flags(log) + TRAINING + data, timeout=300)[0]
    assert abs(losses[0] - hf_loss) < 1e-4, (losses, hf_loss)


def test_use_checkpoint_args_reproduces_the_flags_and_keeps_given_tokenizer_flags(converted):
    root, log, hf, _, data = converted
    base = ["--load", str(root / "ours"), "--use-checkpoint-args", "--finetune"] + TRAINING + data
    printed = _printed_flags(log) + TRAINING + data
    from megatron.arguments import load_args_from_checkpoint, parse_args

    explicit = parse_args(printed)
    loaded = parse_args(base)
    load_args_from_checkpoint(loaded)
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "group_query_attention", "kv_channels",
                 "max_position_embeddings", "norm_epsilon", "rotary_base", "use_rope_scaling",
                 "rope_scaling_factor", "rope_scaling_low_freq_factor",
                 "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
                 "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
                 "tokenizer_type", "tokenizer_name_or_path", "seq_length"):
        assert getattr(loaded, name) == getattr(explicit, name) or (
            name == "tokenizer_type" and loaded.tokenizer_type == "PretrainedFromHF"), \
            (name, getattr(loaded, name), getattr(explicit, name))
    # the checkpoint's tokenizer (its HF folder, recorded as tokenizer_model too) is built
    kind, folder, vocab = run_distributed(1, _configured, base)[0]
    assert folder == os.path.abspath(hf) and vocab == VOCAB
    # a tokenizer the user names wins, whole: no flag of the checkpoint's tokenizer is mixed in
    given = run_distributed(1, _configured, base + ["--tokenizer-type", "NullTokenizer",
                                                    "--vocab-size", str(VOCAB - 1)])[0]
    assert given == ("NullTokenizer", None, VOCAB)


def _edited_hf(root, edit):
    folder = root / "hf"
    make_hf(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(cfg)))
    return folder


@pytest.mark.parametrize("edit, message", [
    (lambda c: [c], "a JSON list, not an object"),
    (lambda c: dict(c, rope_scaling=[1, 2]), "rope_scaling is a list, expected an object"),
    (lambda c: dict(c, num_hidden_layers=-1), "num_hidden_layers=-1 must be a positive integer"),
    (lambda c: dict(c, hidden_size="64"), "hidden_size='64' must be a positive integer"),
    (lambda c: dict(c, num_attention_heads=0), "num_attention_heads=0 must be a positive"),
    (lambda c: dict(c, num_hidden_layers=1), "num_hidden_layers=1, but the files hold "
                                             "model.layers.1."),
    (lambda c: dict(c, num_hidden_layers=3), "tensor model.layers.2."),
])
def test_a_config_that_contradicts_itself_or_its_weights_is_one_line(tmp_path, edit, message):
    """The fourth hostile pass: AttributeError / KeyError tracebacks, and a config counting
    fewer layers than the files hold converted with exit 0, dropping the other layers."""
    from tools.checkpoint import convert as tool

    folder = _edited_hf(tmp_path, edit)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = tool.command(["--loader", "hf", "--saver", "megatron", "--load-dir", str(folder),
                             "--save-dir", str(tmp_path / "out")])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err.getvalue()[-2000:]
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")

"""Tokenizers: Megatron's ids for SentencePiece models, HF and GPT-2 BPE against transformers,
NullTokenizer, vocabulary padding, and the errors for bad flags."""
import argparse
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron.tokenizer import TOKENIZER_TYPES, add_tokenizer_args, build_tokenizer, vocab_size_with_padding

from tests.helpers.paths import ROOT
TEXTS = ["Hello world, this is a test.", "  leading spaces\nand newlines\t tabs", "ünïcödé ✓ 漢字", ""]


def _args(**kw):
    base = dict(tokenizer_type=None, tokenizer_model=None, tokenizer_name_or_path=None,
                vocab_file=None, merge_file=None, vocab_size=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def spm_model(shared_data):
    return os.path.join(shared_data, "sentencepiece-llama-32k.model")


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_sentencepiece_megatron_ids(spm_model, kind):
    tok = build_tokenizer(_args(tokenizer_type=kind, tokenizer_model=spm_model))
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (32000, 2, 1, None)
    ids = tok.tokenize("Hello world")
    assert ids and ids[0] != tok.bos  # no BOS: Megatron's preprocessor writes none
    for text in TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize_batch(TEXTS, num_threads=2) == [tok.tokenize(t) for t in TEXTS]


def test_sentencepiece_ids_equal_megatron_reference(spm_model, shared_data):
    """Megatron-LM's own preprocessor wrote these ids: ours must be the same for every document."""
    from megatron.data.indexed_dataset import MMapIndexedDataset

    ref = os.path.join(shared_data, "megatron-lm-reference")
    tok = build_tokenizer(_args(tokenizer_type="SentencePieceTokenizer", tokenizer_model=spm_model))
    ds = MMapIndexedDataset(os.path.join(ref, "sample_text_document"))
    with open(os.path.join(ref, "sample.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert len(ds) == len(texts)
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]


def test_small_self_trained_sentencepiece(tmp_path):
    import sentencepiece as spm

    corpus = "\n".join(["the quick brown fox jumps over the lazy dog"] * 50 + ["pack my box with five dozen jugs"] * 50)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus.split("\n")), model_writer=model,
                                   vocab_size=40, model_type="bpe", minloglevel=2)
    path = tmp_path / "tiny.model"
    path.write_bytes(model.getvalue())
    tok = build_tokenizer(_args(tokenizer_type="Llama2Tokenizer", tokenizer_model=str(path)))
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert tok.vocab_size == sp.get_piece_size() == 40  # nothing added to the vocabulary
    assert tok.eod == sp.piece_to_id("</s>") == sp.eos_id()
    assert tok.tokenize("the lazy fox") == sp.encode("the lazy fox")


def _tiny_hf_folder(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return folder


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "PretrainedFromHF"])
def test_huggingface_tokenizer_equals_transformers(tmp_path, kind):
    folder = _tiny_hf_folder(str(tmp_path / "hf"))
    tok = build_tokenizer(_args(tokenizer_type=kind, tokenizer_name_or_path=folder))
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    assert (tok.bos, tok.eod, tok.pad) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (1, 2, 3)
    assert tok.vocab_size == len(ref)
    for text in ["the lazy dog", "quick brown fox jumps", ""]:
        assert tok.tokenize(text) == ref(text).input_ids  # BOS included, as HF does by default
        assert tok.tokenize(text)[0] == 1
    assert tok.tokenize_batch(["the dog", "a fox"], num_threads=2) == [tok.tokenize("the dog"), tok.tokenize("a fox")]
    assert tok.detokenize(tok.tokenize("the lazy dog")) == ref.decode(ref("the lazy dog").input_ids)


def test_gpt2_bpe_equals_transformers(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(["Hello world! The quick brown fox, the lazy dog's bone."] * 20, vocab_size=300,
                                special_tokens=["<|endoftext|>"], show_progress=False)
    trainer.save_model(str(tmp_path))
    vocab, merges = str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    tok = build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    from transformers import GPT2Tokenizer  # HF's GPT-2 configuration (pre-tokenizer, decoder) as reference

    ref = GPT2Tokenizer(vocab, merges)
    assert tok.eod == ref.convert_tokens_to_ids("<|endoftext|>") and tok.vocab_size == len(ref)
    for text in ["Hello world!", " The  quick\nbrown fox's bone", "ünïcödé"]:
        assert tok.tokenize(text) == ref.encode(text)
        assert tok.detokenize(tok.tokenize(text)) == text


def test_null_tokenizer():
    tok = build_tokenizer(_args(tokenizer_type="NullTokenizer", vocab_size=100))
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (101, 100, None, None)
    assert tok.tokenize(" 1 2\n99 ") == [1, 2, 99]
    assert tok.detokenize([1, 2, 99]) == "1 2 99"
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        tok.tokenize("1 100")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("1 x")


@pytest.mark.parametrize("kw, message", [
    (dict(tokenizer_type=None), "not supported"),
    (dict(tokenizer_type="Bogus"), "not supported"),
    (dict(tokenizer_type="SentencePieceTokenizer"), "--tokenizer-model"),
    (dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="missing.model"), "not found"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-name-or-path"),
    (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_name_or_path="meta-llama/Llama-2-7b-hf"), "not a local folder"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json"), "--vocab-file"),
    (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
])
def test_bad_flags(kw, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        build_tokenizer(_args(**kw))


def test_vocab_size_with_padding():
    assert vocab_size_with_padding(32000, 128, 1) == 32000
    assert vocab_size_with_padding(32000, 128, 3) == 32256
    assert vocab_size_with_padding(50257, 128, 2) == 50432
    assert vocab_size_with_padding(1, 128, 8) == 1024
    for n, d, t in [(7, 3, 2), (129, 64, 1), (5000, 8, 4)]:
        padded = vocab_size_with_padding(n, d, t)
        assert padded % (d * t) == 0 and n <= padded < n + d * t
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        vocab_size_with_padding(100, 0, 1)


def test_add_tokenizer_args():
    parser = add_tokenizer_args(argparse.ArgumentParser())
    args = parser.parse_args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "7"])
    assert build_tokenizer(args).vocab_size == 8
    assert set(TOKENIZER_TYPES) >= {"SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer"}


def test_import_does_not_load_torch():
    code = ("import sys, megatron.tokenizer as t; from types import SimpleNamespace as N; "
            "t.build_tokenizer(N(tokenizer_type='NullTokenizer', vocab_size=3)); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

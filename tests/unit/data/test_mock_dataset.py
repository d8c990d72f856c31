"""--mock-data: megatron.data.mock_dataset's samples and the flag's validation."""

import numpy as np
import pytest

from megatron.arguments import parse_args, validate_args
from megatron.data.mock_dataset import MockGPTDataset, build_mock_datasets
from megatron.usage_error import UsageError

MOCK_ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 "
             "--train-iters 4 --tokenizer-type NullTokenizer --vocab-size 127 --mock-data").split()


def _documents(tokens, eod):
    """The runs of non-EOD tokens between EODs (the first and last may be cut by the sample)."""
    cuts = np.flatnonzero(tokens == eod)
    return [d for d in np.split(tokens, cuts) if d.size]


@pytest.mark.parametrize("vocab, eod", [(128, 127), (100, 3), (2, 0)])
def test_samples_count_upwards_between_end_of_document_ids(vocab, eod):
    ds = MockGPTDataset(50, 64, vocab, eod, seed=7)
    non_eod = np.array([i for i in range(vocab) if i != eod])  # the ids a document uses, in order
    rank = {int(t): i for i, t in enumerate(non_eod)}
    eods = 0
    for i in range(len(ds)):
        tokens = ds[i]["text"]
        assert tokens.dtype == np.int64 and tokens.shape == (65,)
        assert tokens.min() >= 0 and tokens.max() < vocab
        eods += int((tokens == eod).sum())
        for doc in _documents(tokens, eod):
            doc = doc[doc != eod]
            steps = np.diff([rank[int(t)] for t in doc]) % len(non_eod)
            assert (steps == 1 % len(non_eod)).all(), (i, doc)
            assert len(doc) <= 32  # documents of 1 .. seq_length // 2 tokens
    assert eods >= 50 * 2  # at least two documents end in each sample of 65 tokens


def test_a_sample_depends_on_seed_split_and_index_only():
    a = MockGPTDataset(10, 32, 128, 127, seed=1)
    longer = MockGPTDataset(1000, 32, 128, 127, seed=1)  # another run length: same samples
    for i in range(10):
        assert np.array_equal(a[i]["text"], longer[i]["text"])
        assert np.array_equal(a[i]["text"], MockGPTDataset(10, 32, 128, 127, seed=1)[i]["text"])
    other_seed = MockGPTDataset(10, 32, 128, 127, seed=2)
    valid = MockGPTDataset(10, 32, 128, 127, seed=1, split="valid")
    assert not any(np.array_equal(a[i]["text"], other_seed[i]["text"]) for i in range(10))
    assert not any(np.array_equal(a[i]["text"], valid[i]["text"]) for i in range(10))
    assert not np.array_equal(a[0]["text"], a[1]["text"])
    with pytest.raises(IndexError):
        a[10]


def test_build_gives_the_requested_samples_and_no_empty_split():
    train, valid, test = build_mock_datasets([40, 16, 0], seq_length=8, vocab_size=64, eod=63,
                                             seed=3)
    assert (len(train), len(valid), test) == (40, 16, None)
    assert (train.split, valid.split) == ("train", "valid")


def test_bad_vocabulary_is_refused():
    with pytest.raises(ValueError, match="end-of-document"):
        MockGPTDataset(4, 8, 64, 64, seed=0)
    with pytest.raises(ValueError, match="at least 2"):
        MockGPTDataset(4, 8, 1, 0, seed=0)


def test_mock_data_validates_without_data_or_tokenizer_files():
    args = validate_args(parse_args(MOCK_ARGV), 1)
    assert args.mock_data and args.data_path is None


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path", "--valid-data-path",
                                  "--test-data-path"])
def test_mock_data_with_a_data_path_is_one_line(flag):
    with pytest.raises(UsageError) as err:
        validate_args(parse_args(MOCK_ARGV + [flag, "corpus_text_document"]), 1)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"--mock-data and {flag} (corpus_text_document) are mutually "
                              "exclusive")
    assert f"remove {flag} or --mock-data" in message

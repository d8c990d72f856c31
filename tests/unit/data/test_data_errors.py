"""Bad data named by file and flag (issue 29): ids outside the vocabulary found when the datasets
are opened (files up to the scan limit) and, per batch, named by every data flag; a ``.bin``
truncated under a running job named instead of a SIGBUS, in the process and in a DataLoader
worker."""

import os

import numpy as np
import pytest
import torch

from megatron.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from megatron.data.token_range import check_token_ranges, out_of_vocabulary
from tests.helpers.data import write_dataset


def _docs(high, n=40, seed=0):
    rng = np.random.RandomState(seed)
    docs = [rng.randint(0, high, size=rng.randint(3, 30)).tolist() for _ in range(n)]
    return docs, max(max(d) for d in docs)


def test_an_id_outside_the_vocabulary_is_named_with_its_flag_and_file(tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    write_dataset(good, _docs(100)[0])
    docs, high = _docs(300, seed=1)
    write_dataset(bad, docs)
    with pytest.raises(ValueError) as err:
        check_token_ranges(200, "--tokenizer-type NullTokenizer --vocab-size 199", data_path=None,
                           split="1,0,0", train_data_path=[good], valid_data_path=[bad])
    assert str(err.value) == (f"--valid-data-path ({bad}): token id {high} in {bad}.bin is outside "
                              "the vocabulary [0, 200) of --tokenizer-type NullTokenizer "
                              "--vocab-size 199: the data was tokenized with another tokenizer; "
                              "pass that tokenizer's flags, or re-run tools/preprocess_data.py "
                              "with this one")
    # in a --data-path blend: the flag that named it
    assert out_of_vocabulary("--data-path", bad, 200).startswith(f"--data-path ({bad}): token id "
                                                                 f"{high} ")
    assert out_of_vocabulary("--data-path", bad, high + 1) is None  # the max is the oracle
    # a file above the scan limit is left to the batch check
    assert out_of_vocabulary("--data-path", bad, 200, limit_bytes=16) is None
    check_token_ranges(200, "", data_path=[good], split="1,0,0")


def test_the_batch_check_names_every_data_flag():
    from megatron.config import DataConfig
    from pretrain_llama import check_token_ids

    data = DataConfig(seq_length=16, train_data_path=["a"], valid_data_path=["v1", "v2"],
                      tokenizer_type="NullTokenizer", vocab_size=127)
    with pytest.raises(ValueError) as err:
        check_token_ids(torch.tensor([[1, 200]]), 128, data)
    assert str(err.value).startswith("token id 200 in a batch read from --train-data-path (a) or "
                                     "--valid-data-path (v1 v2) is outside the vocabulary [0, 128) "
                                     "of --tokenizer-type NullTokenizer --vocab-size 127:")
    check_token_ids(torch.tensor([[0, 127]]), 128, data)


class _Sequences(torch.utils.data.Dataset):
    def __init__(self, prefix):
        self.data = MMapIndexedDataset(prefix)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.data[i], dtype=np.int64))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_bin_truncated_under_the_job_is_named(tmp_path, workers):
    prefix = str(tmp_path / "data")
    docs = [list(range(i, i + 2000)) for i in range(0, 40)]  # 40 x 4000 bytes: several pages
    write_dataset(prefix, docs)
    loader = torch.utils.data.DataLoader(_Sequences(prefix), batch_size=None, num_workers=workers)
    first = MMapIndexedDataset(prefix)
    size = os.path.getsize(prefix + ".bin")
    assert list(first[39]) == docs[39]
    os.truncate(prefix + ".bin", size // 2)  # as another process would, under the open maps
    assert list(first[0]) == docs[0]  # what lies before the new end still reads
    with pytest.raises(IndexedDatasetError) as err:
        first.get(39)
    assert str(err.value) == (f"{prefix}.bin: truncated while this job runs: {size // 2} bytes now, "
                              f"{size} when opened, and {prefix}.idx needs {size}; restore the file "
                              "(or re-run tools/preprocess_data.py) and resume from the last "
                              "checkpoint")
    with pytest.raises(Exception) as err:  # a worker's error is re-raised here, not a SIGBUS
        for _ in loader:
            pass
    assert f"{prefix}.bin: truncated while this job runs" in str(err.value)

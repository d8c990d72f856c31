"""Pretraining samplers: data-parallel sharding, exact resume from consumed_samples, the loader."""
import numpy as np
import pytest
import torch

from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.samplers import (MegatronPretrainingRandomSampler, MegatronPretrainingSampler,
                                    build_pretraining_data_loader, cyclic_iter)
from tests.helpers.data import random_docs, write_dataset


def _global_stream(make_sampler, dp, steps):
    """Per step, the global batch: the micro-batches of ranks 0..dp-1 concatenated."""
    iters = [iter(make_sampler(r)) for r in range(dp)]
    return [sum((next(it) for it in iters), []) for _ in range(steps)]


@pytest.mark.parametrize("dp,mbs", [(1, 3), (2, 2), (4, 1)])
def test_single_sampler_order_and_resume(dp, mbs):
    total, gbs = 50, dp * mbs
    stream = _global_stream(lambda r: MegatronPretrainingSampler(total, 0, mbs, r, dp), dp, total // gbs)
    assert sum(stream, []) == list(range(total // gbs * gbs))  # in order, no gaps, last partial dropped
    for k in (1, 3):
        resumed = _global_stream(lambda r: MegatronPretrainingSampler(total, k * gbs, mbs, r, dp), dp,
                                 total // gbs - k)
        assert resumed == stream[k:]


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("dp,mbs", [(1, 2), (2, 3)])
def test_cyclic_sampler_epochs_and_resume(dp, mbs, sharding):
    total, gbs = 41, dp * mbs
    per_epoch = total // gbs

    def make(r, consumed=0):
        return MegatronPretrainingRandomSampler(total, consumed, mbs, r, dp, data_sharding=sharding)

    samplers = [make(r) for r in range(dp)]
    epochs = []
    for _ in range(3):  # each pass over the samplers is one epoch, as cyclic_iter drives them
        its = [iter(s) for s in samplers]
        epochs.append([sum((next(it) for it in its), []) for _ in range(per_epoch)])
    flat0 = sum(epochs[0], [])
    assert len(set(flat0)) == len(flat0) == per_epoch * gbs and max(flat0) < total
    assert epochs[0] != epochs[1]  # reshuffled
    full = sum(epochs, [])
    for k in (2, per_epoch, per_epoch + 3):
        resumed_samplers = [make(r, k * gbs) for r in range(dp)]
        got = []
        while len(got) < len(full) - k:
            its = [iter(s) for s in resumed_samplers]
            for _ in range(per_epoch - (k + len(got)) % per_epoch):
                got.append(sum((next(it) for it in its), []))
        assert got == full[k:]


def test_sampler_errors():
    with pytest.raises(ValueError, match="no samples left"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="data-parallel rank 2"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        iter(MegatronPretrainingRandomSampler(10, 3, 2, 0, 1)).__next__()


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_data_loader_batches_and_resume(tmp_path, dataloader_type):
    prefix = write_dataset(str(tmp_path / "c"), random_docs(np.random.RandomState(0), 30))
    ds = GPTDataset(MMapIndexedDataset(prefix), prefix, np.arange(30, dtype=np.int32), 40, 8, 1)
    kw = dict(micro_batch_size=2, data_parallel_size=2, dataloader_type=dataloader_type)
    loaders = [build_pretraining_data_loader(ds, 0, data_parallel_rank=r, **kw) for r in range(2)]
    first = [list(zip(range(6), cyclic_iter(loader))) for loader in loaders]
    batch = first[0][0][1]["text"]
    assert batch.dtype == torch.int64 and batch.shape == (2, 9)
    if dataloader_type == "single":
        expected = torch.from_numpy(np.stack([ds[i]["text"] for i in (2, 3)]))
        assert torch.equal(first[1][0][1]["text"], expected)
    resumed = build_pretraining_data_loader(ds, 3 * 4, data_parallel_rank=1, **kw)
    for (_, want), got in zip(first[1][3:], resumed):
        assert torch.equal(want["text"], got["text"])
    assert build_pretraining_data_loader(None, 0, data_parallel_rank=0, **kw) is None
    with pytest.raises(ValueError, match="--dataloader-type 'external'"):
        build_pretraining_data_loader(ds, 0, data_parallel_rank=0, micro_batch_size=2, data_parallel_size=1,
                                      dataloader_type="external")


def test_data_loader_with_workers(tmp_path):
    prefix = write_dataset(str(tmp_path / "c"), random_docs(np.random.RandomState(1), 20))
    ds = GPTDataset(MMapIndexedDataset(prefix), prefix, np.arange(20, dtype=np.int32), 12, 8, 1)
    kw = dict(micro_batch_size=3, data_parallel_rank=0, data_parallel_size=1)
    plain = [b["text"] for b in build_pretraining_data_loader(ds, 0, **kw)]
    workers = [b["text"] for b in build_pretraining_data_loader(ds, 0, num_workers=1, **kw)]
    assert len(plain) == len(ds) // 3 and all(torch.equal(a, b) for a, b in zip(plain, workers))

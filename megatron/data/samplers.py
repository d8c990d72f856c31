"""Megatron's pretraining samplers and data loader (``--dataloader-type single|cyclic``).

A global batch of ``micro_batch_size * data_parallel_size`` consecutive samples is cut into one
micro-batch per data-parallel rank: rank ``r`` takes positions ``[r * mbs, (r + 1) * mbs)``.
Training state is the number of samples consumed by all ranks together (``consumed_samples``), so
resuming from a checkpoint continues the identical stream, with sample-based (``--train-samples``)
and iteration-based (``--train-iters``) training alike. Source: Megatron-LM
``megatron/legacy/data/data_samplers.py`` (``MegatronPretrainingSampler``,
``MegatronPretrainingRandomSampler``).
"""

from __future__ import annotations

import functools
import random
from typing import Iterable, Iterator, List

import numpy as np
import torch


def _check(total_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int):
    if total_samples <= 0:
        raise ValueError(f"the dataset has no samples to consume ({total_samples})")
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data-parallel rank {data_parallel_rank} outside [0, {data_parallel_size})")


class MegatronPretrainingSampler:
    """Sequential batches (``--dataloader-type single``): samples ``consumed_samples, ...`` in order.

    Yields lists of ``micro_batch_size`` sample indices for this data-parallel rank; a final
    incomplete global batch is dropped unless ``drop_last=False``.

    Raises:
        ValueError: no samples, ``consumed_samples >= total_samples`` (the run has used the whole
            dataset: build it with more samples), or a bad batch size or rank.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        _check(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples ({consumed_samples}) must lie in [0, {total_samples}): "
                             "no samples left; request more (--train-samples/--train-iters)")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _mine(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start:start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.global_batch:
                yield self._mine(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._mine(batch)


class MegatronPretrainingRandomSampler:
    """Shuffled epochs (``--dataloader-type cyclic``), resumable from ``consumed_samples``.

    Epoch ``e`` is a ``torch.randperm`` drawn from a generator seeded with ``e`` (as Megatron),
    over the whole dataset rounded down to full micro-batches; with ``data_sharding`` (Megatron's
    default) each data-parallel rank permutes its own contiguous bucket instead. One iteration
    covers the rest of the current epoch; iterating again continues with the next epoch.

    Raises:
        ValueError: no samples, a bad batch size or rank, or ``consumed_samples`` not on a global
            batch boundary within the epoch.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True):
        _check(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.global_batch = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.global_batch
        if total_samples < self.global_batch:
            raise ValueError(f"the dataset's {total_samples} samples do not fill one global batch of "
                             f"{self.global_batch}")

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        if current_epoch_samples % self.global_batch:
            raise ValueError(f"consumed_samples ({self.consumed_samples}) is not a multiple of the "
                             f"global batch ({self.global_batch}) within the epoch")
        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.global_batch) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start_idx = self.data_parallel_rank * bucket_size
            random_idx = torch.randperm(bucket_size, generator=g).tolist()
            idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            idx_range_total = torch.randperm(full_bucket_size, generator=g).tolist()
            idx_range = idx_range_total[current_epoch_samples:][self.data_parallel_rank::self.data_parallel_size]
        batch = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.global_batch
                yield batch
                batch = []


def _seed_worker(seed: int, rank_pid, worker_id: int) -> None:
    from megatron.data.loader_workers import guard_loader_worker

    # ignore the launcher's SIGTERM/SIGINT, die with the rank (issue 31)
    guard_loader_worker(parent_pid=rank_pid)
    random.seed(seed + worker_id)
    np.random.seed((seed + worker_id) % 2**32)


def cyclic_iter(iterable: Iterable):
    """Iterate ``iterable`` again and again (the cyclic loader's endless stream, as Megatron)."""
    while True:
        for x in iterable:
            yield x


def build_pretraining_data_loader(dataset, consumed_samples: int, *, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  dataloader_type: str = "single", num_workers: int = 0,
                                  seed: int = 1234, data_sharding: bool = True):
    """A ``torch.utils.data.DataLoader`` yielding ``{"text": LongTensor [b, seq_length + 1]}``.

    Args:
        dataset: a ``GPTDataset`` or ``BlendedDataset`` (or None: returns None).
        consumed_samples: samples already consumed by all data-parallel ranks together.
        micro_batch_size: ``b``; data_parallel_rank / data_parallel_size: this rank's place.
        dataloader_type: ``"single"`` (in order) or ``"cyclic"`` (shuffled epochs; wrap the loader
            in :func:`cyclic_iter` for an endless stream).
        num_workers: ``--num-workers`` loader processes.
        seed: seeds ``random``/``numpy`` in each worker (``seed + worker id``), so any
            randomness a dataset adds is reproducible.
        data_sharding: cyclic only; Megatron's ``--data-sharding``.

    Raises:
        ValueError: an unknown ``dataloader_type`` (the message lists the choices), or the
            sampler's errors.
    """
    if dataset is None:
        return None
    rank_pid = None
    if num_workers > 0:  # its workers ignore SIGTERM: a crash must not wait for them (issue 31)
        from megatron.data.loader_workers import helper_parent_pid, kill_loader_workers_at_exit
        kill_loader_workers_at_exit()
        rank_pid = helper_parent_pid()
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                             data_parallel_rank, data_parallel_size)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(len(dataset), consumed_samples, micro_batch_size,
                                                   data_parallel_rank, data_parallel_size, data_sharding)
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not supported; use single or cyclic")

    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers,
        worker_init_fn=functools.partial(_seed_worker, seed, rank_pid),
        # Each iter() draws a base seed; from its own generator it leaves the global torch stream
        # (dropout) alone, so a resumed run draws the same masks as an uninterrupted one.
        generator=torch.Generator().manual_seed(seed),
        pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0)

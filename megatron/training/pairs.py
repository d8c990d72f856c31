"""What the two preference-pair stages share (DPO, megatron/training/dpo.py; the reward model,
megatron/training/reward_model.py): their flag checks, datasets and micro-batches.

A micro-batch holds ``--micro-batch-size / 2`` whole pairs as rows chosen, rejected, chosen, ...
(:class:`~megatron.data.preference_dataset.PreferenceDataset`); ``--global-batch-size`` counts rows.
"""

from __future__ import annotations

import os

import torch

from megatron.usage_error import UsageError


def check_pair_flags(config, stage: str) -> None:
    """Refuse flags that would cut pairs or that the pair stages do not read (``stage``: the flag
    named in messages, ``--dpo`` or ``--reward-model``), before any process group exists.

    Raises:
        UsageError: an odd ``--micro-batch-size``, context parallelism, ``--dataloader-type
            cyclic``, ``--rampup-batch-size``, a data flag other than one ``--data-path
            {prefix}_chosen_document`` with its three companions beside it.
    """
    from megatron.data.preference_dataset import CHOSEN, rejected_prefix

    training = config.training
    if training.micro_batch_size % 2:
        raise UsageError(f"--micro-batch-size {training.micro_batch_size}: {stage} needs an even "
                         "number of rows per micro-batch (a chosen and a rejected row per pair)")
    if config.parallel.context_parallel_size > 1:
        raise UsageError(f"--context-parallel-size {config.parallel.context_parallel_size}: "
                         f"{stage} does not support context parallelism; use 1")
    if config.data.dataloader_type != "single":
        raise UsageError(f"--dataloader-type {config.data.dataloader_type}: {stage} reads pairs "
                         "in order (--dataloader-type single; the pairs are shuffled per epoch)")
    if training.rampup_batch_size:
        raise UsageError(f"--rampup-batch-size: not supported with {stage} (a ramp step could cut "
                         "a pair); give a fixed --global-batch-size")
    data = config.data
    paths = [str(p) for p in (data.data_path or ())]
    if (data.mock_data or data.train_data_path or data.valid_data_path or data.test_data_path
            or len(paths) != 1 or not paths[0].endswith(CHOSEN)):
        raise UsageError(f"--data-path {' '.join(paths)}: {stage} reads exactly one "
                         f"{{prefix}}{CHOSEN} (and --split) written by "
                         "tools/preprocess_sft_data.py --preference-pairs")
    for prefix in (paths[0], rejected_prefix(paths[0])):
        for name in (prefix, prefix[:-len("_document")] + "_loss_mask_document"):
            if not (os.path.isfile(name + ".bin") and os.path.isfile(name + ".idx")):
                raise UsageError(f"--data-path {paths[0]}: {name}.bin/.idx is missing; write "
                                 "the four datasets with tools/preprocess_sft_data.py "
                                 "--preference-pairs in one run")


def pair_datasets(config, train_val_test_num_samples, pad_id: int, what: str) -> tuple:
    """``(train, valid, test)`` :class:`PreferenceDataset` s of ``--data-path``'s pairs cut by
    ``--split`` (:func:`megatron.training.document_splits.split_datasets`); ``what`` names the stage
    in the log line."""
    from megatron.training.document_splits import split_datasets
    from megatron.data.preference_dataset import PreferenceDataset

    data = config.data

    def make(name, documents, n):
        return PreferenceDataset(str(data.data_path[0]), data.seq_length,
                                 seed=config.training.seed, num_samples=n, documents=documents,
                                 pad_id=pad_id)

    return split_datasets(config, train_val_test_num_samples,
                          what + " ({count} preference pairs)", make)


def pair_batch(sample, device, check_ids):
    """``(tokens, labels, loss_mask, position_ids, lengths, pair_index)`` of a collated micro-batch
    of :class:`~megatron.data.preference_dataset.PreferenceDataset` rows: ``[2m, s]`` int64,
    int64, fp32, int64, ``[2m]`` int64 and ``[m]`` int64 (one index per pair).

    ``check_ids(tokens)`` refuses token ids outside the vocabulary (the entry script's
    ``check_token_ids``).

    Raises:
        ValueError: a token id outside the vocabulary; rows that are not whole pairs.
    """
    tokens = torch.as_tensor(sample["tokens"]).long()
    labels = torch.as_tensor(sample["labels"]).long()
    check_ids(torch.cat([tokens, labels]))
    index = torch.as_tensor(sample["pair_index"]).long().reshape(-1)
    if index.numel() % 2 or not torch.equal(index[0::2], index[1::2]):
        raise ValueError(f"a micro-batch holds rows of pairs {index.tolist()}: the rows of a "
                         "pair must come together (chosen, rejected)")
    return (tokens.to(device), labels.to(device),
            torch.as_tensor(sample["loss_mask"]).float().to(device),
            torch.as_tensor(sample["position_ids"]).long().to(device),
            torch.as_tensor(sample["length"]).long().reshape(-1).to(device), index[0::2])


def report_sums(values) -> tuple:
    """``values`` (a list of ``[m]`` tensors, the last the pairs' count as a 0-d tensor) summed
    over this rank's pairs: the logged ``(sum, count)`` s, which the training step sums over the
    micro-batches and the data-parallel group in one all-reduce
    (``megatron.training.train.reduce_loss_dicts``)."""
    report = torch.stack([v.detach().float().sum() for v in values])
    return [(report[i], report[-1]) for i in range(len(values) - 1)]

"""DPO training (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7):
``finetune_llama.py --dpo``. Megatron-LM has no DPO; the flags follow NeMo-Aligner's / TRL's terms
(``--dpo-beta``, an SFT term, length normalisation).

Data: ``--data-path {prefix}_chosen_document`` of ``tools/preprocess_sft_data.py
--preference-pairs`` (the rejected side and both loss masks beside it), read by
:class:`~megatron.data.preference_dataset.PreferenceDataset`: rows chosen, rejected, chosen,
rejected, ... so a micro-batch of ``--micro-batch-size`` (even) rows holds
``micro-batch-size / 2`` whole pairs. ``--global-batch-size`` counts rows (two per pair).

Reference model: **the loaded weights, evaluated once before training**.
:meth:`DPO.reference_pass` runs every pair the run will read (the train, validation and test
samples) through the pipeline (forward only, eval mode, no dropout) and caches the reference
log-probabilities of both responses, indexed by pair, on every rank (a ``[pairs, 2]`` fp32 table,
filled on the last pipeline stage: 8 bytes per pair, no second model in memory). Each data-parallel rank computes a share; the shares are summed over the data-parallel
group.

Sequence log-probabilities: the model's per-token loss is the vocabulary-parallel cross entropy
(reduced over the tensor-parallel group, on the last pipeline stage); a row's log-probability is
minus its masked sum over the response labels (:func:`~megatron.training.dpo_loss.sequence_logps`,
divided by the response length with ``--dpo-length-normalization``).

Loss per pair: ``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` plus
``--dpo-sft-weight`` times the chosen response's per-token NLL; the iteration's loss is the mean
over the pairs of the global batch (the schedule's ``(sum, count)`` with count = pairs). Logged:
``dpo loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies`` (means over the global batch's pairs), ``logps/chosen``,
``logps/rejected`` (the policy's mean sequence log-probabilities), in the iteration line, the
validation block, TensorBoard and the returned history.

Resume: the table is saved with the run (``{--save}/dpo_reference.npz``,
:mod:`megatron.training.dpo_reference`); ``--load`` of that save without ``--finetune`` reads it
instead of recomputing it from the partly trained weights, and refuses one that is missing or does
not fit the run.

Not supported (refused with one line): context parallelism, ``--dataloader-type cyclic`` and
``--rampup-batch-size`` (they would split pairs).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.config.sections import ConfigSection
from megatron.training.dpo_loss import dpo_loss, sequence_logps
from megatron.training.dpo_reference import (check_pairs, read_reference, run_meta,
                                             save_reference)
from megatron.training.pairs import pair_batch, report_sums
from megatron.training.logging import print_rank_last
from megatron.usage_error import UsageError

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@dataclass(frozen=True)
class DPOConfig:
    """The DPO flags (``config.extra["dpo"]``)."""

    dpo: bool = False
    """``--dpo``: train on preference pairs with the DPO loss instead of SFT. Default off."""

    dpo_beta: float = 0.1
    """``--dpo-beta``: the DPO temperature beta (> 0). Default 0.1."""

    dpo_sft_weight: float = 0.0
    """``--dpo-sft-weight``: weight of the chosen responses' per-token NLL added to each pair's
    loss (RPO, Pang et al. 2024). Default 0 (pure DPO)."""

    dpo_length_normalization: bool = False
    """``--dpo-length-normalization``: sequence log-probabilities divided by the response length
    (per-token mean). Default off (sums, as the paper)."""


def add_dpo_args(parser):
    """The DPO flags (Megatron's ``extra_args_provider``)."""
    group = parser.add_argument_group("direct preference optimization")
    group.add_argument("--dpo", action="store_true",
                       help="train on preference pairs ({prefix}_chosen_document) with the DPO loss")
    group.add_argument("--dpo-beta", type=float, default=0.1, help="DPO temperature (> 0)")
    group.add_argument("--dpo-sft-weight", type=float, default=0.0,
                       help="weight of the chosen responses' per-token NLL (0: pure DPO)")
    group.add_argument("--dpo-length-normalization", action="store_true",
                       help="per-token mean log-probabilities instead of sums")
    return parser


DPO_SECTION = ConfigSection("dpo", DPOConfig, add_dpo_args)


def check_stage_flags(config, given_sft: dict, given_dpo: dict) -> None:
    """Refuse a stage's flags given to another stage of ``finetune_llama.py``, where they would be
    ignored: a ``--dpo-*`` flag without ``--dpo`` (SFT or ``--reward-model``), an SFT flag with
    ``--dpo`` or ``--reward-model``. ``given_*``: :meth:`ConfigSection.given` of the SFT and DPO
    sections (``{dest: option as typed}``).

    Raises:
        UsageError: naming the flag and the stage that ignores it.
    """
    reward = config.extra["reward"].reward_model
    dpo = config.extra["dpo"].dpo
    stage = "--reward-model" if reward else "--dpo" if dpo else "SFT (no --dpo or --reward-model)"
    def named(options):
        return " ".join(options), ("it" if len(options) == 1 else "them"), (
            "is" if len(options) == 1 else "are")

    ignored = sorted(o for d, o in given_dpo.items() if d != "dpo") if not dpo else []
    if ignored:
        flags, it, verb = named(ignored)
        raise UsageError(f"{flags} {verb} {'a DPO flag' if len(ignored) == 1 else 'DPO flags'}: {stage} would "
                         f"ignore {it}; add --dpo to train with DPO, or drop {it}")
    ignored = sorted(given_sft.values()) if dpo or reward else []
    if ignored:
        flags, it, verb = named(ignored)
        raise UsageError(f"{flags} {verb} {'an SFT flag' if len(ignored) == 1 else 'SFT flags'}: {stage} reads "
                         f"preference pairs, one conversation per row, and would ignore {it}; "
                         f"drop {it}")


def resumes(config) -> bool:
    """A DPO run with ``--load`` and no ``--finetune`` resumes its own save (reads its table)."""
    return bool(config.checkpoint.load) and not config.checkpoint.finetune


def check_dpo_flags(config, vocab_size: Optional[int] = None) -> None:
    """Refuse a DPO run the flags alone make wrong, before any process group exists; a resume
    (:func:`resumes`) needs the saved reference table of ``--load``, fitting this run
    (:func:`megatron.training.dpo_reference.read_reference`; ``vocab_size``: the tokenizer's).

    Raises:
        UsageError: naming the flag or file, its value and the fix.
    """
    from megatron.training.pairs import check_pair_flags

    dpo = config.extra["dpo"]
    # inf passed '> 0' and made every loss inf or NaN; NaN fails both comparisons.
    if not (math.isfinite(dpo.dpo_beta) and dpo.dpo_beta > 0):
        raise UsageError(f"--dpo-beta {dpo.dpo_beta}: must be a finite number > 0 (0.1 is common)")
    if not (math.isfinite(dpo.dpo_sft_weight) and dpo.dpo_sft_weight >= 0):
        raise UsageError(f"--dpo-sft-weight {dpo.dpo_sft_weight}: must be a finite number >= 0")
    check_pair_flags(config, "--dpo")
    if resumes(config):
        from megatron.checkpointing import resume_point

        load = config.checkpoint.load
        read_reference(load, run_meta(config, None, vocab_size))
        if resume_point(load) is None:  # else the run would train its initial weights
            raise UsageError(f"--load {load} without --finetune resumes a DPO run, but the folder "
                             "holds its reference table and no checkpoint yet (the run stopped "
                             "before its first save); start it again with --load "
                             "REFERENCE_CHECKPOINT --finetune")


class DPO:
    """One DPO run's datasets provider, forward step and reference pass (the ``pretrain`` hooks).

    Args:
        config: the run's frozen :class:`~megatron.config.Config` (``extra["dpo"]`` set).
        check_ids: ``check_ids(tokens)`` raises ValueError for ids outside the vocabulary.
        pad_id: padding id of the rows.
        vocab_size: the tokenizer's vocabulary size, recorded with the saved reference table.
    """

    def __init__(self, config, check_ids, pad_id: int, vocab_size: Optional[int] = None):
        self.config, self.check_ids, self.pad_id = config, check_ids, pad_id
        self.vocab_size = vocab_size
        self.dpo = config.extra["dpo"]
        self.datasets = ()
        self.reference = None  # [documents, 2] fp32: reference log-probabilities (chosen, rejected)

    def datasets_provider(self, config, train_val_test_num_samples):
        """``(train, valid, test)`` :class:`PreferenceDataset` s of ``--data-path``'s pairs cut
        by ``--split``; kept for the reference pass."""
        from megatron.data.indexed_dataset import MMapIndexedDataset
        from megatron.training.pairs import pair_datasets

        self.datasets = pair_datasets(config, train_val_test_num_samples, self.pad_id, "DPO")
        self.num_documents = len(MMapIndexedDataset(str(config.data.data_path[0]))
                                 .document_indices) - 1
        return self.datasets

    def _forward(self, data_iterator, model):
        device = next(model.parameters()).device
        tokens, labels, loss_mask, position_ids, _, index = pair_batch(
            next(data_iterator), device, self.check_ids)
        # One conversation per row, padding after it: plain causal attention is the document's.
        return model(tokens, position_ids, None, labels=labels), loss_mask, index

    def forward_step(self, data_iterator, model):
        """One micro-batch of pairs: ``(per-token losses [2m, s], loss_func)``."""
        output, loss_mask, index = self._forward(data_iterator, model)
        return output, partial(self.loss_func, loss_mask, index)

    def loss_func(self, loss_mask, index, output_tensor):
        """DPO loss of the micro-batch's ``m`` pairs: ``(sum of pair losses, m, logged)``; the
        logged values are this rank's ``(sum, pairs)`` (the training step sums them over the
        data-parallel group)."""
        dpo = self.dpo
        logps = sequence_logps(output_tensor, loss_mask, dpo.dpo_length_normalization).view(-1, 2)
        reference = self.reference[index].to(logps.device)
        nll = None
        if dpo.dpo_sft_weight:
            nll = -sequence_logps(output_tensor[0::2], loss_mask[0::2], average=True)
        losses, metrics = dpo_loss(logps[:, 0], logps[:, 1], reference[:, 0], reference[:, 1],
                                   dpo.dpo_beta, dpo.dpo_sft_weight, nll)
        pairs = torch.tensor(float(losses.numel()), device=losses.device)
        names = ("dpo loss",) + METRICS + ("logps/chosen", "logps/rejected")
        sums = report_sums([losses, *(metrics[k] for k in METRICS), logps[:, 0], logps[:, 1],
                            pairs])
        return losses.sum(), pairs.to(torch.int64), dict(zip(names, sums))

    def _reference_loss(self, index, loss_mask, output_tensor):
        logps = sequence_logps(output_tensor, loss_mask, self.dpo.dpo_length_normalization)
        return output_tensor.sum() * 0.0, torch.zeros((), dtype=torch.int64), {
            "logps": logps.view(-1, 2).detach(), "index": index}

    def _reference_step(self, data_iterator, model):
        output, loss_mask, index = self._forward(data_iterator, model)
        return output, partial(self._reference_loss, index, loss_mask)

    def reference_pass(self, model, schedule_config, pg_collection) -> None:
        """Cache the reference log-probabilities of every pair the run will read (the splits'
        samples) under the loaded weights (forward only, eval mode): ``self.reference`` ``[documents, 2]`` fp32 on every
        rank (filled on the last pipeline stage, zeros elsewhere). A resumed run
        (:func:`resumes`) reads the table its save holds instead; either way the table is then
        written to ``--save`` (:mod:`megatron.training.dpo_reference`)."""
        # The pairs the run will read (a short run reads a part of a large split).
        pairs = [(ds, int(j)) for ds in self.datasets if ds is not None for j in np.unique(ds.order)]
        documents = np.unique([int(ds.pairs[j]) for ds, j in pairs]).astype(np.int64)
        meta = run_meta(self.config, self.num_documents, self.vocab_size)
        load = self.config.checkpoint.load
        if resumes(self.config):
            # Every rank reads the same file and makes the same checks: all refuse alike.
            table, stored, saved = read_reference(load, meta)
            check_pairs(load, stored, documents)
            self.reference = torch.from_numpy(table.copy())
            print_rank_last(f" > DPO reference log-probabilities of {documents.size} preference "
                            f"pairs read from {load} (computed from "
                            f"{saved['reference_load'] or 'the initial weights'} at iteration "
                            f"{saved['reference_iteration']})")
            meta, documents = saved, stored
        else:
            self._compute_reference(model, schedule_config, pg_collection, pairs)
            from megatron.checkpointing import resume_point

            found = resume_point(load) if load else None
            meta.update(reference_load=os.path.realpath(load) if load else None,
                        reference_iteration=int(found[0]) if found and not found[1] else 0)
        self._save(pg_collection, documents, meta)

    def _save(self, pg_collection, documents, meta) -> None:
        """The rank holding the filled table (the last stage's tp / dp rank 0) writes it to
        ``--save``, unless it is the folder the table was read from."""
        save, load = self.config.checkpoint.save, self.config.checkpoint.load
        if not save or (resumes(self.config) and os.path.realpath(save) == os.path.realpath(load)):
            return
        if (pg_collection.is_pipeline_last_stage() and pg_collection.tp.rank == 0
                and pg_collection.dp.rank == 0):
            os.makedirs(save, exist_ok=True)
            save_reference(save, self.reference.cpu().numpy(), documents, meta)

    def _compute_reference(self, model, schedule_config, pg_collection, pairs) -> None:
        from megatron.core.distributed.model_chunk import as_model_chunk
        from megatron.core.pipeline_parallel import get_forward_backward_func

        start = time.perf_counter()
        training, dp = self.config.training, pg_collection.dp
        per_micro_batch = training.micro_batch_size // 2
        batches = [pairs[i:i + per_micro_batch] for i in range(0, len(pairs), per_micro_batch)]
        rounds = -(-len(batches) // dp.size)
        mine = batches[dp.rank::dp.size]
        real = [True] * len(mine) + [False] * (rounds - len(mine))
        mine += [batches[-1]] * (rounds - len(mine))  # a filler, its values dropped below
        mine = [b + [b[-1]] * (per_micro_batch - len(b)) for b in mine]

        def micro_batches():
            for batch in mine:
                rows = [ds.row(j, side) for ds, j in batch for side in (0, 1)]
                yield {key: np.stack([r[key] for r in rows]) for key in rows[0]}

        vp = pg_collection.virtual_pipeline_model_parallel_size
        iterator = micro_batches() if vp is None else [micro_batches() for _ in range(vp)]
        for chunk in model:
            as_model_chunk(chunk).finish_param_sync()
            chunk.eval()
        with torch.no_grad():
            results = get_forward_backward_func(pg_collection)(
                forward_step_func=self._reference_step, data_iterator=iterator, model=model,
                num_microbatches=rounds, seq_length=self.config.data.seq_length,
                micro_batch_size=training.micro_batch_size, forward_only=True,
                config=schedule_config, pg_collection=pg_collection)
        for chunk in model:
            chunk.train()
        device = next(model[0].parameters()).device
        table = torch.zeros(self.num_documents, 2, dtype=torch.float64, device=device)
        counts = torch.zeros(self.num_documents, dtype=torch.float64, device=device)
        if pg_collection.is_pipeline_last_stage():
            for result, batch, keep in zip(results, mine, real):
                if not keep:
                    continue
                seen = set()
                for (ds, j), row, index in zip(batch, result["logps"], result["index"]):
                    if (id(ds), j) in seen:  # the filler of a short last micro-batch
                        continue
                    seen.add((id(ds), j))
                    table[int(index)] += row.double()
                    counts[int(index)] += 1
        dist.all_reduce(table, group=dp.group)
        dist.all_reduce(counts, group=dp.group)
        self.reference = (table / counts.clamp(min=1).unsqueeze(1)).float()
        if pg_collection.is_pipeline_last_stage():
            done = int((counts > 0).sum())
            if done != len(pairs):
                raise RuntimeError(f"the DPO reference pass covered {done} of {len(pairs)} pairs")
            used = counts > 0
            print_rank_last(
                f" > DPO reference log-probabilities of {done} preference pairs computed with the "
                f"loaded weights in {time.perf_counter() - start:.1f} s and cached (mean chosen "
                f"{float(self.reference[used, 0].mean()):.4f}, rejected "
                f"{float(self.reference[used, 1].mean()):.4f})")

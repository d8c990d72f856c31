"""Supervised fine-tuning (SFT) of LLaMA on conversations, with packed sequences: Megatron-LM's
SFT path (``pretrain_gpt.py --sft``, ``megatron/training/datasets/sft_dataset.py``) as an entry
script beside ``pretrain_llama.py``, whose machinery it reuses (model provider, configuration,
loss, context-parallel split; only the datasets provider and the batch differ).

Launch: ``torchrun --nproc-per-node N finetune_llama.py [Megatron flags] --load CKPT --finetune
--data-path PREFIX_text_document`` (see examples/sft_llama_cpu_demo.sh and docs/post-training.md).

Data: ``--data-path`` names one tokens dataset written by ``tools/preprocess_sft_data.py``
(``{prefix}_text_document``); its loss-mask dataset ``{prefix}_text_loss_mask_document`` sits
beside it. ``--split`` cuts the conversations (not tokens) into train/valid/test as Megatron-Core
cuts documents. Samples are :class:`megatron.data.sft_dataset.SFTDataset` ones: packed by
first-fit decreasing within a window of ``--sft-packing-window`` conversations (``--sft-packing``,
the default) or one conversation per sequence, padded with the end-of-document id
(``--no-sft-packing``).

Loss: masked cross entropy on the assistant tokens only (the mask dataset, as labels), and
**per-token by default** (``--calculate-per-token-loss`` is on unless
``--no-calculate-per-token-loss``): the iteration's loss is the sum of the token losses of the
whole global batch divided by its number of assistant tokens, so every assistant token weighs the
same whatever sequence, micro-batch or data-parallel rank it lands in. That is the normalisation
under which a packed batch equals the same conversations run one per sequence (the per-micro-batch
mean of pretraining would weigh a token by its micro-batch's token count). Attention is causal
within each conversation (:class:`~megatron.model.attention_mask.AttentionMask` of the samples'
``document_ids``: SDPA per document, or the split attention under context parallelism); position
ids restart at 0 with each conversation (the dataset's).

``main(argv)`` is callable from Python with an argument list (tests run it inside process worlds).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from functools import partial

import torch

from megatron.config.sections import ConfigSection
from megatron.core import parallel_state as ps
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.model.attention_mask import AttentionMask
from megatron.training.logging import print_rank_0
from megatron.training.train import pretrain
from megatron.usage_error import UsageError
from pretrain_llama import check_token_ids, configure, loss_func, model_provider


@dataclass(frozen=True)
class SFTConfig:
    """The SFT script's own flags (``config.extra["sft"]``)."""

    sft_packing: bool = True
    """``--sft-packing`` / ``--no-sft-packing``: pack several conversations per sequence (first-fit
    decreasing within a window), or one per sequence, padded. Default packed."""

    sft_packing_window: int = 1000
    """``--sft-packing-window``: conversations sorted longest-first and packed together (1: plain
    first-fit in shuffled order). Default 1000."""

    sft_no_calculate_per_token_loss: bool = False
    """``--no-calculate-per-token-loss``: normalise per micro-batch as pretraining does by default
    (Megatron's mean), instead of SFT's per-token default. Default off."""


class _PerTokenLossOff(argparse.Action):
    """``--no-calculate-per-token-loss``: records itself and turns the built-in flag off."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        namespace.calculate_per_token_loss = False


def add_sft_args(parser):
    """The SFT flags (Megatron's ``extra_args_provider``); per-token loss becomes the default."""
    group = parser.add_argument_group("supervised fine-tuning")
    group.add_argument("--sft-packing", action=argparse.BooleanOptionalAction, default=True,
                       help="pack conversations into --seq-length sequences (default), or one "
                            "conversation per sequence with --no-sft-packing")
    group.add_argument("--sft-packing-window", type=int, default=1000,
                       help="conversations per first-fit-decreasing window (1: first-fit)")
    group.add_argument("--no-calculate-per-token-loss", dest="sft_no_calculate_per_token_loss",
                       nargs=0, action=_PerTokenLossOff, default=False,
                       help="per-micro-batch mean loss instead of SFT's per-token default")
    parser.set_defaults(calculate_per_token_loss=True)
    return parser


SFT = ConfigSection("sft", SFTConfig, add_sft_args)


def mask_prefix(tokens_prefix: str) -> str:
    """The loss-mask dataset beside a tokens dataset: ``{p}_document`` -> ``{p}_loss_mask_document``."""
    return tokens_prefix[:-len("_document")] + "_loss_mask_document"


def check_sft_data(config) -> None:
    """Refuse data flags the SFT datasets do not read, before any process group exists.

    Raises:
        UsageError: ``--mock-data``, per-split paths or a blend; a ``--data-path`` not ending in
            ``_document``, or without its loss-mask dataset beside it; ``--sft-packing-window < 1``.
    """
    data, sft = config.data, config.extra["sft"]
    if sft.sft_packing_window < 1:
        raise UsageError(f"--sft-packing-window {sft.sft_packing_window}: must be >= 1")
    if data.mock_data or data.train_data_path or data.valid_data_path or data.test_data_path:
        raise UsageError("finetune_llama.py reads one --data-path PREFIX_text_document (and "
                         "--split); --mock-data and --train/valid/test-data-path are not supported")
    if not data.data_path or len(data.data_path) != 1:
        raise UsageError(f"--data-path {' '.join(map(str, data.data_path or ()))}: "
                         "finetune_llama.py reads exactly one tokens prefix (blends are not "
                         "supported); give the {prefix}_text_document of tools/preprocess_sft_data.py")
    prefix = str(data.data_path[0])
    if not prefix.endswith("_document"):
        raise UsageError(f"--data-path {prefix}: name the tokens dataset "
                         "({prefix}_text_document) that tools/preprocess_sft_data.py wrote")
    masks = mask_prefix(prefix)
    if not os.path.isfile(masks + ".idx") or not os.path.isfile(masks + ".bin"):
        raise UsageError(f"--data-path {prefix}: its loss-mask dataset {masks}.bin/.idx is "
                         "missing; write both with tools/preprocess_sft_data.py in one run")


def sft_datasets_provider(config, train_val_test_num_samples, pad_id=0):
    """``(train, valid, test)`` :class:`~megatron.data.sft_dataset.SFTDataset` s of
    ``--data-path``'s conversations cut by ``--split``
    (:func:`megatron.training.document_splits.split_datasets`), each with the
    number of samples asked. Index caches go to ``--data-cache-path``."""
    from megatron.training.document_splits import split_datasets
    from megatron.data.sft_dataset import SFTDataset

    data, sft = config.data, config.extra["sft"]
    prefix = str(data.data_path[0])

    def make(name, documents, n):
        return SFTDataset(prefix, data.seq_length, seed=config.training.seed, num_samples=n,
                          documents=documents, packed=sft.sft_packing,
                          packing_window=sft.sft_packing_window, pad_id=pad_id,
                          mask_prefix=mask_prefix(prefix), cache_dir=data.data_cache_path,
                          split=name)

    layout = "packed" if sft.sft_packing else "one per sequence"
    return split_datasets(config, train_val_test_num_samples,
                          "SFT ({count} conversations, " + layout + ")", make)


def get_sft_batch(data_iterator, device, vocab_size, data, cp=None):
    """Next SFT micro-batch ``(tokens, labels, loss_mask, attention_mask, position_ids)`` on
    ``device``: ``[b, s]`` int64 tokens and labels, fp32 loss mask (1 on assistant labels), the
    :class:`AttentionMask` of the samples' ``document_ids``, int64 positions restarting per
    conversation; under context parallelism cut to this rank's tokens (document ids kept whole).

    Raises:
        ValueError: a token id outside ``[0, vocab_size)`` (names the data and tokenizer flags).
    """
    sample = next(data_iterator)
    tokens = torch.as_tensor(sample["tokens"]).long()
    labels = torch.as_tensor(sample["labels"]).long()
    check_token_ids(torch.cat([tokens, labels]), vocab_size, data)
    batch = {"tokens": tokens.to(device), "labels": labels.to(device),
             "loss_mask": torch.as_tensor(sample["loss_mask"]).float().to(device),
             "attention_mask": AttentionMask.from_document_ids(
                 torch.as_tensor(sample["document_ids"]).long().to(device)),
             "position_ids": torch.as_tensor(sample["position_ids"]).long().to(device)}
    if cp is not None and cp.size > 1:
        batch = get_batch_on_this_cp_rank(batch, cp.size, cp.rank)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"])


def sft_forward_step(data, vocab_size, data_iterator, model):
    """One SFT micro-batch forward: ``(output_tensor, loss_func)`` for the schedule; the loss is
    ``pretrain_llama.loss_func`` (masked sum and token count) over the assistant labels."""
    device = next(model.parameters()).device
    tokens, labels, loss_mask, attention_mask, position_ids = get_sft_batch(
        data_iterator, device, vocab_size, data, cp=ps.get_process_groups().cp)
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


def main(argv=None):
    """Parse and validate the flags (the SFT, DPO and reward sections' too), then fine-tune: SFT,
    DPO with ``--dpo`` (:mod:`megatron.training.dpo`) or a reward model with ``--reward-model``
    (:mod:`megatron.training.reward_model`). Returns this rank's history (see
    ``megatron.training.pretrain``; SFT logs ``lm loss``, DPO ``dpo loss``, the reward model
    ``reward loss``, both with their rewards).

    Raises:
        UsageError: as ``pretrain_llama.main``, and :func:`check_sft_data`'s or
            :func:`megatron.training.dpo.check_dpo_flags`' or
            :func:`megatron.training.reward_model.check_reward_flags`' refusals.
    """
    from megatron.training.dpo import DPO, DPO_SECTION, check_dpo_flags, check_stage_flags
    from megatron.training.reward_model import (REWARD_SECTION, RewardModel, check_reward_flags,
                                                with_reward_head)

    config, tokenizer = configure(argv, sections=[SFT, DPO_SECTION, REWARD_SECTION])
    check_stage_flags(config, SFT.given(argv), DPO_SECTION.given(argv))
    check = partial(check_token_ids, vocab_size=tokenizer.vocab_size, data=config.data)
    if config.extra["reward"].reward_model:
        check_reward_flags(config)
        run = RewardModel(config, check, pad_id=tokenizer.eod)
        return pretrain(config, model_provider=with_reward_head(model_provider),
                        forward_step_func=run.forward_step,
                        datasets_provider=run.datasets_provider)
    if config.extra["dpo"].dpo:
        check_dpo_flags(config, vocab_size=tokenizer.vocab_size)
        run = DPO(config, check, pad_id=tokenizer.eod, vocab_size=tokenizer.vocab_size)
        return pretrain(config, model_provider=model_provider, forward_step_func=run.forward_step,
                        datasets_provider=run.datasets_provider,
                        before_training=run.reference_pass)
    check_sft_data(config)
    return pretrain(config, model_provider=model_provider,
                    forward_step_func=partial(sft_forward_step, config.data, tokenizer.vocab_size),
                    datasets_provider=partial(sft_datasets_provider, pad_id=tokenizer.eod))


def command(argv=None) -> int:
    """The command line: :func:`main` under
    :func:`megatron.training.command.run_training_command` (as ``pretrain_llama.command``)."""
    from megatron.training.command import run_training_command

    return run_training_command("finetune_llama.py", main, argv)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(command)(sys.argv[1:]))

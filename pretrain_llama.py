"""Pretrain LLaMA with tensor, context, pipeline and data parallelism (Megatron-LM's ``pretrain_gpt.py``).

Launch: ``torchrun --nproc-per-node N pretrain_llama.py [Megatron flags]`` (see examples/).
``main(argv)`` is callable from Python with an argument list (tests run it inside process worlds).
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch
import torch.distributed as dist

from megatron import arguments
from megatron.core import parallel_state as ps
from megatron.core.context_parallel import (get_batch_on_this_cp_rank,
                                            reduce_loss_for_context_parallel)
from megatron.model.attention_mask import AttentionMask
from megatron.training.logging import print_rank_0
from megatron.training.train import pretrain
from megatron.usage_error import UsageError

def model_provider(config, pg_collection, device, *, pre_process=True, post_process=True,
                   vp_stage=None):
    """This pipeline stage of the LLaMA model (its share of layers, on ``device``); with virtual
    pipeline stages, model chunk ``vp_stage`` (Megatron-Core's provider, given the run's
    :class:`~megatron.config.Config` and process groups)."""
    from megatron.model import LlamaModel, get_layer_numbers, get_virtual_layer_numbers

    num_layers = config.model.num_layers
    pp, rank = pg_collection.pp.size, pg_collection.pp.rank
    vp = pg_collection.virtual_pipeline_model_parallel_size
    layers = (get_layer_numbers(num_layers, pp, rank) if vp is None else
              get_virtual_layer_numbers(num_layers, pp, rank, vp, vp_stage))
    model = LlamaModel(config.model, pg_collection=pg_collection, pre_process=pre_process,
                       post_process=post_process, layer_numbers=layers, device=device,
                       moe_config=config.moe if config.moe.is_moe else None)
    if config.moe.is_moe:
        from megatron.core.transformer.moe.moe_utils import set_aux_loss_scale
        # The router losses' gradient, like the lm loss's, divided by the micro-batches of the
        # iteration (the schedule divides each micro-batch's loss by their number) and times CP:
        # each CP rank's part covers its share of the tokens and DDP averages over DP x CP.
        set_aux_loss_scale(model, pg_collection.cp.size / config.training.num_microbatches)
    return model


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask,
                                    eod_mask_loss):
    """Megatron-LM's masks for left-to-right models, vectorized, with the attention mask as an
    object instead of Megatron-LM's dense ``[b, 1, s, s]`` tensor.

    Args:
        data: ``[b, s]`` int64 input tokens.

    Returns:
        ``(attention_mask, loss_mask, position_ids)``: with ``reset_attention_mask`` an
        :class:`~megatron.model.attention_mask.AttentionMask` of the documents (a new one after
        every end-of-document token; ``to_dense()`` is Megatron-LM's tensor), else None (plain
        causal); loss mask
        ``[b, s]`` fp32 (0 at end-of-document tokens with ``eod_mask_loss``); position ids
        ``[b, s]`` int64, restarting after each end-of-document with ``reset_position_ids``.
    """
    b, s = data.shape
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    arange = torch.arange(s, device=data.device)
    position_ids = arange.unsqueeze(0).expand(b, s)
    if not (reset_position_ids or reset_attention_mask):
        return None, loss_mask, position_ids
    # A document starts at 0 and after every EOD; doc[t] = number of EODs before t.
    after_eod = torch.zeros_like(data, dtype=torch.bool)
    after_eod[:, 1:] = data[:, :-1] == eod_token
    doc = torch.cumsum(after_eod.long(), dim=1)
    attention_mask = AttentionMask(document_ids=doc) if reset_attention_mask else None
    if reset_position_ids:
        start = torch.where(after_eod, arange.expand(b, s), torch.zeros_like(data))
        position_ids = arange - torch.cummax(start, dim=1).values
    return attention_mask, loss_mask, position_ids


def tokenizer_flags(data) -> str:
    """The run's tokenizer flags as typed (``data``: the parsed flags or the run's
    :class:`~megatron.config.DataConfig`), for messages."""
    return (f"--tokenizer-type {data.tokenizer_type}"
            + (f" --vocab-size {data.vocab_size}" if data.vocab_size else "")
            + (f" --tokenizer-model {data.tokenizer_model}" if data.tokenizer_model else "")
            + (f" --tokenizer-name-or-path {data.tokenizer_name_or_path}"
               if getattr(data, "tokenizer_name_or_path", None) else ""))


def data_flags(data) -> str:
    """Every data flag of the run with its paths (``--data-path (a b)``, or ``--train-data-path
    (a) or --valid-data-path (b)``), for messages about a batch of unknown origin."""
    given = [(flag, getattr(data, flag[2:].replace("-", "_"), None))
             for flag in ("--data-path", "--train-data-path", "--valid-data-path",
                          "--test-data-path")]
    return " or ".join(f"{flag} ({' '.join(map(str, paths))})" for flag, paths in given if paths)


def check_token_ids(tokens: torch.Tensor, vocab_size: int, data) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` in a batch as it is read (the embedding would
    index out of range, or silently train padded rows). Costs one min/max per micro-batch on the
    CPU copy; whole ``.bin`` files up to 256 MiB were checked at start
    (:mod:`megatron.data.token_range`), which names the file.

    Args:
        data: the run's :class:`~megatron.config.DataConfig` (named in the message).

    Raises:
        ValueError: naming the id, the tokenizer flags and the data flags.
    """
    low, high = int(tokens.min()), int(tokens.max())
    if low >= 0 and high < vocab_size:
        return
    bad = high if high >= vocab_size else low
    raise ValueError(
        f"token id {bad} in a batch read from {data_flags(data)} is outside the vocabulary "
        f"[0, {vocab_size}) of {tokenizer_flags(data)}: the data was tokenized with another "
        "tokenizer; pass that tokenizer's flags, or re-run tools/preprocess_data.py with this one")


def get_batch(data_iterator, data, eod, device, vocab_size=None, cp=None):
    """Next micro-batch: ``(tokens, labels, loss_mask, attention_mask, position_ids)`` on ``device``
    (``data``: the run's :class:`~megatron.config.DataConfig`, its masks and position flags).

    Masks and positions are computed on the whole sequence; with a context-parallel group ``cp``
    (a :class:`~megatron.core.process_groups.ParallelGroup` of CP > 1 ranks) every ``[b, s]``
    tensor is then cut to this rank's ``s / CP`` tokens (Megatron-Core's
    ``get_batch_on_this_cp_rank``), so positions stay each token's true one.

    Raises:
        ValueError: a token id outside ``[0, vocab_size)`` (when ``vocab_size`` is given).
    """
    sample = next(data_iterator)
    tokens_ = torch.as_tensor(sample["text"]).long()
    if vocab_size is not None:
        check_token_ids(tokens_, vocab_size, data)
    tokens_ = tokens_.to(device)
    tokens, labels = tokens_[:, :-1].contiguous(), tokens_[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
             "attention_mask": attention_mask, "position_ids": position_ids}
    if cp is not None and cp.size > 1:
        batch = get_batch_on_this_cp_rank(batch, cp.size, cp.rank)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"])


def loss_func(loss_mask, output_tensor):
    """Megatron-Core's loss: the sum of masked per-token losses and the token count; for logging,
    this rank's ``(sum, count)``, which the training step sums over the micro-batches and the data
    x context-parallel group in one all-reduce (``megatron.training.train.reduce_loss_dicts``).
    Under context parallelism the sum is this rank's tokens' and
    :func:`~megatron.core.context_parallel.reduce_loss_for_context_parallel` returns ``CP x`` it
    with the count of the whole micro-batch, which gives the unsplit gradients.

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": (sum, count)})``; the schedule divides by the tokens
        and micro-batches, or by the global token count under ``--calculate-per-token-loss``.
    """
    groups = ps.get_process_groups()
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1)
    loss = torch.stack([torch.sum(losses * mask), mask.sum()])
    reporting = loss.detach().clone()
    loss_sum, num_tokens = reduce_loss_for_context_parallel(
        loss[0], loss[1].detach(), groups.cp.group if groups.cp.size > 1 else None)
    return loss_sum, num_tokens.to(torch.int64), {"lm loss": (reporting[0], reporting[1])}


def forward_step(data, eod, data_iterator, model, vocab_size=None):
    """One micro-batch forward: ``(output_tensor, loss_func)`` for the schedule (``data``: the
    run's :class:`~megatron.config.DataConfig`; ``eod``: the tokenizer's end-of-document id;
    ``vocab_size``: the tokenizer's, to check token ids)."""
    device = next(model.parameters()).device
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, data, eod, device, vocab_size, cp=ps.get_process_groups().cp)
    # Stages without the output layer ignore the labels (the model knows its post_process).
    output = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(config, train_val_test_num_samples, eod=None):
    """Megatron's GPT datasets of ``--data-path`` (or the per-split paths) for the given numbers
    of samples (``config``: the run's :class:`~megatron.config.Config`); with ``--mock-data``
    synthetic ones over the tokenizer's vocabulary, ``eod`` its end-of-document id."""
    from megatron.data.dataset_builder import build_train_valid_test_datasets

    data = config.data
    if data.mock_data:
        from megatron.data.mock_dataset import build_mock_datasets

        print_rank_0(" > building mock train, validation, and test datasets (--mock-data) ...")
        return build_mock_datasets(
            train_val_test_num_samples, seq_length=data.seq_length,
            vocab_size=config.model.true_vocab_size, eod=eod, seed=config.training.seed)
    print_rank_0(" > building train, validation, and test datasets for LLaMA ...")
    return build_train_valid_test_datasets(
        data_path=data.data_path, split=data.split,
        train_valid_test_num_samples=train_val_test_num_samples, seq_length=data.seq_length,
        seed=config.training.seed, data_cache_path=data.data_cache_path,
        train_data_path=data.train_data_path, valid_data_path=data.valid_data_path,
        test_data_path=data.test_data_path)


def configure(argv=None, sections=()):
    """Parse and validate the flags once and build the tokenizer and the frozen configuration:
    everything that reads the command line, before any process group exists. Every rank does
    the same and finds the same errors. ``sections``: an entry script's own
    :class:`~megatron.config.sections.ConfigSection` s (their flags parsed too, their values in
    ``config.extra``).

    Returns:
        ``(config, tokenizer)``.

    Raises:
        UsageError: a flag, or a file a flag names, is wrong (one line naming it and the fix).
    """
    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
    from megatron.config import build_config
    from megatron.data.token_range import check_token_ranges
    from megatron.tokenizer import build_tokenizer

    def extra_args(parser):
        for section in sections:
            section.add_arguments(parser)
        return parser

    args = arguments.parse_args(argv, extra_args_provider=extra_args if sections else None)
    try:
        if args.use_checkpoint_args:
            arguments.load_args_from_checkpoint(args)
        world_size = (dist.get_world_size() if dist.is_initialized()
                      else int(os.environ.get("WORLD_SIZE", "1")))
        arguments.validate_args(args, world_size)
        tokenizer = build_tokenizer(args)
        if not args.mock_data:  # --mock-data draws its ids below the vocabulary size itself
            check_token_ranges(tokenizer.vocab_size, tokenizer_flags(args), data_path=args.data_path,
                               split=args.split, train_data_path=args.train_data_path,
                               valid_data_path=args.valid_data_path,
                               test_data_path=args.test_data_path)
    except UsageError:
        raise
    except (ValueError, FileNotFoundError, CheckpointError) as exc:  # the flags' files
        raise UsageError(str(exc)) from exc
    config = build_config(args, vocab_size=tokenizer.vocab_size, sections=sections)
    if int(os.environ.get("RANK", "0")) == 0:
        from megatron.training.startup_report import print_arguments
        print_arguments(args, tokenizer.vocab_size, config.model.padded_vocab_size)
        for message in arguments.report_ignored_flags(args):
            print(f" WARNING: {message}", flush=True)
    return config, tokenizer


def main(argv=None):
    """Parse and validate the flags once, build the tokenizer and the frozen configuration, and
    train. Returns this rank's history (see ``megatron.training.pretrain``).

    Raises:
        UsageError: an invalid flag combination, a missing or unusable file, a ``--save`` folder
            another job holds, a checkpoint that cannot be resumed as asked: before anything is
            built where the flags alone tell, else agreed by every rank.
        NonFiniteTrainingError: ``--max-consecutive-nan-iterations`` non-finite iterations in a
            row (rank 0 has logged why and which checkpoint is the last good one).
    """
    config, tokenizer = configure(argv)
    return pretrain(config, model_provider=model_provider,
                    forward_step_func=partial(forward_step, config.data, tokenizer.eod,
                                              vocab_size=tokenizer.vocab_size),
                    datasets_provider=partial(train_valid_test_datasets_provider,
                                              eod=tokenizer.eod))


def command(argv=None) -> int:
    """The command line: :func:`main` under
    :func:`megatron.training.command.run_training_command` (a usage error is one line and status
    2; a non-finite stop, a failed save or a data file damaged under the run status 1 without a
    traceback of ours)."""
    from megatron.training.command import run_training_command

    return run_training_command("pretrain_llama.py", main, argv)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # torchrun then shows a crashing rank's traceback in its summary (the "root cause").
    sys.exit(record(command)(sys.argv[1:]))

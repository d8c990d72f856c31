"""Builders of the training program: model chunks with DDP and optimizer, data iterators, and the
schedule's configuration. Megatron-LM's ``setup_model_and_optimizer`` and
``build_train_valid_test_data_iterators`` (megatron/training/training.py)."""

from __future__ import annotations

from functools import partial

import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.pipeline_parallel import PipelineConfig


def train_iters(args) -> int:
    """Iterations of the run (Megatron-LM's ``update_train_iters``): ``--train-iters``, or with
    ``--train-samples`` the iterations of the ramp-up (while at most SAMPLES samples are consumed,
    each iteration taking the ramped global batch) plus the remaining samples in whole global
    batches (a partial last batch is dropped)."""
    if getattr(args, "train_iters", None):
        return args.train_iters
    if getattr(args, "rampup_batch_size", None) is None:
        return args.train_samples // args.global_batch_size
    from megatron.training.microbatches import build_num_microbatches_calculator

    calculator = build_num_microbatches_calculator(args)
    iterations = consumed = 0
    while consumed <= int(args.rampup_batch_size[2]) and consumed <= args.train_samples:
        calculator.update(consumed, False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def num_microbatches(args) -> int:
    """Micro-batches per iteration: global batch / (micro-batch x data-parallel size)."""
    return args.global_batch_size // (args.micro_batch_size * ps.get_data_parallel_world_size())


def build_model_chunks(args, model_provider, device) -> list:
    """This rank's model chunks, unwrapped: one, or with virtual pipeline stages one per virtual
    rank (Megatron-Core's ``get_model``): chunk ``v`` is built by the provider with
    ``vp_stage=v``, so it picks the layers of virtual stage ``v * PP + rank``; only chunk 0 of
    the first stage embeds (``pre_process``) and only the last chunk of the last stage computes
    the loss (``post_process``)."""
    groups = ps.get_process_groups()
    vp = groups.virtual_pipeline_model_parallel_size
    stages = [None] if vp is None else range(vp)
    return [model_provider(args, device, pre_process=groups.is_pipeline_first_stage(v),
                           post_process=groups.is_pipeline_last_stage(v), vp_stage=v)
            for v in stages]


def setup_model_and_optimizer(args, model_provider, device):
    """This rank's model chunks (each wrapped for data parallelism), optimizer and lr scheduler.

    Returns:
        ``(ddp_chunks, optimizer, opt_param_scheduler)``; one chunk, or one per virtual pipeline
        stage.
    """
    from megatron.config import build_optimizer_config
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.lr_scheduler import build_opt_param_scheduler

    bucket = getattr(args, "reduce_bucket_size", None)
    groups = ps.get_process_groups()
    # One DDP wrapper (one grad buffer) per chunk, as Megatron-LM: the optimizer and
    # finalize_model_grads take the list. Gradients reduce over DP x CP (Megatron-Core's dp_cp).
    chunks = [DistributedDataParallel(
        model, data_parallel_group=groups.dp_cp.group,
        accumulate_allreduce_grads_in_fp32=getattr(args, "accumulate_allreduce_grads_in_fp32", True),
        bucket_size=None if bucket is None else int(bucket),
        overlap_grad_reduce=getattr(args, "overlap_grad_reduce", False),
        use_distributed_optimizer=getattr(args, "use_distributed_optimizer", False),
        overlap_param_gather=getattr(args, "overlap_param_gather", False))
        for model in build_model_chunks(args, model_provider, device)]
    optimizer = get_megatron_optimizer(build_optimizer_config(args), chunks, pg_collection=groups)
    scheduler = build_opt_param_scheduler(optimizer, args)
    return chunks, optimizer, scheduler


def schedule_config(args, model_chunks, optimizer=None) -> PipelineConfig:
    """The pipeline schedule's configuration for this run; with an fp16 ``optimizer`` the last
    stage's loss is multiplied by its loss scale before backward (``grad_scale_func``)."""
    dtype = (torch.bfloat16 if getattr(args, "bf16", False)
             else torch.float16 if getattr(args, "fp16", False) else torch.float32)
    scaler = getattr(optimizer, "grad_scaler", None)
    return PipelineConfig(
        hidden_size=args.hidden_size,
        params_dtype=dtype,
        grad_scale_func=None if scaler is None else optimizer.scale_loss,
        calculate_per_token_loss=getattr(args, "calculate_per_token_loss", False),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=getattr(args, "sequence_parallel", False),
        finalize_model_grads_func=partial(finalize_model_grads,
                                          pg_collection=ps.get_process_groups()),
        # Interleaved: every chunk's reduction is held back until its last micro-batch.
        no_sync_func=(model_chunks[0].no_sync if len(model_chunks) == 1
                      else [chunk.no_sync for chunk in model_chunks]))


def _samples(args) -> list:
    """Samples each split must provide: Megatron's ``train_valid_test_num_samples``."""
    from megatron.data.dataset_builder import get_train_valid_test_num_samples

    # Evaluations follow the iterations (more of them under a ramp-up), the training split the
    # samples: Megatron's arithmetic after update_train_iters.
    samples = get_train_valid_test_num_samples(
        global_batch_size=args.global_batch_size, train_iters=train_iters(args),
        eval_interval=args.eval_interval, eval_iters=args.eval_iters)
    if getattr(args, "train_samples", None):
        samples[0] = args.train_samples
    return samples


def build_data_iterators(args, datasets_provider, consumed_train: int, consumed_valid: int):
    """``(train, valid, test)`` iterators over this data-parallel rank's micro-batches, resuming
    after ``consumed_*`` samples; None for an absent split. With virtual pipeline stages each
    split is a list of iterators, one per model chunk, over the same micro-batches (Megatron-LM
    builds one data iterator per chunk too).

    Every rank reads its micro-batches itself (the ranks of one tensor/pipeline group read the same
    samples): later stages need the position ids and document masks of
    ``--reset-position-ids`` / ``--reset-attention-mask`` too, and reading an mmap'd sample costs
    less than broadcasting it.
    """
    from megatron.data.samplers import build_pretraining_data_loader, cyclic_iter

    datasets = datasets_provider(args, _samples(args))
    consumed = (consumed_train, consumed_valid, 0)
    vp = ps.get_virtual_pipeline_model_parallel_world_size()

    def make(ds, start):
        loader = build_pretraining_data_loader(
            ds, start, micro_batch_size=args.micro_batch_size,
            data_parallel_rank=ps.get_data_parallel_rank(),
            data_parallel_size=ps.get_data_parallel_world_size(),
            dataloader_type=args.dataloader_type, num_workers=args.num_workers, seed=args.seed)
        return cyclic_iter(loader) if args.dataloader_type == "cyclic" else iter(loader)

    iterators = []
    for ds, start in zip(datasets, consumed):
        if ds is None or len(ds) == 0:
            iterators.append(None)
        elif vp is None:
            iterators.append(make(ds, start))
        else:
            iterators.append([make(ds, start) for _ in range(vp)])
    return tuple(iterators)

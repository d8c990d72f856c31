"""Builders of the training program: model chunks with DDP and optimizer, data iterators, and the
schedule's configuration. Megatron-LM's ``setup_model_and_optimizer`` and
``build_train_valid_test_data_iterators`` (megatron/training/training.py), each given the run's
:class:`~megatron.config.Config` and process groups."""

from __future__ import annotations

from functools import partial

import torch

from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.pipeline_parallel import PipelineConfig


def build_model_chunks(config, model_provider, pg_collection, device, *,
                       weights_from_checkpoint: bool = False) -> list:
    """This rank's model chunks, unwrapped: one, or with virtual pipeline stages one per virtual
    rank (Megatron-Core's ``get_model``): chunk ``v`` is built by the provider with
    ``vp_stage=v``, so it picks the layers of virtual stage ``v * PP + rank``; only chunk 0 of
    the first stage embeds (``pre_process``) and only the last chunk of the last stage computes
    the loss (``post_process``).

    ``model_provider(config, pg_collection, device, *, pre_process, post_process, vp_stage)``.
    With ``weights_from_checkpoint`` (a checkpoint will be loaded into every parameter) the
    chunks are built on the meta device and given zero-filled storage on ``device``: no random
    initial weights are drawn (:mod:`megatron.model.materialize`).
    """
    from megatron.model.materialize import materialize

    vp = pg_collection.virtual_pipeline_model_parallel_size
    stages = [None] if vp is None else range(vp)
    build_on = torch.device("meta") if weights_from_checkpoint else device
    chunks = [model_provider(config, pg_collection, build_on,
                             pre_process=pg_collection.is_pipeline_first_stage(v),
                             post_process=pg_collection.is_pipeline_last_stage(v), vp_stage=v)
              for v in stages]
    return [materialize(chunk, device) for chunk in chunks] if weights_from_checkpoint else chunks


def setup_model_and_optimizer(config, model_provider, pg_collection, device, *,
                              weights_from_checkpoint: bool = False):
    """This rank's model chunks (each wrapped for data parallelism), optimizer and lr scheduler;
    ``weights_from_checkpoint``: see :func:`build_model_chunks` (the caller then loads a
    checkpoint into every parameter before the first step).

    Returns:
        ``(ddp_chunks, optimizer, opt_param_scheduler)``; one chunk, or one per virtual pipeline
        stage.
    """
    from megatron.core.optimizer import build_opt_param_scheduler, get_megatron_optimizer
    from megatron.model.transformer import TransformerLayer  # ZeRO-3's unit

    parallel = config.parallel
    bucket = parallel.reduce_bucket_size
    # One DDP wrapper (one grad buffer) per chunk, as Megatron-LM: the optimizer and
    # finalize_model_grads take the list. Gradients reduce over DP x CP (Megatron-Core's dp_cp).
    strategy = parallel.data_parallel_sharding_strategy
    # The distributed optimizer without --use-megatron-fsdp is the strategy optim.
    strategy = "optim" if strategy == "no_shard" else strategy
    chunks = [DistributedDataParallel(
        model, data_parallel_group=pg_collection.dp_cp.group,
        expert_data_parallel_group=pg_collection.expt_dp.group,
        accumulate_allreduce_grads_in_fp32=parallel.accumulate_allreduce_grads_in_fp32,
        bucket_size=None if bucket is None else int(bucket),
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
        overlap_param_gather=parallel.overlap_param_gather,
        data_parallel_sharding_strategy=strategy, fsdp_unit_modules=(TransformerLayer,))
        for model in build_model_chunks(config, model_provider, pg_collection, device,
                                        weights_from_checkpoint=weights_from_checkpoint)]
    optimizer = get_megatron_optimizer(config.optimizer, chunks, pg_collection=pg_collection)
    scheduler = build_opt_param_scheduler(optimizer, config.optimizer, config.scheduler)
    return chunks, optimizer, scheduler


def schedule_config(config, model_chunks, pg_collection, optimizer=None) -> PipelineConfig:
    """The pipeline schedule's configuration for this run; with an fp16 ``optimizer`` the last
    stage's loss is multiplied by its loss scale before backward (``grad_scale_func``)."""
    scaler = None if optimizer is None else optimizer.grad_scaler
    return PipelineConfig(
        hidden_size=config.model.hidden_size,
        params_dtype=config.model.params_dtype,
        grad_scale_func=None if scaler is None else optimizer.scale_loss,
        calculate_per_token_loss=config.training.calculate_per_token_loss,
        tensor_model_parallel_size=config.parallel.tensor_model_parallel_size,
        sequence_parallel=config.model.sequence_parallel,
        context_parallel_size=config.parallel.context_parallel_size,
        finalize_model_grads_func=partial(finalize_model_grads, pg_collection=pg_collection),
        # Interleaved: every chunk's reduction is held back until its last micro-batch.
        no_sync_func=(model_chunks[0].no_sync if len(model_chunks) == 1
                      else [chunk.no_sync for chunk in model_chunks]))


def _samples(config, iteration: int = 0, consumed_valid: int = 0) -> list:
    """Samples each split must provide: Megatron's ``train_valid_test_num_samples``, with the
    validation split grown to ``consumed_valid`` plus the evaluations still to come after
    ``iteration`` when a resumed run needs more than its own plan (a run continued to more
    iterations or at another ``--eval-interval`` than the run that saved, whose evaluations,
    its final one included, consumed more than the new plan counts; Megatron-LM's sampler stops
    there). A run resumed with the saving run's flags needs exactly its plan, so its split, and
    with it every validation batch, is the uninterrupted run's."""
    from megatron.data.dataset_builder import get_train_valid_test_num_samples

    training = config.training
    # Evaluations follow the iterations (more of them under a ramp-up), the training split the
    # samples: Megatron's arithmetic after update_train_iters.
    samples = get_train_valid_test_num_samples(
        global_batch_size=training.global_batch_size, train_iters=training.num_iterations,
        eval_interval=training.eval_interval, eval_iters=training.eval_iters)
    if training.train_samples:
        samples[0] = training.train_samples
    if consumed_valid and samples[1]:  # a run that evaluates (none: no validation split)
        last, done = training.num_iterations, min(iteration, training.num_iterations)
        evaluations = last // training.eval_interval - done // training.eval_interval + 1
        needed = consumed_valid + evaluations * training.eval_iters * training.global_batch_size
        samples[1] = max(samples[1], needed)
    return samples


def build_data_iterators(config, datasets_provider, pg_collection, consumed_train: int,
                         consumed_valid: int, iteration: int = 0):
    """``(train, valid, test)`` iterators over this data-parallel rank's micro-batches, resuming
    after ``consumed_*`` samples (``iteration``: the loaded one, which with ``consumed_valid``
    sizes the validation split, see :func:`_samples`); None for an absent split. With virtual
    pipeline stages each split is a list of iterators, one per model chunk, over the same
    micro-batches (Megatron-LM builds one data iterator per chunk too).

    ``datasets_provider(config, [train, valid, test] samples) -> (train, valid, test)``. Every
    rank reads its micro-batches itself (the ranks of one tensor/pipeline group read the same
    samples): later stages need the position ids and document masks of
    ``--reset-position-ids`` / ``--reset-attention-mask`` too, and reading an mmap'd sample costs
    less than broadcasting it.
    """
    from megatron.data.samplers import build_pretraining_data_loader, cyclic_iter

    datasets = datasets_provider(config, _samples(config, iteration, consumed_valid))
    consumed = (consumed_train, consumed_valid, 0)
    vp = pg_collection.virtual_pipeline_model_parallel_size
    data, dp = config.data, pg_collection.dp

    def make(ds, start):
        loader = build_pretraining_data_loader(
            ds, start, micro_batch_size=config.training.micro_batch_size,
            data_parallel_rank=dp.rank, data_parallel_size=dp.size,
            dataloader_type=data.dataloader_type, num_workers=data.num_workers,
            seed=config.training.seed)
        return cyclic_iter(loader) if data.dataloader_type == "cyclic" else iter(loader)

    iterators = []
    for ds, start in zip(datasets, consumed):
        if ds is None or len(ds) == 0:
            iterators.append(None)
        elif vp is None:
            iterators.append(make(ds, start))
        else:
            iterators.append([make(ds, start) for _ in range(vp)])
    return tuple(iterators)

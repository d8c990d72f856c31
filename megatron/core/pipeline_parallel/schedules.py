"""Forward/backward schedules over micro-batches: no pipelining and 1F1B (the interleaved 1F1B
schedule lives in :mod:`~megatron.core.pipeline_parallel.interleaved` and is re-exported here).

Follows Megatron-Core ``megatron/core/pipeline_parallel/schedules.py`` (the 1F1B schedule of
PipeDream-Flush, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2). Every schedule takes the same keyword arguments::

    losses = get_forward_backward_func(pg_collection)(
        forward_step_func=forward_step, data_iterator=it, model=model,
        num_microbatches=m, seq_length=s, micro_batch_size=b, forward_only=False,
        config=PipelineConfig(hidden_size=h), pg_collection=pg_collection)

and returns the list of per-micro-batch loss dicts on the last pipeline stage (empty elsewhere).

``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``; on the last stage
``loss_func(output_tensor)`` returns ``(loss, num_tokens, loss_dict)`` (Megatron-Core's current
convention: ``loss`` is the *sum* of the masked per-token losses of the micro-batch and
``num_tokens`` their count) or the legacy ``(loss, loss_dict)`` (``loss`` already averaged over the
micro-batch's tokens). The schedule scales the loss it back-propagates so that gradients are those
of the mean over micro-batches, exactly as one large batch would give:

* ``(loss, num_tokens, dict)``: ``loss / max(num_tokens, 1) / num_microbatches``; with
  ``config.calculate_per_token_loss`` the loss is back-propagated unscaled and the schedule hands the
  total number of tokens to ``config.finalize_model_grads_func(model_chunks, num_tokens=total)``,
  which divides the gradients by the global token count (after summing it over the data-parallel
  group and taking it from the last pipeline stage: only the last stage counts tokens here).
* ``(loss, dict)``: ``loss / num_microbatches``.

The loss dicts are returned unchanged: reducing them for logging is the training loop's job.
The pipeline group and this rank's stage come from ``pg_collection`` (a
:class:`~megatron.core.process_groups.ProcessGroupCollection`), never from the registry.
"""

from __future__ import annotations

import contextlib

from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.common import (  # noqa: F401 - PipelineConfig re-exported
    MicroBatchRunner, PipelineConfig, backward_step, deallocate_output_tensor, get_tensor_shape)
from megatron.core.pipeline_parallel.interleaved import (
    forward_backward_pipelining_with_interleaving)


def get_forward_backward_func(pg_collection):
    """The schedule for the layout of ``pg_collection``: interleaved 1F1B when PP > 1 with
    virtual stages, 1F1B when PP > 1, else no pipelining."""
    if pg_collection.pp.size > 1:
        if pg_collection.virtual_pipeline_model_parallel_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def get_num_warmup_microbatches(num_microbatches: int, pipeline_parallel_size: int,
                                pipeline_parallel_rank: int) -> int:
    """Forward passes a stage runs before its first backward in 1F1B: ``PP - rank - 1``, capped
    by the number of micro-batches."""
    return min(pipeline_parallel_size - pipeline_parallel_rank - 1, num_microbatches)


def _single_chunk(model, data_iterator):
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"this schedule runs one model chunk, got {len(model)}; several chunks "
                             "need the interleaved schedule (--virtual-pipeline-model-parallel-size)")
        model = model[0]
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != 1:
            raise ValueError(f"this schedule takes one data iterator, got {len(data_iterator)}")
        data_iterator = data_iterator[0]
    return model, data_iterator


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches: int,
                                   seq_length: int, micro_batch_size: int, forward_only: bool = False,
                                   config: PipelineConfig, pg_collection) -> list:
    """Forward and backward of every micro-batch in turn on one stage (PP = 1).

    Gradients accumulate over micro-batches; data-parallel reduction is held back with
    ``config.no_sync_func`` until the last one. ``seq_length``, ``micro_batch_size`` and
    ``pg_collection`` are unused (kept for a uniform signature).

    Returns:
        The per-micro-batch loss dicts from ``loss_func``.
    """
    model, data_iterator = _single_chunk(model, data_iterator)
    no_sync = config.no_sync_func or contextlib.nullcontext
    runner = MicroBatchRunner(forward_step_func, data_iterator, num_microbatches, forward_only,
                              config)

    def one(i):
        output = runner.forward(model, None, is_last_stage=True)
        if not forward_only:
            backward_step(None, output, None, config)

    with no_sync():
        for i in range(num_microbatches - 1):
            one(i)
    one(num_microbatches - 1)  # outside no_sync: its backward may start the grad reduction
    runner.finalize([model])
    return runner.store


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, forward_only: bool = False, config: PipelineConfig,
        pg_collection) -> list:
    """Non-interleaved 1F1B (Megatron-Core's algorithm).

    Stage ``r`` of ``PP`` runs ``w = min(PP - r - 1, m)`` warmup forwards, then ``m - w`` steady
    steps of one forward and one backward, then ``w`` cooldown backwards; at most ``w + 1``
    micro-batches' activations are alive at once. Neighbours exchange ``[s, b, h]`` activations and
    gradients through :mod:`~megatron.core.pipeline_parallel.p2p_communication` on the pipeline
    group ``pg_collection.pp``. In forward-only mode the forwards run under ``torch.no_grad`` and nothing is kept.

    Returns:
        The per-micro-batch loss dicts on the last stage, ``[]`` on the others.

    Raises:
        ValueError: for several model chunks, or a sequence not divisible by TP under sequence
            parallelism.
    """
    model, data_iterator = _single_chunk(model, data_iterator)
    shape = get_tensor_shape(seq_length, micro_batch_size, config)
    pp = pg_collection.pp
    rank, is_last = pp.rank, pg_collection.is_pipeline_last_stage()
    num_warmup = get_num_warmup_microbatches(num_microbatches, pp.size, rank)
    num_remaining = num_microbatches - num_warmup
    runner = MicroBatchRunner(forward_step_func, data_iterator, num_microbatches, forward_only,
                              config)
    input_tensors, output_tensors = [], []  # FIFO of micro-batches awaiting backward

    # Gradient reduction is held back until the last backward (as in Megatron-Core: with an
    # overlapping grad_sync_func only stage 0 lets the hooks launch it, the others call it below).
    no_sync = (config.no_sync_func or contextlib.nullcontext)()
    no_sync.__enter__()
    sync_open = True

    def enable_grad_sync():
        nonlocal sync_open
        if sync_open:
            no_sync.__exit__(None, None, None)
            sync_open = False

    def run_forward(input_tensor):
        return runner.forward(model, input_tensor, is_last)

    def run_backward(output_grad, last: bool):
        if last and (config.grad_sync_func is None or rank == 0):
            enable_grad_sync()
        return backward_step(input_tensors.pop(0), output_tensors.pop(0), output_grad, config)

    for _ in range(num_warmup):
        input_tensor = p2p.recv_forward(shape, config, pp, requires_grad=not forward_only)
        output = run_forward(input_tensor)
        p2p.send_forward(output, shape, config, pp)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output)
            deallocate_output_tensor(output, config)

    if num_remaining > 0:
        input_tensor = p2p.recv_forward(shape, config, pp, requires_grad=not forward_only)
    for i in range(num_remaining):
        last_iteration = i == num_remaining - 1
        output = run_forward(input_tensor)
        if forward_only:
            p2p.send_forward(output, shape, config, pp)
            if not last_iteration:
                input_tensor = p2p.recv_forward(shape, config, pp, requires_grad=False)
            continue
        output_grad = p2p.send_forward_recv_backward(output, shape, config, pp)
        input_tensors.append(input_tensor)
        output_tensors.append(output)
        deallocate_output_tensor(output, config)
        input_grad = run_backward(output_grad, last=last_iteration and num_warmup == 0)
        if last_iteration:
            p2p.send_backward(input_grad, shape, config, pp)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, shape, config, pp)

    if not forward_only:
        for i in range(num_warmup):
            output_grad = p2p.recv_backward(shape, config, pp)
            input_grad = run_backward(output_grad, last=i == num_warmup - 1)
            p2p.send_backward(input_grad, shape, config, pp)
        if sync_open:
            enable_grad_sync()
            if config.grad_sync_func is not None:
                config.grad_sync_func(model.parameters())
    else:
        enable_grad_sync()
    runner.finalize([model])
    return runner.store

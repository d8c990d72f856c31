"""Forward/backward schedules over micro-batches: no pipelining and 1F1B (the interleaved 1F1B
schedule lives in :mod:`~megatron.core.pipeline_parallel.interleaved` and is re-exported here).

Follows Megatron-Core ``megatron/core/pipeline_parallel/schedules.py`` (the 1F1B schedule of
PipeDream-Flush, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2). Every schedule takes the same keyword arguments::

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=it, model=model,
        num_microbatches=m, seq_length=s, micro_batch_size=b, forward_only=False,
        config=PipelineConfig(hidden_size=h))

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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import p2p_communication as p2p


@dataclass
class PipelineConfig:
    """What the schedules need to know (a subset of Megatron-Core's ``ModelParallelConfig``).

    Attributes:
        hidden_size: h of the ``[s, b, h]`` activations exchanged between stages.
        params_dtype: dtype of those activations (``torch.float32``, or the bf16/fp16 model dtype).
        calculate_per_token_loss: do not divide losses by tokens and micro-batches; hand the token
            count to ``finalize_model_grads_func`` instead (``--calculate-per-token-loss``).
        sequence_parallel: activations are ``[s / TP, b, h]`` (``--sequence-parallel``).
        tensor_model_parallel_size: TP, used for the sequence-parallel shape.
        grad_sync_func: ``f(params)`` that starts the data-parallel gradient reduction of a model
            chunk (overlapped with the pipeline's cooldown); None when reduced in finalize.
        finalize_model_grads_func: ``f(model_chunks, *, num_tokens=None)`` called once after the last
            backward (DP all-reduce, tied-embedding all-reduce, per-token scaling).
        no_sync_func: a context-manager factory (e.g. ``DistributedDataParallel.no_sync``) that holds
            back gradient reduction during all but the last micro-batch.
        grad_scale_func: ``f(loss) -> scaled loss`` applied before the last stage's backward
            (fp16 loss scaling); None for none.
        deallocate_pipeline_outputs: free the data of an output activation once it is sent (its
            autograd graph is kept): the memory saving of Megatron-Core's ``deallocate_output_tensor``.
    """

    hidden_size: int
    params_dtype: torch.dtype = torch.float32
    calculate_per_token_loss: bool = False
    sequence_parallel: bool = False
    tensor_model_parallel_size: int = 1
    grad_sync_func: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    deallocate_pipeline_outputs: bool = True


def get_forward_backward_func():
    """The schedule for the registry's layout: interleaved 1F1B when PP > 1 with virtual stages,
    1F1B when PP > 1, else no pipelining."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        if ps.get_virtual_pipeline_model_parallel_world_size() is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def get_tensor_shape(seq_length: int, micro_batch_size: int, config: PipelineConfig) -> List[int]:
    """``[s, b, h]`` of the activations between stages (``[s / TP, b, h]`` under sequence parallel).

    Raises:
        ValueError: if sequence parallelism is on and ``seq_length`` is not divisible by TP.
    """
    s = seq_length
    if config.sequence_parallel:
        tp = config.tensor_model_parallel_size
        if s % tp != 0:
            raise ValueError(f"--seq-length ({s}) must be divisible by --tensor-model-parallel-size "
                             f"({tp}) with --sequence-parallel")
        s //= tp
    return [s, micro_batch_size, config.hidden_size]


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


def _set_input_tensor(model, input_tensor):
    # Wrappers (DistributedDataParallel, Float16Module) keep the stage in ``.module``.
    while not hasattr(model, "set_input_tensor") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "set_input_tensor"):
        if input_tensor is None:
            return
        raise TypeError(f"{type(model).__name__} has no set_input_tensor(tensor); a pipeline stage "
                        "other than the first needs it to take the previous stage's activation")
    model.set_input_tensor(input_tensor)


def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                 forward_data_store, config, is_last_stage):
    """One micro-batch forward on one stage (Megatron-Core ``forward_step``).

    Returns:
        ``(output_tensor, num_tokens)``: the ``[s, b, h]`` activation, or on the last stage the
        scaled scalar loss to back-propagate; ``num_tokens`` is a 0-d int64 tensor on the loss's
        device (0 on the CPU off the last stage). Appends the loss dict to ``forward_data_store`` on the last stage.

    Raises:
        ValueError: if ``loss_func`` does not return 2 or 3 values.
    """
    _set_input_tensor(model, input_tensor)
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    num_tokens = torch.zeros([], dtype=torch.int64)
    if not is_last_stage:
        return output_tensor, num_tokens
    outputs = loss_func(output_tensor)
    if len(outputs) == 3:
        loss, num_tokens, loss_dict = outputs
        # Stays on its device: moving it to the CPU would synchronize with the GPU every micro-batch.
        num_tokens = torch.as_tensor(num_tokens).detach().to(torch.int64)
        if not config.calculate_per_token_loss:
            # clamp: a micro-batch whose tokens are all masked contributes zero, not NaN.
            loss = loss / num_tokens.clamp(min=1).to(loss.device, loss.dtype) / num_microbatches
    elif len(outputs) == 2:
        loss, loss_dict = outputs
        loss = loss / num_microbatches
    else:
        raise ValueError("loss_func must return (loss, num_tokens, loss_dict) or (loss, loss_dict), "
                         f"got {len(outputs)} values")
    forward_data_store.append(loss_dict)
    return loss, num_tokens


def deallocate_output_tensor(out: Optional[torch.Tensor], config: PipelineConfig) -> None:
    """Replace the data of a sent activation by one element, keeping its autograd graph.

    The stage needs the output only as the root of its backward; the data (``s*b*h`` elements per
    micro-batch in flight) is dead weight. Views are left alone: freeing them saves nothing.
    """
    if out is None or not config.deallocate_pipeline_outputs or out._base is not None:
        return
    if out.numel() > 1:
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _run_backward(output, grad_output):
    if grad_output is not None and output.shape != grad_output.shape:
        # A deallocated output: torch.autograd.backward would reject the shape mismatch, the engine
        # itself only needs the graph (Megatron-Core ``custom_backward``).
        from torch.autograd.variable import Variable
        Variable._execution_engine.run_backward(
            tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
            inputs=tuple(), allow_unreachable=True, accumulate_grad=True)
    else:
        torch.autograd.backward(output, grad_tensors=grad_output)


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Back-propagate one micro-batch through one stage (Megatron-Core ``backward_step``).

    Args:
        input_tensor: the stage's received ``[s, b, h]`` input (a leaf), None on the first stage.
        output_tensor: the stage's output, or the scalar loss on the last stage.
        output_tensor_grad: the gradient of ``output_tensor`` from the next stage (None on the last).

    Returns:
        The gradient of ``input_tensor`` (``[s, b, h]``), or None on the first stage.
    """
    if output_tensor_grad is None and config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    if output_tensor.requires_grad:
        _run_backward(output_tensor, output_tensor_grad)
    if input_tensor is None:
        return None
    if input_tensor.grad is None:
        # The stage did not use its input (possible in tests and odd models): the gradient is 0.
        return torch.zeros_like(input_tensor)
    return input_tensor.grad


class _MicroBatchRunner:
    """Runs forward steps for a schedule and keeps what they leave behind: the loss dicts and the
    number of tokens (for ``calculate_per_token_loss``)."""

    def __init__(self, forward_step_func, data_iterator, num_microbatches, forward_only, config):
        self.forward_step_func = forward_step_func
        self.data_iterator = data_iterator
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.config = config
        self.store: list = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int64)

    def forward(self, model, input_tensor, is_last_stage, data_iterator=None):
        grad_mode = torch.no_grad() if self.forward_only else contextlib.nullcontext()
        with grad_mode:
            output, num_tokens = forward_step(
                self.forward_step_func,
                self.data_iterator if data_iterator is None else data_iterator, model,
                self.num_microbatches, input_tensor, self.store, self.config, is_last_stage)
        # A 0-d CPU tensor combines with a CUDA one: the sum lands on the loss's device.
        self.total_num_tokens = num_tokens + self.total_num_tokens
        return output

    def finalize(self, model_chunks):
        """Call ``config.finalize_model_grads_func`` once after the last backward."""
        config = self.config
        if config.finalize_model_grads_func is not None and not self.forward_only:
            config.finalize_model_grads_func(
                model_chunks,
                num_tokens=self.total_num_tokens if config.calculate_per_token_loss else None)


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches: int,
                                   seq_length: int, micro_batch_size: int, forward_only: bool = False,
                                   config: PipelineConfig) -> list:
    """Forward and backward of every micro-batch in turn on one stage (PP = 1).

    Gradients accumulate over micro-batches; data-parallel reduction is held back with
    ``config.no_sync_func`` until the last one. ``seq_length`` and ``micro_batch_size`` are unused
    (kept for a uniform signature).

    Returns:
        The per-micro-batch loss dicts from ``loss_func``.
    """
    model, data_iterator = _single_chunk(model, data_iterator)
    no_sync = config.no_sync_func or contextlib.nullcontext
    runner = _MicroBatchRunner(forward_step_func, data_iterator, num_microbatches, forward_only,
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
        micro_batch_size: int, forward_only: bool = False, config: PipelineConfig) -> list:
    """Non-interleaved 1F1B (Megatron-Core's algorithm).

    Stage ``r`` of ``PP`` runs ``w = min(PP - r - 1, m)`` warmup forwards, then ``m - w`` steady
    steps of one forward and one backward, then ``w`` cooldown backwards; at most ``w + 1``
    micro-batches' activations are alive at once. Neighbours exchange ``[s, b, h]`` activations and
    gradients through :mod:`~megatron.core.pipeline_parallel.p2p_communication` on the pipeline
    group. In forward-only mode the forwards run under ``torch.no_grad`` and nothing is kept.

    Returns:
        The per-micro-batch loss dicts on the last stage, ``[]`` on the others.

    Raises:
        ValueError: for several model chunks, or a sequence not divisible by TP under sequence
            parallelism.
    """
    model, data_iterator = _single_chunk(model, data_iterator)
    shape = get_tensor_shape(seq_length, micro_batch_size, config)
    rank = ps.get_pipeline_model_parallel_rank()
    is_first = ps.is_pipeline_first_stage()
    is_last = ps.is_pipeline_last_stage()
    num_warmup = get_num_warmup_microbatches(num_microbatches,
                                             ps.get_pipeline_model_parallel_world_size(), rank)
    num_remaining = num_microbatches - num_warmup
    runner = _MicroBatchRunner(forward_step_func, data_iterator, num_microbatches, forward_only,
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
        input_tensor = p2p.recv_forward(shape, config, requires_grad=not forward_only)
        output = run_forward(input_tensor)
        p2p.send_forward(output, shape, config)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output)
            deallocate_output_tensor(output, config)

    if num_remaining > 0:
        input_tensor = p2p.recv_forward(shape, config, requires_grad=not forward_only)
    for i in range(num_remaining):
        last_iteration = i == num_remaining - 1
        output = run_forward(input_tensor)
        if forward_only:
            p2p.send_forward(output, shape, config)
            if not last_iteration:
                input_tensor = p2p.recv_forward(shape, config, requires_grad=False)
            continue
        output_grad = p2p.send_forward_recv_backward(output, shape, config)
        input_tensors.append(input_tensor)
        output_tensors.append(output)
        deallocate_output_tensor(output, config)
        input_grad = run_backward(output_grad, last=last_iteration and num_warmup == 0)
        if last_iteration:
            p2p.send_backward(input_grad, shape, config)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, shape, config)

    if not forward_only:
        for i in range(num_warmup):
            output_grad = p2p.recv_backward(shape, config)
            input_grad = run_backward(output_grad, last=i == num_warmup - 1)
            p2p.send_backward(input_grad, shape, config)
        if sync_open:
            enable_grad_sync()
            if config.grad_sync_func is not None:
                config.grad_sync_func(model.parameters())
    else:
        enable_grad_sync()
    runner.finalize([model])
    return runner.store


# At the end: interleaved.py builds on the helpers above (a circular import resolved by order).
from megatron.core.pipeline_parallel.interleaved import (  # noqa: E402
    forward_backward_pipelining_with_interleaving,
)

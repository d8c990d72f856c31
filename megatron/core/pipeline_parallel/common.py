"""What every pipeline schedule shares: its configuration, the activation shape, and one
micro-batch's forward and backward on one stage (Megatron-Core's ``forward_step`` /
``backward_step``, ``deallocate_output_tensor``).

:mod:`~megatron.core.pipeline_parallel.schedules` (no pipelining, 1F1B) and
:mod:`~megatron.core.pipeline_parallel.interleaved` both build on this module; neither imports the
other's internals.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch


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
        context_parallel_size: CP: each rank holds ``s / CP`` tokens of every sequence.
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
    context_parallel_size: int = 1
    grad_sync_func: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    deallocate_pipeline_outputs: bool = True


def get_tensor_shape(seq_length: int, micro_batch_size: int, config: PipelineConfig) -> List[int]:
    """``[s, b, h]`` of the activations between stages: ``s`` is ``seq_length / CP`` (this
    context-parallel rank's tokens), divided by TP again under sequence parallelism.

    Raises:
        ValueError: if sequence parallelism is on and ``seq_length`` is not divisible by TP.
    """
    # Validation checked the divisibility (megatron.core.context_parallel.split).
    s = seq_length // config.context_parallel_size
    if config.sequence_parallel:
        tp = config.tensor_model_parallel_size
        if s % tp != 0:
            raise ValueError(f"--seq-length ({s}) must be divisible by --tensor-model-parallel-size "
                             f"({tp}) with --sequence-parallel")
        s //= tp
    return [s, micro_batch_size, config.hidden_size]


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


class MicroBatchRunner:
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

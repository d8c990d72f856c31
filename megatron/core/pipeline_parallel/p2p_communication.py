"""Point-to-point communication between neighbouring pipeline stages.

Activations flow forward (stage p -> p + 1) and their gradients flow backward (p + 1 -> p) as
``[s, b, h]`` tensors (s = sequence, b = micro-batch, h = hidden; s / TP under sequence
parallelism). Every exchange goes through :func:`communicate`, which posts all sends and receives of
one step as a single ``torch.distributed.batch_isend_irecv`` on the pipeline group it is given
(``pp_group``, a :class:`~megatron.core.process_groups.ParallelGroup`: the group, its ranks and
this rank's stage) and waits for them, as Megatron-Core's ``p2p_communication._communicate`` does with ``batch_p2p_comm``.

Deadlock freedom (gloo and NCCL): both ends of a link post their operations in the same order,
forward-flow first (send to next, receive from previous), then backward-flow (send to previous,
receive from next), and each flow has its own tag. With PP = 2 the next and the previous rank are
the same process, so the order and the tags keep an activation from being matched with a gradient.
Gloo honours the tags; NCCL matches per peer in posting order, which the fixed order makes agree.

The helpers named after Megatron-Core (``recv_forward``, ``send_forward_recv_backward``, ...) do
nothing on the stage that has no such neighbour (first stage: nothing to receive forward; last
stage: nothing to send forward) and return None there, so a schedule is written once for all
stages. The interleaved schedule, which wraps around from the last stage to the first, calls
:func:`communicate` directly.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.process_groups import ParallelGroup

_FORWARD_TAG = 0   # activations, stage p -> p + 1
_BACKWARD_TAG = 1  # gradients of activations, stage p + 1 -> p


def _comm_device(group) -> torch.device:
    """NCCL communicates CUDA tensors (the current device); gloo CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_send(tensor: torch.Tensor, tensor_shape: Sequence[int], dtype: torch.dtype, what: str):
    # The receiver allocates its buffer from (tensor_shape, dtype) alone; a mismatch would hang or
    # deliver garbage on the other side, so it is refused here, where the cause is visible.
    if tuple(tensor.shape) != tuple(tensor_shape) or tensor.dtype != dtype:
        raise ValueError(
            f"pipeline {what}: tensor has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, but "
            f"the schedule expects {tuple(tensor_shape)} {dtype} ([seq_length (/TP under "
            "--sequence-parallel), micro_batch_size, hidden_size] in config.params_dtype); check "
            "--seq-length, --micro-batch-size, --hidden-size and the model's output")


def communicate(*, tensor_send_next: Optional[torch.Tensor], tensor_send_prev: Optional[torch.Tensor],
                recv_prev: bool, recv_next: bool, tensor_shape: Sequence[int], config,
                pp_group: ParallelGroup, requires_grad: bool = True
                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Exchange tensors with the previous and next pipeline stage in one batched step.

    Collective over the pipeline-parallel group (``batch_isend_irecv``): the matching calls on the
    neighbouring stages must happen in the same schedule step. Blocks until every operation is done.

    Args:
        tensor_send_next: ``[s, b, h]`` activation for the next stage, or None.
        tensor_send_prev: ``[s, b, h]`` gradient for the previous stage, or None.
        recv_prev: receive an activation from the previous stage.
        recv_next: receive a gradient from the next stage.
        tensor_shape: ``[s, b, h]`` of every tensor exchanged.
        config: a :class:`~megatron.core.pipeline_parallel.schedules.PipelineConfig`; its
            ``params_dtype`` is the dtype on the wire.
        pp_group: the pipeline-parallel group (``ProcessGroupCollection.pp``); its next and
            previous ranks wrap around.
        requires_grad: mark received tensors as autograd leaves (False in forward-only runs).

    Returns:
        ``(tensor_recv_prev, tensor_recv_next)``, each ``[s, b, h]`` in ``config.params_dtype`` on
        the communication device (CPU for gloo, the current CUDA device for NCCL), or None.

    Raises:
        ValueError: if a tensor to send does not have ``tensor_shape`` and ``config.params_dtype``.
    """
    group = pp_group.group
    next_rank, prev_rank = pp_group.neighbour(1), pp_group.neighbour(-1)
    device = _comm_device(group)
    dtype = config.params_dtype

    def buffer():
        return torch.empty(tuple(tensor_shape), dtype=dtype, device=device)

    recv_prev_buf = buffer() if recv_prev else None
    recv_next_buf = buffer() if recv_next else None
    # Fixed order, forward flow then backward flow: see the module docstring.
    plan = [(dist.isend, tensor_send_next, next_rank, _FORWARD_TAG, "send to next stage"),
            (dist.irecv, recv_prev_buf, prev_rank, _FORWARD_TAG, None),
            (dist.isend, tensor_send_prev, prev_rank, _BACKWARD_TAG, "send to previous stage"),
            (dist.irecv, recv_next_buf, next_rank, _BACKWARD_TAG, None)]
    ops = []
    for op, tensor, peer, tag, what in plan:
        if tensor is None:
            continue
        if op is dist.isend:
            _check_send(tensor, tensor_shape, dtype, what)
            tensor = tensor.detach().contiguous()
        ops.append(dist.P2POp(op, tensor, peer, group, tag))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        if device.type == "cuda":
            # batch_isend_irecv runs on NCCL's stream; later kernels on the default stream must
            # see the received data (Megatron-Core synchronizes here as well).
            torch.cuda.synchronize()
    if requires_grad:
        for t in (recv_prev_buf, recv_next_buf):
            if t is not None:
                t.requires_grad_()
    return recv_prev_buf, recv_next_buf


def _first(pp_group: ParallelGroup) -> bool:
    return pp_group.rank == 0


def _last(pp_group: ParallelGroup) -> bool:
    return pp_group.rank == pp_group.size - 1


def recv_forward(tensor_shape, config, pp_group: ParallelGroup,
                 requires_grad: bool = True) -> Optional[torch.Tensor]:
    """Receive the input activation from the previous stage (None on the first stage)."""
    if _first(pp_group):
        return None
    return communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True,
                       recv_next=False, tensor_shape=tensor_shape, config=config,
                       pp_group=pp_group, requires_grad=requires_grad)[0]


def recv_backward(tensor_shape, config, pp_group: ParallelGroup) -> Optional[torch.Tensor]:
    """Receive the gradient of this stage's output from the next stage (None on the last stage)."""
    if _last(pp_group):
        return None
    return communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False,
                       recv_next=True, tensor_shape=tensor_shape, config=config,
                       pp_group=pp_group)[1]


def send_forward(output_tensor, tensor_shape, config, pp_group: ParallelGroup) -> None:
    """Send this stage's output activation to the next stage (no-op on the last stage)."""
    if _last(pp_group):
        return
    communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False,
                recv_next=False, tensor_shape=tensor_shape, config=config, pp_group=pp_group)


def send_backward(input_tensor_grad, tensor_shape, config, pp_group: ParallelGroup) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on the first stage)."""
    if _first(pp_group):
        return
    communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                recv_next=False, tensor_shape=tensor_shape, config=config, pp_group=pp_group)


def send_forward_recv_backward(output_tensor, tensor_shape, config,
                               pp_group: ParallelGroup) -> Optional[torch.Tensor]:
    """Send the output forward and receive its gradient, in one step (None on the last stage)."""
    if _last(pp_group):
        return None
    return communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False,
                       recv_next=True, tensor_shape=tensor_shape, config=config,
                       pp_group=pp_group)[1]


def send_backward_recv_forward(input_tensor_grad, tensor_shape, config,
                               pp_group: ParallelGroup) -> Optional[torch.Tensor]:
    """Send the input gradient backward and receive the next input, in one step (None on the
    first stage)."""
    if _first(pp_group):
        return None
    return communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=True,
                       recv_next=False, tensor_shape=tensor_shape, config=config,
                       pp_group=pp_group)[0]

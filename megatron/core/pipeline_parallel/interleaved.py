"""Interleaved 1F1B: each pipeline rank holds ``v`` model chunks (virtual pipeline stages).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 2.2.2; the algorithm of Megatron-Core's
``forward_backward_pipelining_with_interleaving`` with synchronous batched communication (no
overlap of communication with compute) and micro-batch groups of PP (Megatron's default
``microbatch_group_size_per_vp_stage``).

Virtual stage ``c * PP + r`` is chunk ``c`` of pipeline rank ``r``: activations go from rank r to
r + 1 within a chunk and from the last rank's chunk c to the first rank's chunk c + 1 (the wrap of
the pipeline group's next/previous rank). Micro-batches run in groups of PP per chunk::

    virtual micro-batch k | 0 1 2 3 4 5 6 7      (PP = 2, v = 2, m = 4)
    micro-batch           | 0 1 0 1 2 3 2 3
    chunk (forward)       | 0 0 1 1 0 0 1 1      backward visits the chunks in reverse

The bubble shrinks by ``1 / v`` against 1F1B, at ``v`` times the point-to-point traffic.
"""

from __future__ import annotations

import contextlib
from typing import Tuple

from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.common import (MicroBatchRunner, PipelineConfig, backward_step,
                                                    deallocate_output_tensor, get_tensor_shape)


def get_model_chunk_id(virtual_microbatch_id: int, pipeline_parallel_size: int,
                       num_model_chunks: int, forward: bool) -> int:
    """The model chunk that the ``virtual_microbatch_id``-th forward (or backward) step runs."""
    in_group = virtual_microbatch_id % (pipeline_parallel_size * num_model_chunks)
    chunk = in_group // pipeline_parallel_size
    return chunk if forward else num_model_chunks - chunk - 1


def get_microbatch_id(virtual_microbatch_id: int, pipeline_parallel_size: int,
                      num_model_chunks: int) -> int:
    """The micro-batch that the ``virtual_microbatch_id``-th step of a chunk processes."""
    group, in_group = divmod(virtual_microbatch_id, pipeline_parallel_size * num_model_chunks)
    return group * pipeline_parallel_size + in_group % pipeline_parallel_size


def get_interleaved_warmup(num_microbatches: int, pipeline_parallel_size: int,
                           pipeline_parallel_rank: int, num_model_chunks: int,
                           forward_only: bool = False) -> Tuple[int, bool]:
    """Warmup forward steps of a rank, and whether every step is warmup.

    ``2 (PP - rank - 1) + (v - 1) PP`` forwards before the first backward (Megatron-Core), capped
    at the ``m v`` steps; all of them in forward-only mode or when ``m == PP``.
    """
    total = num_microbatches * num_model_chunks
    if forward_only or num_microbatches == pipeline_parallel_size:
        return total, True
    warmup = 2 * (pipeline_parallel_size - pipeline_parallel_rank - 1)
    warmup += (num_model_chunks - 1) * pipeline_parallel_size
    return min(warmup, total), warmup >= total


def _check(model, data_iterator, num_microbatches, pp, vp):
    if not isinstance(model, (list, tuple)):
        raise ValueError("the interleaved schedule takes a list of model chunks, one per virtual "
                         "pipeline stage (--virtual-pipeline-model-parallel-size)")
    if not isinstance(data_iterator, (list, tuple)) or len(data_iterator) != len(model):
        raise ValueError(f"the interleaved schedule takes one data iterator per model chunk "
                         f"({len(model)}), each over the same micro-batches")
    if vp is not None and vp != len(model):
        raise ValueError(f"got {len(model)} model chunks but --virtual-pipeline-model-parallel-size "
                         f"is {vp}")
    if num_microbatches % pp != 0:
        raise ValueError(f"number of micro-batches ({num_microbatches}) must be divisible by "
                         f"--pipeline-model-parallel-size ({pp}) with the interleaved schedule; "
                         "change --global-batch-size or --micro-batch-size")


def _grad_sync_control(config: PipelineConfig, model):
    """Enter/leave the no-sync contexts of every chunk together (Megatron-Core's
    ``disable_grad_sync`` / ``enable_grad_sync``)."""
    factories = config.no_sync_func or contextlib.nullcontext
    if not isinstance(factories, (list, tuple)):
        factories = [factories]
    state = {"stack": None}

    def disable():
        if state["stack"] is None:
            stack = contextlib.ExitStack()
            for factory in factories:
                stack.enter_context(factory())
            state["stack"] = stack

    def enable():
        if state["stack"] is not None:
            state["stack"].close()
            state["stack"] = None

    return disable, enable


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, forward_only: bool = False, config: PipelineConfig,
        pg_collection) -> list:
    """Interleaved 1F1B over ``len(model)`` chunks per pipeline rank.

    Arguments as :func:`~megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving`,
    except that ``model`` and ``data_iterator`` are lists with one entry per chunk (chunk ``c`` of
    rank ``r`` is virtual stage ``c * PP + r``; each iterator yields the same micro-batches).
    ``config.grad_sync_func`` may be one function or one per chunk; so may ``config.no_sync_func``.

    Returns:
        The per-micro-batch loss dicts on the last stage (from the last chunk), ``[]`` elsewhere.

    Raises:
        ValueError: ``model``/``data_iterator`` not lists of equal length, a chunk count different
            from ``pg_collection``'s virtual size, or ``num_microbatches`` not divisible by PP.
    """
    pp_group = pg_collection.pp
    pp = pp_group.size
    _check(model, data_iterator, num_microbatches, pp,
           pg_collection.virtual_pipeline_model_parallel_size)
    v = len(model)
    rank = pp_group.rank
    first_rank = pg_collection.is_pipeline_first_stage()
    last_rank = pg_collection.is_pipeline_last_stage()
    shape = get_tensor_shape(seq_length, micro_batch_size, config)
    total = num_microbatches * v
    num_warmup, all_warmup = get_interleaved_warmup(num_microbatches, pp, rank, v, forward_only)
    num_remaining = total - num_warmup
    runner = MicroBatchRunner(forward_step_func, None, num_microbatches, forward_only, config)
    input_tensors = [[] for _ in range(v)]
    output_tensors = [[] for _ in range(v)]
    output_grads = [[] for _ in range(v)]
    grad_sync = config.grad_sync_func
    grad_sync = list(grad_sync) if isinstance(grad_sync, (list, tuple)) else [grad_sync] * v
    synchronized = set()
    disable_grad_sync, enable_grad_sync = _grad_sync_control(config, model)
    disable_grad_sync()

    def chunk_id(k, forward):
        return get_model_chunk_id(k, pp, v, forward)

    def is_first(c):
        return first_rank and c == 0

    def is_last(c):
        return last_rank and c == v - 1

    def communicate(send_next, send_prev, recv_prev, recv_next):
        received = p2p.communicate(tensor_send_next=send_next, tensor_send_prev=send_prev,
                                   recv_prev=recv_prev, recv_next=recv_next, tensor_shape=shape,
                                   config=config, pp_group=pp_group,
                                   requires_grad=not forward_only)
        if not forward_only:
            deallocate_output_tensor(send_next, config)
        return received

    def forward_helper(k):
        c = chunk_id(k, True)
        if is_first(c) and len(input_tensors[c]) == len(output_tensors[c]):
            input_tensors[c].append(None)
        output = runner.forward(model[c], input_tensors[c][-1], is_last(c), data_iterator[c])
        output_tensors[c].append(output)
        if forward_only:  # nothing is kept for a backward
            input_tensors[c].pop()
            output_tensors[c].pop()
        return None if is_last(c) else output

    def backward_helper(k):
        c = chunk_id(k, False)
        chunk_done = get_microbatch_id(k, pp, v) == num_microbatches - 1
        if chunk_done and grad_sync[c] is None:
            enable_grad_sync()  # the chunk's last backward may launch its reduction
            synchronized.add(c)
        if is_last(c) and not output_grads[c]:
            output_grads[c].append(None)
        grad = backward_step(input_tensors[c].pop(0), output_tensors[c].pop(0),
                             output_grads[c].pop(0), config)
        if chunk_done and grad_sync[c] is not None:
            enable_grad_sync()
            grad_sync[c](model[c].parameters())
            synchronized.add(c)
        disable_grad_sync()
        return None if is_first(c) else grad

    # Warmup: forwards only; the last one also fetches the first gradient.
    input_tensors[0].append(p2p.recv_forward(shape, config, pp_group,
                                             requires_grad=not forward_only))
    for k in range(num_warmup):
        output = forward_helper(k)
        next_c = chunk_id(k + 1, True)
        recv_prev = not (first_rank and next_c == 0) and k != total - 1
        if k == num_warmup - 1 and not forward_only and not all_warmup:
            input_tensor, grad = communicate(output, None, recv_prev, not last_rank)
            output_grads[v - 1].append(grad)
        else:
            input_tensor, _ = communicate(output, None, recv_prev, False)
        input_tensors[next_c].append(input_tensor)

    # Steady state: forward step k + warmup, then backward step k.
    for k in range(num_remaining):
        fk = k + num_warmup
        output = forward_helper(fk)
        input_grad = backward_helper(k)
        if first_rank:  # the wrap: its next input comes from the last rank, PP - 1 steps behind
            next_fc = chunk_id(fk - (pp - 1), True)
            recv_prev = next_fc != v - 1
            next_fc += 1
        else:
            recv_prev, next_fc = True, chunk_id(fk + 1, True)
        if last_rank:
            next_bc = chunk_id(k - (pp - 1), False)
            recv_next = next_bc != 0
            next_bc -= 1
        else:
            recv_next, next_bc = True, chunk_id(k + 1, False)
        if k == num_remaining - 1:
            recv_prev = False
        input_tensor, grad = communicate(output, input_grad, recv_prev, recv_next)
        if recv_prev:
            input_tensors[next_fc].append(input_tensor)
        if recv_next:
            output_grads[next_bc].append(grad)

    # Cooldown: the remaining backwards.
    if not forward_only:
        if all_warmup:
            output_grads[v - 1].append(p2p.recv_backward(shape, config, pp_group))
        for k in range(num_remaining, total):
            input_grad = backward_helper(k)
            next_bc = chunk_id(k + 1, False)
            recv_next = not (last_rank and next_bc == v - 1) and k != total - 1
            output_grads[next_bc].append(communicate(None, input_grad, False, recv_next)[1])
        enable_grad_sync()
        for c in range(v):
            if grad_sync[c] is not None and c not in synchronized:
                grad_sync[c](model[c].parameters())
    enable_grad_sync()
    runner.finalize(list(model))
    return runner.store

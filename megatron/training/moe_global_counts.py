"""The global batch's tokens per expert for ``--moe-router-load-balancing-type global_aux_loss``.

The global load-balancing loss of an iteration is ``c E/(k N^2) sum_e f_e P_e`` over the N tokens
of the whole global batch. Its gradient with respect to a token's scores is
``c E/(k N^2) f_e``: it needs the global counts ``f`` before the first backward, and under
1F1B a micro-batch's backward runs before later micro-batches' forwards. So the iteration starts
with a counting pass: the M micro-batches of every model chunk are taken from the data iterators,
run forward without autograd (the same weights, expert bias and dropout states as the training
forward that follows, restored afterwards), and each MoE layer counts its choices; the counts are
summed over the layer's token group and the data-parallel group. Training then replays the same
micro-batches. The cost is one extra forward per iteration; the loss and its gradient no longer
depend on how the global batch is spread over DP ranks and micro-batches (Megatron-Core's
running average over the micro-batches seen so far does).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core.distributed.model_chunk import as_model_chunk
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import (get_device_rng_states, get_rng_tracker,
                                                  set_device_rng_states)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import counting_pass


def _take(iterator, n: int):
    """``n`` items of ``iterator`` as a list (a list of such lists for one iterator per model
    chunk; None stays None)."""
    if iterator is None:
        return None
    if isinstance(iterator, (list, tuple)):
        return [_take(it, n) for it in iterator]
    return [next(iterator) for _ in range(n)]


def _replay(items):
    if items is None:
        return None
    if items and isinstance(items[0], list):
        return [iter(i) for i in items]
    return iter(items)


def _moe_layers(model) -> List[MoELayer]:
    return [m for chunk in model for m in chunk.modules() if isinstance(m, MoELayer)]


def _counting_loss_tokens(forward_step_func, counted: list):
    """``forward_step_func`` whose loss function also appends its token count to ``counted``."""
    def step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)

        def counting_loss(output_tensor):
            outputs = loss_func(output_tensor)
            if len(outputs) == 3:
                counted.append(torch.as_tensor(outputs[1]).detach().to(torch.int64).cpu())
            return outputs
        return output, counting_loss
    return step


def count_global_batch(forward_step_func, data_iterator, model, *, num_microbatches: int,
                       seq_length: int, micro_batch_size: int, schedule_config, pg_collection,
                       count_experts: bool = True, loss_tokens: Optional[list] = None):
    """Run the counting pass of one iteration and return the data iterator(s) that replay its
    micro-batches; afterwards (``count_experts``) each MoE layer of ``model`` holds
    ``global_counts [E]`` (int64, every choice of the global batch, before capacity) and
    ``global_micro_batches`` (M).

    Args:
        forward_step_func / data_iterator / model / num_microbatches / seq_length /
            micro_batch_size / schedule_config / pg_collection: those of the iteration's
            forward-backward call.
        count_experts: sum the layers' counts over their groups (``global_aux_loss``).
        loss_tokens: a list to which the last pipeline stage appends each micro-batch's loss
            token count (the ``num_tokens`` its loss function returns), for
            ``--calculate-per-token-loss``; None: not counted.
    """
    if loss_tokens is not None:
        forward_step_func = _counting_loss_tokens(forward_step_func, loss_tokens)
    layers = _moe_layers(model)
    items = _take(data_iterator, num_microbatches)
    for chunk in model:
        as_model_chunk(chunk).finish_param_sync()
    for layer in layers:
        layer.start_global_count()
    device_states, tracker_states = get_device_rng_states(), get_rng_tracker().get_states()
    try:
        with torch.no_grad(), counting_pass():
            get_forward_backward_func(pg_collection)(
                forward_step_func=forward_step_func, data_iterator=_replay(items), model=model,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, forward_only=True, config=schedule_config,
                pg_collection=pg_collection)
    finally:
        set_device_rng_states(device_states)
        get_rng_tracker().set_states(tracker_states)
    for layer in layers if count_experts else ():
        layer.finish_global_count()
    return _replay(items)


def needs_global_counts(moe_config) -> bool:
    """Whether the run's MoE section (:class:`~megatron.core.transformer.moe.moe_config.MoEConfig`, or None) asks for
    the counting pass: every rank decides alike (the pass communicates across stages)."""
    return (moe_config is not None and moe_config.is_moe and moe_config.moe_aux_loss_coeff > 0
            and moe_config.moe_router_load_balancing_type == "global_aux_loss")

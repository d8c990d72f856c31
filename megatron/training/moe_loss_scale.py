"""The gradient the router losses inject in one iteration (``aux_loss_scale`` of every MoE
layer, :func:`megatron.core.transformer.moe.moe_utils.set_aux_loss_scale`), set before each
iteration's forward-backward so that it follows the iteration's number of micro-batches
(``--rampup-batch-size`` changes it) and the per-token loss's token count.

The rule: whatever the loss normalisation, a router loss (load-balancing, sequence, z) enters the
optimizer's gradient as the mean over the global batch's micro-batches of the per-micro-batch
loss, ``(1 / (DP M)) sum_{dp, m} d loss_{dp, m}`` (and ``global_aux_loss`` as the one loss of the
global batch), where M is the iteration's micro-batches per DP rank:

- mean loss (the default): the schedule divides each micro-batch's lm loss by M and DDP averages
  over DP x CP; a CP rank's part covers its share of the tokens, so the scale is ``CP / M``.
- ``--calculate-per-token-loss``: the lm loss is back-propagated as a sum over tokens, and
  :func:`~megatron.core.distributed.finalize_model_grads.finalize_model_grads` ends by dividing
  the gradient summed over all ranks by T, the global batch's loss tokens (as it counts them:
  summed over DP x CP). The scale is ``T / (DP M)``, so that the division leaves the mean above.
  T must be known before the first backward (under 1F1B it precedes the last forward), so the
  iteration starts with a forward-only pass over its micro-batches that counts them
  (:func:`~megatron.training.moe_global_counts.count_global_batch`, the pass ``global_aux_loss``
  already runs; one extra forward per iteration when that loss type is not in use).

Under fp16 (a grad scaler) the scale is multiplied by the iteration's loss scale, as the lm loss
is before its backward (Megatron-Core does the same); the step divides both by it.

Megatron-Core instead injects the bare loss under per-token loss, which divides the router losses
by the token count: their weight then changes with the batch's masking and size.
"""

from __future__ import annotations

import torch

from megatron.core.distributed.finalize_model_grads import global_token_count
from megatron.core.transformer.moe.moe_utils import set_aux_loss_scale
from megatron.training.moe_global_counts import count_global_batch, needs_global_counts


def router_loss_scale(*, num_microbatches: int, pg_collection, total_tokens=None) -> float:
    """``CP / M``, or ``T / (DP M)`` under per-token loss (``total_tokens`` = T); see the
    module."""
    if total_tokens is None:
        return pg_collection.cp.size / num_microbatches
    return float(total_tokens) / (pg_collection.dp.size * num_microbatches)


def has_router_losses(moe_config) -> bool:
    """Whether any router loss has a gradient (a load-balancing or z coefficient)."""
    return bool(moe_config.moe_z_loss_coeff) or (
        moe_config.moe_aux_loss_coeff > 0 and
        moe_config.moe_router_load_balancing_type != "none")


def prepare_moe_iteration(forward_step_func, data_iterator, model, *, moe_config,
                          num_microbatches: int, seq_length: int, micro_batch_size: int,
                          schedule_config, pg_collection):
    """Before an iteration's forward-backward: the counting pass when ``global_aux_loss`` or
    per-token loss needs it, then every MoE layer's ``aux_loss_scale``. Returns the data
    iterator(s) the iteration must read (the replay of the counted micro-batches, or the given
    ones). Every rank decides alike (the pass communicates across stages)."""
    if moe_config is None or not moe_config.is_moe:
        return data_iterator
    count_experts = needs_global_counts(moe_config)
    per_token = schedule_config.calculate_per_token_loss and has_router_losses(moe_config)
    total = None
    if count_experts or per_token:
        tokens = [] if per_token else None
        data_iterator = count_global_batch(
            forward_step_func, data_iterator, model, num_microbatches=num_microbatches,
            seq_length=seq_length, micro_batch_size=micro_batch_size,
            schedule_config=schedule_config, pg_collection=pg_collection,
            count_experts=count_experts, loss_tokens=tokens)
        if per_token:
            device = next(p.device for chunk in model for p in chunk.parameters())
            total = global_token_count(sum(int(t) for t in tokens), pg_collection,
                                       device).item()
    scale = router_loss_scale(num_microbatches=num_microbatches, pg_collection=pg_collection,
                              total_tokens=total)
    if schedule_config.grad_scale_func is not None:  # fp16: the lm loss is multiplied by the
        # loss scale before backward and every gradient divided by it at the step: so are these
        scale *= float(schedule_config.grad_scale_func(torch.ones((), dtype=torch.float64)))
    for chunk in model:
        set_aux_loss_scale(chunk, scale)
    return data_iterator

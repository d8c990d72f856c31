"""The loss of a micro-batch split over the context-parallel group.

Each context-parallel rank sums the masked per-token losses of its own tokens. One rule makes
the gradients those of the unsplit micro-batch under both loss conventions of the schedules
(:mod:`megatron.core.pipeline_parallel.schedules`): return ``CP x`` the local sum and the token
count summed over the context-parallel group (Megatron-LM's ``loss_func`` under
``--context-parallel-size``).

* Per micro-batch mean (default): the schedule back-propagates ``CP s_i / N / M`` on rank ``i``
  (``s_i`` its local sum, ``N`` the micro-batch's tokens, ``M`` micro-batches); the gradient
  reduction averages over the ``DP x CP`` ranks, so the CP factor cancels and the result is
  ``sum_i grad(s_i) / N / M``, averaged over DP: the unsplit micro-batch's.
* ``--calculate-per-token-loss``: the schedule back-propagates ``CP s_i`` and
  ``finalize_model_grads`` divides the gradients summed over ``DP x CP`` by the token counts
  summed over ``DP x CP``, which count every token ``CP`` times: the factor cancels again.

Multiplying by a power-of-two ``CP`` is exact in floating point (otherwise one rounding).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist


def reduce_loss_for_context_parallel(loss_sum: torch.Tensor, num_tokens: torch.Tensor,
                                     group) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(CP x loss_sum, num_tokens summed over the context-parallel group)``.

    Args:
        loss_sum: 0-d sum of this rank's masked per-token losses (differentiable).
        num_tokens: 0-d count of this rank's loss tokens (not differentiated).
        group: the context-parallel group; None or a group of one returns the inputs as they are.

    Returns:
        ``(loss, num_tokens)`` to hand to the schedule, as ``loss_func`` returns them.

    Collective: all-reduce (sum) of one number over ``group`` (forward only).
    """
    cp = 1 if group is None else dist.get_world_size(group)
    if cp == 1:
        return loss_sum, num_tokens
    total = num_tokens.detach().clone()
    dist.all_reduce(total, group=group)
    return loss_sum * cp, total

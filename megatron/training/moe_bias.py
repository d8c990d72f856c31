"""The expert-bias update of aux-loss-free balancing (``--moe-router-enable-expert-bias``,
DeepSeek-V3; Megatron-Core calls it from ``finalize_model_grads``): once per iteration, after
the last micro-batch's backward, every router's counted choices are summed over the whole
global batch and the bias moves by Megatron-Core's sign rule
(:func:`~megatron.core.transformer.moe.moe_utils.updated_expert_bias`). The bias is a saved
buffer of the router (``mlp.router.expert_bias`` in the state dict), so checkpoints carry it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import updated_expert_bias


@torch.no_grad()
def update_expert_biases(model_chunks, moe_config, num_layers: int, pg_collection,
                         device) -> None:
    """Collective over the whole world (every rank calls it once per iteration).

    The counts ``[num_layers, E]`` fp64 (exact integers) are summed over every rank: a layer's
    counts come from the ranks of the stage that holds it, each counting its own tokens (TP
    under sequence parallelism, CP and DP split them; EP folds over those ranks), so their sum is
    the global batch's. Every rank holding a layer then applies the same update.
    """
    routers = [(m.layer_number, m.router) for chunk in model_chunks for m in chunk.modules()
               if isinstance(m, MoELayer) and m.router.expert_bias is not None]
    counts = torch.zeros(num_layers, moe_config.num_experts, dtype=torch.float64, device=device)
    for layer_number, router in routers:
        counts[layer_number - 1] = router.local_tokens_per_expert.double()
    if pg_collection.world_size > 1:
        dist.all_reduce(counts)
    for layer_number, router in routers:
        router.expert_bias.copy_(updated_expert_bias(
            router.expert_bias, counts[layer_number - 1], moe_config.moe_router_bias_update_rate))
        router.local_tokens_per_expert.zero_()

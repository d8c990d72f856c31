"""The mixture-of-experts figures of one training iteration, for the log line, TensorBoard and
W&B (Megatron-Core's ``track_moe_metrics``): the router losses as Megatron-Core names them
(``load_balancing_loss``, ``seq_load_balancing_loss``, ``z_loss``; per layer as
``<name> layer <n>`` with ``--moe-per-layer-logging``), each summed over the MoE layers and
averaged over the iteration's micro-batches and data-parallel ranks; and the routing over the
whole global batch: ``tokens per expert min`` / ``max`` (kept top-k choices of the busiest and
idlest expert of any MoE layer) and ``dropped tokens`` (choices over capacity, all layers).
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.moe_layer import MoELayer, collect_aux_losses


def _moe_layers(model_chunks) -> List[MoELayer]:
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def reset_moe_metrics(model_chunks) -> None:
    """Forget what the layers recorded (validation forwards run between training iterations)."""
    for layer in _moe_layers(model_chunks):
        collect_aux_losses(layer)
        layer.routed_counts = layer.dropped_count = None


def moe_iteration_metrics(model_chunks, moe_config, num_layers: int, pg_collection,
                          device) -> Dict[str, float]:
    """Collective over the whole world (every rank calls it once per iteration, after the
    forward-backward): ``{name: float}`` as the module says; resets the layers' records.

    A layer's loss is replicated over the ranks splitting its micro-batch's tokens (TP under SP,
    CP) and differs between data-parallel ranks: the world sum over the ranks of the stage holding
    the layer, divided by their number (TP x CP x DP), is the data-parallel mean. Counts are
    this rank's own tokens: their world sum is the global batch's.
    """
    experts = moe_config.num_experts
    all_names = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
                 "z_loss")
    counts = torch.zeros(num_layers, experts, dtype=torch.float64, device=device)
    dropped = torch.zeros(num_layers, dtype=torch.float64, device=device)
    losses = torch.zeros(num_layers, len(all_names), dtype=torch.float64, device=device)
    present = torch.zeros(num_layers, dtype=torch.float64, device=device)
    for layer in _moe_layers(model_chunks):
        i = layer.layer_number - 1
        present[i] = 1.0
        for name, total in layer.loss_sums.items():
            losses[i, all_names.index(name)] = float(total) / max(layer.num_forwards, 1)
        if layer.routed_counts is not None:
            counts[i] = layer.routed_counts.double()
            dropped[i] = layer.dropped_count.double()
    reset_moe_metrics(model_chunks)
    flat = torch.cat([counts.reshape(-1), dropped, losses.reshape(-1), present])
    if pg_collection.world_size > 1:
        dist.all_reduce(flat)
    n = num_layers * experts
    counts = flat[:n].view(num_layers, experts)
    dropped = flat[n:n + num_layers]
    losses = flat[n + num_layers:n + num_layers + num_layers * len(all_names)].view(
        num_layers, len(all_names))
    ranks = flat[-num_layers:]  # ranks holding each layer: TP x CP x DP of its stage
    moe = ranks > 0
    out: Dict[str, float] = {}
    for j, name in enumerate(all_names):
        if not _any_named(moe_config, name):
            continue
        per_layer = torch.where(moe, losses[:, j] / ranks.clamp(min=1), 0.0)
        out[name] = float(per_layer.sum())
        if moe_config.moe_per_layer_logging:
            for i in torch.nonzero(moe).flatten().tolist():
                out[f"{name} layer {i + 1}"] = float(per_layer[i])
    if bool(moe.any()):
        out["tokens per expert min"] = float(counts[moe].min())
        out["tokens per expert max"] = float(counts[moe].max())
        out["dropped tokens"] = float(dropped.sum())
    return out


def _any_named(moe_config, name: str) -> bool:
    """Whether the run's flags enable the loss ``name`` (every rank agrees, whatever it holds)."""
    kind = moe_config.moe_router_load_balancing_type
    if name == "z_loss":
        return bool(moe_config.moe_z_loss_coeff)
    if not moe_config.moe_aux_loss_coeff:
        return False
    return {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
            "global_aux_loss": "global_load_balancing_loss"}.get(kind) == name

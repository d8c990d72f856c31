"""The mixture-of-experts layer (Megatron-Core's ``MoELayer``): the dense MLP's contract,
``[s, b, h] -> [s, b, h]``, plus the router losses it records.

Flow: router (logits, the k experts and probabilities of each local token) -> the losses' parts,
attached to the output (:class:`~megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler`)
-> capacity on the micro-batch's whole token set (:mod:`.capacity`) -> dispatch over the
expert-parallel group -> the local experts (:mod:`.experts`) -> combine: the k outputs of a token
weighted by their probabilities and summed in fp32 in slot order -> plus the shared expert.

Groups (passed explicitly; None or a group of one for a single process):

- ``ep_group``: the expert-parallel group; rank r holds experts ``r E/EP .. (r+1) E/EP - 1``.
- ``token_group``: the ranks over which one micro-batch's tokens are split (TP under sequence
  parallelism, times CP); their routing is gathered for the capacity and their counts summed for
  the losses. None when this rank holds its micro-batch's every token.
- ``dp_group``: the data-parallel group (without CP): with ``token_group``, the ranks whose
  tokens make the global batch that ``global_aux_loss`` spans.
- ``expert_tp_group``: expert tensor parallelism (``--expert-tensor-parallel-size``,
  Megatron-Core's ``expt_tp``): each expert's ``linear_fc1`` is split by output rows and
  ``linear_fc2`` by input columns over it. The group's tokens (and their routing) are all-gathered
  before dispatch, every rank of the group runs its slice of the experts on all of them, and the
  combined per-choice outputs, partial sums over the slices, are reduce-scattered back in fp32
  (Megatron-Core gathers over expert-TP after the all-to-all; gathering before it gives the same
  sums and keeps the dispatcher as it is).

Losses, how they are collected: each forward adds the losses' whole values (detached, reduced
over their token set) to ``self.loss_sums`` (names as Megatron-Core logs them:
``load_balancing_loss``, ``seq_load_balancing_loss``, ``global_load_balancing_loss``,
``z_loss``) and counts ``self.num_forwards``; :func:`collect_aux_losses` reads (and resets)
them for the log line, averaged over the micro-batches, summed over layers (and per layer with
``--moe-per-layer-logging``). Their gradients need no
collection: they enter backward through the output (``aux_loss_scale``, see ``moe_utils``).
Training must sum the router's and shared expert's weight gradients over ``token_group`` when it
splits tokens (they carry ``sequence_parallel = True``, as norm weights do), and multiply the
injected gradient by CP (and DP for ``global_aux_loss``) where the gradient is averaged over those
ranks, as it does for the language-model loss.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron.core.distributed.expert_params import mark_expert
from megatron.core.process_groups import group_rank, group_size
from megatron.core.tensor_parallel.mappings import (all_gather_first_dim,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.tensor_parallel.random import checkpoint, is_recomputing
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.capacity import whole_set_keep_mask
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.router import TopKRouter, scores_for_aux_loss
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import (MoEAllGatherTokenDispatcher,
                                                            MoEAlltoAllTokenDispatcher)
from megatron.core.transformer.initialization import init_block

LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


class MoELayer(torch.nn.Module):
    """Router, local experts, dispatcher and optional shared expert of one layer.

    Args:
        config: the MoE section (:class:`~megatron.core.transformer.moe.moe_config.MoEConfig`).
        hidden_size: h. ffn_hidden_size: each expert's width; default
            ``config.moe_ffn_hidden_size`` (``--moe-ffn-hidden-size``).
        seed / layer_number / init_method_std / num_layers: the initialisation; the router from
            ``(seed, layer, "mlp.router")``, expert e from ``(seed, layer, "mlp.experts.…", e)``.
        ep_group / token_group / dp_group: see the module.
        recompute_modules: the selective recompute modules (``--recompute-modules``) this layer
            acts on, Megatron-Core's: ``moe`` (the whole layer re-runs in backward, its input
            alone kept; the replay records nothing: ``is_recomputing``), ``moe_act`` (the routed
            experts' activation, :class:`~.experts.GroupedMLP`), ``shared_experts``. ``moe``
            covers the other two.

    Raises:
        ValueError: E not divisible by the expert-parallel size.
    """

    def __init__(self, config: MoEConfig, *, hidden_size: int, seed: int,
                 ffn_hidden_size: Optional[int] = None,
                 layer_number: int, init_method_std: float = 0.02, num_layers: int = 1,
                 params_dtype=torch.float32, device=None, ep_group=None, token_group=None,
                 dp_group=None, expert_tp_group=None, recompute_modules=frozenset()):
        super().__init__()
        self.recompute_layer = "moe" in recompute_modules
        self.config, self.layer_number = config, layer_number
        self.ep_group, self.token_group, self.dp_group = ep_group, token_group, dp_group
        self.expert_tp_group = expert_tp_group
        ep, experts = group_size(ep_group), config.num_experts
        if experts % ep:
            raise ValueError(f"--num-experts ({experts}) must be divisible by "
                             f"--expert-model-parallel-size ({ep})")
        local = experts // ep
        if ffn_hidden_size is None:
            ffn_hidden_size = config.moe_ffn_hidden_size
        ep_rank = group_rank(ep_group) if ep > 1 else 0
        init = dict(seed=seed, layer_number=layer_number, init_method_std=init_method_std,
                    num_layers=num_layers, params_dtype=params_dtype, device=device)
        self.router = TopKRouter(config, hidden_size, params_dtype=params_dtype, device=device)
        with torch.no_grad():
            self.router.weight.copy_(init_block((experts, hidden_size), init_method_std, seed,
                                                layer_number, "mlp.router"))
        self.experts = GroupedMLP(local, hidden_size, ffn_hidden_size, first_expert=ep_rank * local,
                                  grouped_gemm=config.moe_grouped_gemm,
                                  tp_rank=group_rank(expert_tp_group),
                                  tp_size=group_size(expert_tp_group),
                                  recompute_act="moe_act" in recompute_modules and
                                  not self.recompute_layer, **init)
        for p in self.experts.parameters():  # reduced over expert-DP, the optimizer's expert part
            mark_expert(p)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(
                hidden_size, config.moe_shared_expert_intermediate_size,
                gate=config.moe_shared_expert_gate,
                recompute="shared_experts" in recompute_modules and not self.recompute_layer,
                **init)
        if group_size(token_group) > 1:  # gradients from each shard's tokens: summed over it
            shared = [] if self.shared_experts is None else list(self.shared_experts.parameters())
            for p in [self.router.weight] + shared:
                p.sequence_parallel = True
        if config.moe_token_dispatcher_type == "allgather":
            self.token_dispatcher = MoEAllGatherTokenDispatcher(experts, ep_group)
        else:
            self.token_dispatcher = MoEAlltoAllTokenDispatcher(
                experts, ep_group, pad_to_capacity=config.moe_pad_expert_input_to_capacity)
        self.register_buffer("aux_loss_scale", torch.ones((), dtype=torch.float32),
                             persistent=False)
        self.loss_sums: Dict[str, torch.Tensor] = {}
        self.num_forwards = 0
        self.last_losses: Dict[str, torch.Tensor] = {}
        # Training forwards since the last read (moe_iteration_metrics): this rank's kept
        # choices per expert ``[E]`` int64 and dropped choices; None until the first forward.
        self.routed_counts: Optional[torch.Tensor] = None
        self.dropped_count: Optional[torch.Tensor] = None
        # global_aux_loss: the global batch's choices per expert [E] and its micro-batches, set
        # by the iteration's counting pass (start/finish_global_count); None: not counted.
        self.global_counts: Optional[torch.Tensor] = None
        self.global_micro_batches = 0
        self._counting: Optional[torch.Tensor] = None

    def start_global_count(self) -> None:
        """Before the counting pass (:mod:`megatron.training.moe_global_counts`)."""
        self.global_counts, self.global_micro_batches = None, 0
        self._counting = None

    def finish_global_count(self) -> None:
        """After it: the counts summed over the token group and the data-parallel group."""
        counts = self._counting
        if counts is None:  # no forward reached this layer (cannot happen in a schedule)
            counts = torch.zeros(self.config.num_experts, dtype=torch.int64)
        counts = moe_utils.reduce_counts(counts, self.token_group)
        self.global_counts = moe_utils.reduce_counts(counts, self.dp_group)

    def _loss_parts(self, logits, indices, seq_shape):
        """``{name: (part with graph, whole value detached)}`` of the enabled losses."""
        cfg, parts = self.config, {}
        k, experts = cfg.moe_router_topk, cfg.num_experts
        shards = group_size(self.token_group)
        tokens = logits.shape[0] * shards
        kind = cfg.moe_router_load_balancing_type
        if cfg.moe_aux_loss_coeff and kind != "none":
            scores = scores_for_aux_loss(logits, cfg.moe_router_score_function)
            if kind == "seq_aux_loss":
                s_local, b = seq_shape
                counts = torch.stack([moe_utils.tokens_per_expert(i, experts)
                                      for i in indices.view(s_local, b, k).unbind(1)])
                counts = moe_utils.reduce_counts(counts, self.token_group)
                part = moe_utils.sequence_load_balancing_part(
                    scores.view(s_local, b, experts), counts, s_local * shards, k,
                    cfg.moe_aux_loss_coeff)
                group = [self.token_group]
            else:
                counts = moe_utils.reduce_counts(moe_utils.tokens_per_expert(indices, experts),
                                                 self.token_group)
                group, balanced_tokens = [self.token_group], tokens
                if kind == "global_aux_loss" and self.training and self.global_counts is not None:
                    # the global batch's counts (the iteration's counting pass): N = choices / k
                    counts, balanced_tokens = self.global_counts, int(self.global_counts.sum()) // k
                    group.append(self.dp_group)
                elif kind == "global_aux_loss":  # no counting pass: this step's DP micro-batches
                    counts = moe_utils.reduce_counts(counts, self.dp_group)
                    balanced_tokens = tokens * group_size(self.dp_group)
                    group.append(self.dp_group)
                part = moe_utils.load_balancing_part(scores, counts, balanced_tokens, k,
                                                     cfg.moe_aux_loss_coeff)
            parts[LOSS_NAMES[kind]] = (part, group)
        if cfg.moe_z_loss_coeff:
            parts["z_loss"] = (moe_utils.z_loss_part(logits, tokens, cfg.moe_z_loss_coeff),
                               [self.token_group])
        out = {}
        for name, (part, groups) in parts.items():
            whole = part.detach()
            for g in groups:
                whole = moe_utils.reduce_counts(whole, g)
            out[name] = (part, whole)
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]`` in ``hidden``'s dtype (this rank's tokens: ``[s/T, b, h]``
        or ``[s/CP, b, h]`` when ``token_group`` splits them)."""
        if self.recompute_layer and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, False, hidden, tp_group=None)
        return self._forward(hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        s, b, h = hidden.shape
        x = hidden.reshape(s * b, h)
        logits, probs, indices = self.router(x)
        counting = moe_utils.is_counting_pass()
        if counting:
            counted = moe_utils.tokens_per_expert(indices, cfg.num_experts)
            self._counting = counted if self._counting is None else self._counting + counted
            self.global_micro_batches += 1
        losses = {} if counting else self._loss_parts(logits, indices, (s, b))
        capacity = None
        if cfg.moe_expert_capacity_factor is not None:
            keep, capacity = whole_set_keep_mask(indices, probs, cfg.num_experts,
                                                 cfg.moe_expert_capacity_factor,
                                                 cfg.moe_token_drop_policy, self.token_group)
        else:
            keep = torch.ones_like(indices, dtype=torch.bool)
        on_input = cfg.moe_apply_probs_on_input
        choices, tokens_per_expert = self._experts_per_choice(x, indices, keep, capacity,
                                                              probs if on_input else None)
        choices = choices.view(s * b, cfg.moe_router_topk, h)
        if not on_input:
            choices = choices * probs.float().unsqueeze(-1)
        out = choices.sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        out = out.to(hidden.dtype)
        for name, (part, whole) in losses.items():
            if self.training and part.requires_grad:
                out = moe_utils.MoEAuxLossAutoScaler.apply(out, part, self._scale(name))
        if not (is_recomputing() or counting):  # a replay is not a second micro-batch
            self._record(losses, tokens_per_expert, indices, keep)
        return out.view(s, b, h)

    def _global(self, name) -> bool:
        return name == LOSS_NAMES["global_aux_loss"] and self.training and \
            self.global_counts is not None

    def _scale(self, name):
        """The gradient injected for loss ``name``: ``aux_loss_scale`` (training's ``CP / M``:
        each micro-batch's loss is averaged as the lm loss is); the global batch's loss is one
        loss of the iteration, whose parts the M micro-batches and DP ranks sum: times ``M x DP``,
        so that after DDP's ``1 / (DP x CP)`` its gradient is the sum of the parts'."""
        if not self._global(name):
            return self.aux_loss_scale
        return self.aux_loss_scale * (self.global_micro_batches * group_size(self.dp_group))

    def _experts_per_choice(self, x, indices, keep, capacity, input_probs):
        """Dispatch, the local experts, combine: ``[T k, h]`` fp32 outputs per choice of the local
        tokens (zero for a dropped choice) and the local experts' row counts. Under expert-TP the
        group's tokens go through every rank's expert slices and the partial outputs are summed
        back onto the rank that holds each token."""
        etp = self.expert_tp_group
        if group_size(etp) > 1:
            x = gather_from_sequence_parallel_region(x, etp)
            indices = all_gather_first_dim(indices.contiguous(), etp)
            keep = all_gather_first_dim(keep.to(torch.uint8).contiguous(), etp).bool()
            if input_probs is not None:
                input_probs = gather_from_sequence_parallel_region(input_probs.contiguous(), etp)
            if capacity is not None:  # the padding's bound: at most etp micro-batches' choices
                capacity *= group_size(etp)
        rows, tokens_per_expert = self.token_dispatcher.dispatch(x, indices, keep, capacity,
                                                                 input_probs=input_probs)
        choices = self.token_dispatcher.combine(self.experts(rows, tokens_per_expert))
        return reduce_scatter_to_sequence_parallel_region(choices, etp), tokens_per_expert

    def _record(self, losses, tokens_per_expert, indices, keep):
        """The losses' values and routing counts of one forward, for logging."""
        cfg = self.config
        self.last_losses = {}
        for name, (_, whole) in losses.items():
            if self._global(name):  # logged as the iteration's whole loss: M forwards' parts
                whole = whole * self.global_micro_batches
            self.loss_sums[name] = self.loss_sums.get(name, 0) + whole
            self.last_losses[name] = whole
        self.num_forwards += 1
        self.tokens_per_expert = tokens_per_expert.detach()
        self.dropped_choices = int((~keep).sum())
        if self.training:
            routed = moe_utils.tokens_per_expert(indices[keep], cfg.num_experts)
            dropped = (~keep).sum()
            if self.routed_counts is None:
                self.routed_counts, self.dropped_count = routed, dropped
            else:
                self.routed_counts, self.dropped_count = (self.routed_counts + routed,
                                                          self.dropped_count + dropped)


def moe_token_group(pg_collection, sequence_parallel: bool):
    """The ranks that split one micro-batch's tokens inside a MoE layer (the layer's
    ``token_group``): the tensor-parallel group under sequence parallelism, the context-parallel
    group under CP, the tensor x context group (``tp_cp``) under both, None when this rank holds
    every token of its micro-batch.

    At TP > 1 without sequence parallelism and EP = 1, every TP rank holds the whole token set
    and every expert (expert-TP 1) and computes the layer whole: no token group (the converter's
    TP checkpoints run so; training validation still asks for SP).

    Raises:
        ValueError: TP > 1 without sequence parallelism at EP > 1 (the TP ranks of an EP group
            would send the same tokens to the experts; Megatron-Core requires SP too).
    """
    tp, cp = pg_collection.tp, pg_collection.cp
    if tp.size > 1 and not sequence_parallel:
        if pg_collection.ep.size > 1:
            raise ValueError("a MoE layer at TP > 1 and EP > 1 needs sequence parallelism")
        return cp.group if cp.size > 1 else None
    if tp.size > 1 and cp.size > 1:
        return pg_collection.tp_cp.group
    if tp.size > 1:
        return tp.group
    return cp.group if cp.size > 1 else None


def is_moe_layer(config: MoEConfig, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-based) is MoE (``--moe-layer-freq``'s pattern)."""
    if not config.is_moe:
        return False
    pattern = config.moe_layer_freq
    if isinstance(pattern, int):  # not expanded (a config built in code): every N-th layer
        return (layer_number - 1) % pattern == 0
    return layer_number <= len(pattern) and bool(pattern[layer_number - 1])


def collect_aux_losses(model: torch.nn.Module, reset: bool = True) -> Dict[str, float]:
    """The router losses of every :class:`MoELayer` of ``model`` for the log line, each the mean
    over the forwards (micro-batches) since the last reset: ``{name: sum over layers}`` (as
    Megatron-Core logs ``load_balancing_loss`` and ``z_loss``), plus ``"<name> layer <n>"`` per
    layer with ``--moe-per-layer-logging``."""
    out: Dict[str, float] = {}
    for module in model.modules():
        if not (isinstance(module, MoELayer) and module.num_forwards):
            continue
        for name, total in module.loss_sums.items():
            value = float(total) / module.num_forwards
            out[name] = out.get(name, 0.0) + value
            if module.config.moe_per_layer_logging:
                out[f"{name} layer {module.layer_number}"] = value
        if reset:
            module.loss_sums, module.num_forwards = {}, 0
    return out

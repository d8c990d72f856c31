"""The mixture-of-experts section of the configuration (Megatron-Core's MoE flags).

Each field is named after its flag's ``dest`` and its docstring gives the flag, the unit and the
flag's default. The dataclass defaults are the flags' defaults, so tests and tools build a
:class:`MoEConfig` with only the fields they change. ``num_experts`` None means a dense model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union


@dataclass(frozen=True)
class MoEConfig:
    """What ``megatron.core.transformer.moe.MoELayer`` reads (Megatron-Core's names)."""

    num_experts: Optional[int] = None
    """``--num-experts``: routed experts per MoE layer, E. Default None (dense model)."""
    moe_ffn_hidden_size: Optional[int] = None
    """``--moe-ffn-hidden-size``: each routed expert's SwiGLU inner width; default
    ``--ffn-hidden-size`` (filled by validation)."""
    moe_router_topk: int = 2
    """``--moe-router-topk``: experts per token, k. Default 2."""
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1
    """``--moe-layer-freq``: which layers are MoE; with ``--num-experts`` one 0/1 per layer
    (validation expands an integer N to every N-th layer, or reads a pattern such as
    ``([1]*3+[0]*1)*2``); default 1 (every layer). A dense model keeps the flag's value, unread."""
    moe_router_score_function: str = "softmax"
    """``--moe-router-score-function``: ``softmax`` (Mixtral, Qwen, OLMoE) or ``sigmoid``
    (DeepSeek-V3, Llama 4). Default softmax."""
    moe_router_pre_softmax: bool = False
    """``--moe-router-pre-softmax``: softmax over all E experts before the top-k (no
    renormalisation of the k kept; Qwen's ``norm_topk_prob=False``, OLMoE). Default off: the
    softmax of the k top logits, i.e. the top-k renormalised (Mixtral)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """``--moe-router-topk-scaling-factor``: the k probabilities multiplied by this
    (DeepSeek-V3's ``routed_scaling_factor``, 2.5). Default None (1)."""
    moe_router_num_groups: Optional[int] = None
    """``--moe-router-num-groups``: expert groups of group-limited routing (DeepSeek-V3's
    ``n_group``, 8). Default None (no groups)."""
    moe_router_group_topk: Optional[int] = None
    """``--moe-router-group-topk``: groups each token may use (DeepSeek-V3's ``topk_group``, 4).
    Default None."""
    moe_router_enable_expert_bias: bool = False
    """``--moe-router-enable-expert-bias``: aux-loss-free load balancing (Wang et al. 2024): a
    per-expert bias added to the scores for the choice only. Default off."""
    moe_router_bias_update_rate: float = 1e-3
    """``--moe-router-bias-update-rate``: the bias step per update (sign rule). Default 1e-3."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``--moe-router-load-balancing-type``: ``aux_loss`` (per micro-batch), ``seq_aux_loss``
    (per sequence), ``global_aux_loss`` (over the data-parallel ranks' micro-batches of one
    schedule step) or ``none``. Default aux_loss."""
    moe_aux_loss_coeff: float = 0.0
    """``--moe-aux-loss-coeff``: weight of the load-balancing loss. Default 0 (off)."""
    moe_z_loss_coeff: Optional[float] = None
    """``--moe-z-loss-coeff``: weight of the router z-loss (ST-MoE). Default None (off)."""
    moe_router_dtype: Optional[str] = None
    """``--moe-router-dtype``: ``fp32`` or ``fp64`` for the router's logits and scores. Default
    None (the input's dtype for the linear, fp32 for the scores)."""
    moe_expert_capacity_factor: Optional[float] = None
    """``--moe-expert-capacity-factor``: capacity per expert is ``ceil(N k / E x factor)`` pairs
    of the micro-batch's N tokens; default None (dropless)."""
    moe_token_drop_policy: str = "probs"
    """``--moe-token-drop-policy``: over capacity, drop the lowest ``probs`` or the latest
    ``position`` tokens. Default probs."""
    moe_pad_expert_input_to_capacity: bool = False
    """``--moe-pad-expert-input-to-capacity``: every expert receives exactly its capacity of rows
    from each source (zero rows padding). Default off."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """``--moe-shared-expert-intermediate-size``: the shared expert's SwiGLU width (every token
    goes through it). Default None (no shared expert)."""
    moe_shared_expert_gate: bool = False
    """``--moe-shared-expert-gate``: multiply the shared expert's output by ``sigmoid(x w)``
    (Qwen2-MoE). Default off."""
    moe_apply_probs_on_input: bool = False
    """``--moe-apply-probs-on-input``: multiply the expert's input, not its output, by the
    probability (Llama 4; needs ``--moe-router-topk 1``). Default off."""
    moe_token_dispatcher_type: str = "alltoall"
    """``--moe-token-dispatcher-type``: ``alltoall`` or ``allgather`` over the expert-parallel
    group. Default alltoall."""
    moe_grouped_gemm: bool = False
    """``--moe-grouped-gemm``: run the local experts with ``torch._grouped_mm`` (fp32, bf16 and
    fp16) instead of a loop over experts. Default off."""
    moe_per_layer_logging: bool = False
    """``--moe-per-layer-logging``: log the aux losses of every MoE layer, not only their sum.
    Default off."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

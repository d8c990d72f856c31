"""Mixture-of-experts flags (Megatron-Core's names) and their validation.

``add_moe_args(parser)`` declares them; ``validate_moe(args)`` checks their combinations (one
line naming the flags and the fix per refusal) and fills ``moe_ffn_hidden_size`` (default
``--ffn-hidden-size``) and ``moe_layer_freq`` (expanded to one 0/1 per layer). The pattern of
``--moe-layer-freq`` (``([1]*3+[0]*1)*2``) is read by :func:`parse_layer_freq`, a small parser of
lists, integers, ``+``, ``*`` and parentheses: nothing of the value is evaluated as Python.
"""

from __future__ import annotations

import argparse
import re
from typing import List, Union

from megatron.usage_error import UsageError

DISPATCHERS = ("alltoall", "allgather")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def add_moe_args(parser):
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="routed experts per MoE layer (default: a dense model)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's SwiGLU width; default --ffn-hidden-size")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-layer-freq", type=_layer_freq_arg, default=1,
                   help="every N-th layer is MoE (N), or a pattern of 0/1 per layer such as "
                        "'([1]*3+[0]*1)*2'")
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"],
                   help="softmax (Mixtral, Qwen, OLMoE) or sigmoid (DeepSeek-V3, Llama 4)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (no renormalisation)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="multiply the top-k probabilities (DeepSeek-V3: 2.5)")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="expert groups of group-limited routing (DeepSeek-V3: 8)")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="groups a token may use (DeepSeek-V3: 4)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias on the choice (sigmoid)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="the expert bias step per iteration (sign rule)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=list(LOAD_BALANCING_TYPES),
                   help="per micro-batch, per sequence, over the DP ranks' micro-batches, or none")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="weight of the load-balancing loss")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="weight of the router z-loss (ST-MoE)")
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                   help="dtype of the router's logits and probabilities")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="capacity per expert = ceil(tokens x topk / experts x factor); "
                        "default dropless")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                   help="over capacity, drop the least probable or the latest choices")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="every expert gets exactly its capacity of rows (zero padding)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="width of the shared expert every token goes through")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="sigmoid gate on the shared expert (Qwen2-MoE)")
    g.add_argument("--moe-apply-probs-on-input", action="store_true",
                   help="multiply the expert input by the probability (Llama 4; top-1)")
    g.add_argument("--moe-token-dispatcher-type", default="alltoall",
                   choices=list(DISPATCHERS) + ["flex"],
                   help="all-to-all or all-gather over the expert-parallel group (flex refused)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run the local experts with torch._grouped_mm")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="log each MoE layer's losses, not only their sum")


# --moe-layer-freq: a tiny parser (no eval) -----------------------------------------------------

_MAX_LAYERS = 1_000_000
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


def _tokens(text: str) -> List[str]:
    out = []
    for number, char in _TOKEN.findall(text):
        if number:
            out.append(int(number))
        elif char.strip():
            if char not in "[](),+*":
                raise ValueError(f"unexpected character {char!r}")
            out.append(char)
    return out


class _Parser:
    """``expr := term ('+' term)*``; ``term := atom ('*' atom)*``;
    ``atom := INT | '[' INT (',' INT)* ']' | '(' expr ')'``. Lists concatenate with ``+`` and
    repeat with ``* INT``."""

    def __init__(self, text):
        self.toks, self.pos = _tokens(text), 0

    def peek(self):
        return self.toks[self.pos] if self.pos < len(self.toks) else None

    def take(self, expected=None):
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise ValueError(f"expected {expected or 'more'} at token {self.pos + 1}")
        self.pos += 1
        return tok

    def expr(self):
        value = self.term()
        while self.peek() == "+":
            self.take()
            right = self.term()
            if not (isinstance(value, list) and isinstance(right, list)):
                raise ValueError("'+' joins two lists")
            value = value + right
        return value

    def term(self):
        value = self.atom()
        while self.peek() == "*":
            self.take()
            right = self.atom()
            if isinstance(value, int) and isinstance(right, list):
                value, right = right, value
            if isinstance(value, list) and isinstance(right, list):
                raise ValueError("'*' repeats a list by a number")
            # sizes checked before anything is built: '[1]*10**6*10**6' must not fill memory
            size = (len(value) if isinstance(value, list) else 1) * right
            if size > _MAX_LAYERS or (isinstance(value, int) and value > _MAX_LAYERS):
                raise ValueError(f"the pattern is longer than {_MAX_LAYERS} layers")
            value = value * right
        return value

    def atom(self):
        tok = self.take()
        if isinstance(tok, int):
            return tok
        if tok == "(":
            value = self.expr()
            self.take(")")
            return value
        if tok == "[":
            items = [self.take()]
            while self.peek() == ",":
                self.take()
                items.append(self.take())
            self.take("]")
            if not all(isinstance(i, int) for i in items):
                raise ValueError("a list holds numbers")
            return items
        raise ValueError(f"unexpected {tok!r}")


def parse_layer_freq(text: str) -> Union[int, List[int]]:
    """``"2"`` -> 2; ``"([1]*3+[0]*1)*2"`` -> ``[1, 1, 1, 0, 1, 1, 1, 0]``.

    Raises:
        ValueError: anything else (the message says what).
    """
    parser = _Parser(str(text))
    value = parser.expr()
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r} after the pattern")
    return value


def _layer_freq_arg(text: str):
    try:
        return parse_layer_freq(text)
    except ValueError as exc:  # argparse words it as one line: 'argument --moe-layer-freq: ...'
        raise argparse.ArgumentTypeError(
            f"{text!r}: {exc}; give an integer N (every N-th layer) or a pattern such as "
            "'([1]*3+[0]*1)*2'") from exc


def moe_layer_pattern(freq, num_layers: int) -> tuple:
    """One 0/1 per layer: every ``freq``-th layer from the first (Megatron-Core:
    ``i % freq == 0``), or the pattern itself.

    Raises:
        UsageError: a pattern of another length or with values other than 0/1, or freq < 1.
    """
    if isinstance(freq, int):
        if freq < 1:
            raise UsageError(f"--moe-layer-freq ({freq}) must be positive: 1 makes every layer MoE")
        return tuple(int(i % freq == 0) for i in range(num_layers))
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise UsageError(f"--moe-layer-freq pattern {list(freq)} must hold one 0 or 1 per layer "
                         f"(--num-layers {num_layers})")
    return tuple(freq)


# Validation ------------------------------------------------------------------------------------

def validate_moe_flags(args, defaults: dict) -> None:
    """Check the MoE flags' combinations and, with ``--num-experts``, fill ``moe_ffn_hidden_size``
    and ``moe_layer_freq`` (a tuple of 0/1 per layer). Idempotent.

    Raises:
        UsageError: one line naming the flags and the fix.
    """
    moe = {d: getattr(args, d) for d in defaults if d.startswith("moe_")}
    if args.num_experts is None:
        given = [d for d, v in moe.items() if v != defaults[d]]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} needs --num-experts (a dense model "
                             "has no router): add --num-experts or remove the flag")
        return
    experts, topk = args.num_experts, args.moe_router_topk
    if args.moe_token_dispatcher_type == "flex":
        raise UsageError("--moe-token-dispatcher-type flex is not supported (DeepEP's fused "
                         "dispatcher is CUDA-only and not built here): use alltoall or allgather")
    if topk > experts:
        raise UsageError(f"--moe-router-topk ({topk}) must be at most --num-experts ({experts})")
    sigmoid = args.moe_router_score_function == "sigmoid"
    if sigmoid and args.moe_router_pre_softmax:
        raise UsageError("--moe-router-pre-softmax applies to --moe-router-score-function "
                         "softmax, not sigmoid: remove one")
    if args.moe_router_enable_expert_bias and not sigmoid:
        raise UsageError("--moe-router-enable-expert-bias needs --moe-router-score-function "
                         "sigmoid (aux-loss-free balancing biases sigmoid scores, DeepSeek-V3)")
    _validate_groups(args, experts, topk)
    if args.moe_apply_probs_on_input and topk != 1:
        raise UsageError(f"--moe-apply-probs-on-input needs --moe-router-topk 1 (got {topk}): "
                         "with several experts the input cannot carry every probability")
    kind = args.moe_router_load_balancing_type
    if args.moe_aux_loss_coeff > 0 and kind == "none":
        raise UsageError(f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff} with "
                         "--moe-router-load-balancing-type none: choose a loss type or coefficient 0")
    if args.moe_expert_capacity_factor is None:
        for dest, flag in (("moe_pad_expert_input_to_capacity",
                            "--moe-pad-expert-input-to-capacity"),
                           ("moe_token_drop_policy", "--moe-token-drop-policy")):
            if getattr(args, dest) != defaults[dest]:
                raise UsageError(f"{flag} needs --moe-expert-capacity-factor (without it no token "
                                 "is dropped): add a factor or remove the flag")
    if args.moe_pad_expert_input_to_capacity and args.moe_token_dispatcher_type != "alltoall":
        raise UsageError("--moe-pad-expert-input-to-capacity needs --moe-token-dispatcher-type "
                         "alltoall")
    if args.moe_shared_expert_gate and args.moe_shared_expert_intermediate_size is None:
        raise UsageError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size "
                         "(the shared expert it gates)")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    args.moe_layer_freq = moe_layer_pattern(args.moe_layer_freq, args.num_layers)


def _validate_groups(args, experts, topk):
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise UsageError("--moe-router-num-groups and --moe-router-group-topk go together "
                         "(DeepSeek-V3: 8 and 4): give both or neither")
    if groups is None:
        return
    if experts % groups:
        raise UsageError(f"--num-experts ({experts}) must be divisible by "
                         f"--moe-router-num-groups ({groups})")
    if group_topk > groups:
        raise UsageError(f"--moe-router-group-topk ({group_topk}) must be at most "
                         f"--moe-router-num-groups ({groups})")
    if topk % group_topk or topk // group_topk > experts // groups:
        raise UsageError(f"--moe-router-topk ({topk}) must be a multiple of "
                         f"--moe-router-group-topk ({group_topk}) and at most {group_topk} x the "
                         f"{experts // groups} experts of a group")


def validate_moe(args, defaults: dict) -> None:
    """:func:`validate_moe_flags`, then the layouts training runs with experts: EP (folded over
    DP, CP x DP and TP), TP with sequence parallelism, expert-TP (default TP, Megatron-Core's),
    TP x CP, PP (with virtual stages), the distributed optimizer, full and selective recompute
    (each proven equal to one process in tests/e2e/test_moe_layouts_e2e.py); the rest is refused
    until it is proven."""
    validate_moe_flags(args, defaults)
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    if args.num_experts is None:
        if ep > 1:
            raise UsageError(f"--expert-model-parallel-size {ep} needs --num-experts (a dense "
                             "model has no experts to spread): add --num-experts or remove it")
        return
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    etp = getattr(args, "expert_tensor_parallel_size", None)
    etp = tp if etp is None else etp
    if args.num_experts % ep:
        raise UsageError(f"--num-experts ({args.num_experts}) must be divisible by "
                         f"--expert-model-parallel-size ({ep}): each EP rank holds E / EP experts")
    if args.moe_ffn_hidden_size % etp:
        raise UsageError(f"--moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) must be divisible "
                         f"by --expert-tensor-parallel-size ({etp}, default TP): each expert-TP "
                         "rank holds an equal slice of every expert's width")
    if tp > 1 and not args.sequence_parallel:
        raise UsageError(f"--num-experts with --tensor-model-parallel-size {tp} needs "
                         "--sequence-parallel (as in Megatron-Core: each TP rank routes its own "
                         "share of the tokens); add --sequence-parallel")
    if args.moe_router_bias_update_rate != defaults["moe_router_bias_update_rate"] and \
            not args.moe_router_enable_expert_bias:
        raise UsageError(f"--moe-router-bias-update-rate {args.moe_router_bias_update_rate} "
                         "needs --moe-router-enable-expert-bias (no bias to update): add it or "
                         "remove the rate")
    if not any(args.moe_layer_freq):
        raise UsageError(f"--num-experts {args.num_experts} with --moe-layer-freq "
                         f"{list(args.moe_layer_freq)}: no layer is MoE; mark one layer 1 or "
                         "remove --num-experts")
    modules = set(args.recompute_modules or ())
    if args.recompute_granularity == "selective" and modules and modules <= {"act", "mlp"} \
            and all(args.moe_layer_freq):
        raise UsageError(f"--recompute-modules {' '.join(sorted(modules))} recomputes nothing "
                         "when every layer is MoE (the experts have no selective recompute): add "
                         "core_attn or layernorm, or use --recompute-granularity full")
    refused = [
        (cp > 1 and args.moe_token_drop_policy == "position",
         f"--moe-token-drop-policy position at --context-parallel-size {cp}"),
        (args.calculate_per_token_loss, "--calculate-per-token-loss"),
        (args.rampup_batch_size is not None, "--rampup-batch-size"),
    ]
    # A legacy file at expert-TP > 1 other than TP holds whole experts (gathered at the save,
    # checkpointing/legacy.py); the plain optimizer's state of the slices is not gathered.
    if etp > 1 and etp != tp and args.save is not None and args.ckpt_format == "torch" and \
            not (args.use_distributed_optimizer or getattr(args, "use_megatron_fsdp", False)
                 or args.no_save_optim):
        raise UsageError(f"--num-experts at --expert-tensor-parallel-size {etp} with "
                         f"--tensor-model-parallel-size {tp}, --save and --ckpt-format torch "
                         "saves the experts' optimizer state only with the distributed optimizer: "
                         "add --use-distributed-optimizer, or use --ckpt-format torch_dist")
    for bad, flag in refused:
        if bad:
            raise UsageError(f"--num-experts with {flag} is not supported yet (docs/moe.md "
                             f"lists the proven layouts): remove {flag.split(' /')[0].split(' ')[0]}")

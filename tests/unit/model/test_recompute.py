"""Activation recompute: every setting equals none (loss and every gradient, also with dropout),
and the activation bytes kept for backward per layer and micro-batch are exactly the formula's,
for none / selective / full recompute, with and without sequence parallelism, and with context
parallelism (each rank keeps exactly 1/CP of the bytes, attention included)."""

import pytest
import torch

from megatron.core.tensor_parallel.random import model_parallel_manual_seed
from megatron.model.recompute import check_recompute_config, selective_modules
from tests.helpers.activation_memory import saved_activation_bytes
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups
from tests.helpers.model import batch, small_config

SETTINGS = {
    "selective": dict(recompute_granularity="selective"),
    "selective-core_attn": dict(recompute_granularity="selective", recompute_modules=("core_attn",)),
    "selective-act": dict(recompute_granularity="selective", recompute_modules=("act",)),
    "selective-layernorm": dict(recompute_granularity="selective", recompute_modules=("layernorm",)),
    "selective-mlp-layernorm": dict(recompute_granularity="selective",
                                    recompute_modules=("mlp", "layernorm", "core_attn")),
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),
    "full-block-2": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=2),
}


def _loss_and_grads(config, tokens, labels):
    from megatron.model.llama import LlamaModel

    model = LlamaModel(config, pg_collection=current_groups())
    model_parallel_manual_seed(123, 0)  # dropout draws from here (default and tracker states)
    loss = model(tokens, labels=labels)
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    after = torch.rand(4)  # the generators after backward: recompute must leave them as none
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, after


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_every_recompute_setting_equals_none(dropout):
    config = small_config(num_layers=3, hidden_dropout=dropout, attention_dropout=dropout)
    tokens, labels = batch(config, b=2, s=16)
    ref_loss, ref_grads, ref_after = _loss_and_grads(config, tokens, labels)
    for name, changes in SETTINGS.items():
        loss, grads, after = _loss_and_grads(config.replace(**changes), tokens, labels)
        # Recompute replays the same ops on the same random numbers: the forward is bitwise
        # equal, and so are the gradients, except with recomputed norms: their input gradient
        # is added to the residual's in another order (fp32 rounding, a few ulps of the largest
        # element).
        assert torch.equal(loss, ref_loss), name
        assert torch.equal(after, ref_after), name
        bitwise = not selective_modules(config.replace(**changes)) & {"layernorm"}
        for param, ref in ref_grads.items():
            if bitwise:
                assert torch.equal(grads[param], ref), f"{name}: grad of {param}"
            else:
                err = (grads[param] - ref).abs().max() / ref.abs().max()
                assert err <= 4 * torch.finfo(torch.float32).eps, f"{name}: grad of {param}"


# Activation memory ------------------------------------------------------------------------------

S, B = 16, 2


def _layer_bytes(config, tp, sp, setting, s=S):
    """Bytes per layer and micro-batch (fp32) of ``setting`` on one TP rank holding ``s`` tokens
    of each sequence (``S / CP`` under context parallelism), by formula.

    Per token, in elements: the replicated part (outside the tensor-parallel blocks; divided by
    TP with sequence parallelism) is the layer input x, each norm's 1/rms and output, and the
    residual sum h1: ``4h + 2`` (the norms keep their inputs, x and h1, and recompute the
    normalised value). The attention core keeps q and k after RoPE, v (g heads: SDPA shares
    them among the query heads, nothing is repeated), the SDPA output (the dense layer's input
    is a view of it) and the log-sum-exp: ``(2 n/T + 2 g/T) d + n/T``. The MLP keeps gate_up
    and the product silu(gate) * up (silu(gate) is recomputed in backward): ``3 f/T``.
    Selective recompute keeps only x, qkv, h1 and gate_up; full recompute only x. The split
    attention of context parallelism keeps what SDPA keeps, for the rank's tokens.
    """
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    n, g = config.num_attention_heads // tp, config.num_query_groups // tp
    s_outside = s // tp if sp else s  # sequence length of the replicated tensors
    qkv = (n + 2 * g) * d
    outside, core, mlp = 4 * h + 2, (2 * n + 2 * g) * d + n, 3 * f // tp
    if setting == "none":
        elems = s_outside * outside + s * (core + mlp)
    elif setting == "selective":
        elems = s_outside * 2 * h + s * (qkv + 2 * f // tp)
    elif setting == "selective-core_attn":
        elems = s_outside * outside + s * (qkv + mlp)
    elif setting == "full":
        elems = s_outside * h
    else:
        raise ValueError(setting)
    return 4 * B * elems


MEMORY_SETTINGS = {"none": {}, "selective": SETTINGS["selective"],
                   "selective-core_attn": SETTINGS["selective-core_attn"],
                   "full": SETTINGS["full-uniform-1"]}


def _measure(config, num_layers=2):
    """Bytes kept for backward by ``num_layers`` layers run through the model's layer loop
    (every layer keeps the same, so per layer is this divided by ``num_layers``); under context
    parallelism on this rank's ``S / CP`` tokens."""
    from megatron.core.context_parallel import context_parallel_positions
    from megatron.model.recompute import forward_layers
    from megatron.model.rotary import RotaryEmbedding
    from megatron.model.transformer import TransformerLayer

    groups = current_groups()
    layers = torch.nn.ModuleList(TransformerLayer(config, i + 1, pg_collection=groups)
                                 for i in range(num_layers))
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    sp = config.sequence_parallel and tp > 1
    s = S // cp
    x = torch.randn(s // tp if sp else s, B, config.hidden_size, requires_grad=True)
    cos, sin = RotaryEmbedding(config.kv_channels)(
        context_parallel_positions(S, B, cp, groups.cp.rank))
    out, kept = saved_activation_bytes(
        lambda: forward_layers(layers, x, (cos, sin), None, None, config,
                               tp_group=current_groups().tp.group),
        exclude=[cos, sin, *layers.parameters()])
    out.sum().backward()  # the freed outputs come back and backward runs
    assert all(p.grad is not None for p in layers.parameters())
    return kept


def _memory_rank(tp, sp):
    from megatron.core import parallel_state
    if tp > 1:
        parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_manual_seed(5, current_groups().tp.rank)
    base = small_config(tensor_model_parallel_size=tp, sequence_parallel=sp)
    return {name: _measure(base.replace(**changes)) // 2 for name, changes in MEMORY_SETTINGS.items()}


def test_activation_bytes_tp1():
    measured = _memory_rank(1, False)
    config = small_config()
    for name, got in measured.items():
        assert got == _layer_bytes(config, 1, False, name), name
    # Selective recompute (no GEMM recomputed) keeps at most two thirds with SDPA attention.
    assert measured["selective"] <= 2 * measured["none"] / 3
    assert measured["full"] == 4 * S * B * config.hidden_size


def test_activation_bytes_tp2_with_and_without_sequence_parallel():
    tp, config = 2, small_config()
    without, with_sp = (run_distributed(tp, _memory_rank, tp, sp)[0] for sp in (False, True))
    for name in MEMORY_SETTINGS:
        assert without[name] == _layer_bytes(config, tp, False, name), name
        assert with_sp[name] == _layer_bytes(config, tp, True, name), name
    # Sequence parallelism divides the bytes outside the attention/MLP blocks by TP.
    outside = 4 * S * B * (4 * config.hidden_size + 2)
    assert without["none"] - with_sp["none"] == outside - outside // tp
    assert with_sp["full"] * tp == without["full"]


def _memory_cp_rank(cp):
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
    model_parallel_manual_seed(5, 0)
    base = small_config(context_parallel_size=cp)
    return {name: _measure(base.replace(**changes)) // 2 for name, changes in MEMORY_SETTINGS.items()}


def test_activation_bytes_per_rank_divide_by_context_parallel_size():
    cp, config = 2, small_config()
    unsplit = _memory_rank(1, False)
    for rank, measured in enumerate(run_distributed(cp, _memory_cp_rank, cp)):
        for name, got in measured.items():
            assert got == _layer_bytes(config, 1, False, name, s=S // cp), (rank, name)
            # Exactly 1/CP: the attention-free part (norms, residuals, MLP) as the attention.
            assert got * cp == unsplit[name], (rank, name)


def test_block_recompute_keeps_only_the_first_layers_inputs():
    config = small_config(num_layers=3)
    model_parallel_manual_seed(5, 0)
    none = _measure(config, 3)
    block = _measure(config.replace(**SETTINGS["full-block-2"]), 3)
    x_bytes = 4 * S * B * config.hidden_size
    assert none == 3 * _layer_bytes(config, 1, False, "none")
    assert block == 2 * x_bytes + none // 3


@pytest.mark.parametrize("args,match", [
    (("full", None, 1, None), "--recompute-method"),
    (("full", "uniform", None, None), "--recompute-num-layers"),
    (("full", "block", 5, None, 4), "must be <= the layers of one"),
    (("selective", "uniform", None, None), "full only"),
    (("selective", None, None, ("attn",)), "unknown"),
    ((None, None, None, ("act",)), "selective recompute only"),
])
def test_bad_recompute_flags(args, match):
    with pytest.raises(ValueError, match=match):
        check_recompute_config(*args)

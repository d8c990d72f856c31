"""The local experts as grouped weights (Megatron-Core's ``GroupedMLP`` / ``SequentialMLP``).

Expert i of this rank is global expert ``ep_rank * E_local + i``: a SwiGLU MLP
``down(silu(gate(x)) * up(x))`` with ``weight1[i] = [gate; up]`` ``[2f, h]`` and ``weight2[i]``
``[h, f]`` (the layout of transformers' ``gate_up_proj`` / ``down_proj``). Each expert is drawn
from a generator seeded by ``(seed, layer, "mlp.experts.linear_fc1/2", global index)``, so an expert's
weights do not depend on the expert-parallel size or on which rank builds it.

``--moe-grouped-gemm`` runs both matmuls as one ``torch._grouped_mm`` each (fp32, bf16 and fp16
on CPU in torch 2.13, with h and f rows a multiple of 16 bytes; fp64 and other widths take the
loop). Without it, a loop
over the experts. Both give the same bits on CPU for the shapes tested
(tests/unit/core/transformer/moe/test_experts.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.checkpoint_without_output import CheckpointWithoutOutput
from megatron.core.tensor_parallel.utils import set_tensor_model_parallel_attributes
from megatron.core.transformer.initialization import is_meta_device, normal_block_init, scaled_std
from megatron.core.transformer.swiglu import swiglu

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: ``_grouped_mm``'s backward refuses
    an expanded gradient (strides 0, e.g. the gradient of a ``sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_available(dtype: torch.dtype, *widths: int) -> bool:
    """Whether ``torch._grouped_mm`` takes ``dtype`` and rows of these ``widths``: the kernel
    exists, knows the dtype, and every row stride is a multiple of 16 bytes (it refuses others)."""
    if not hasattr(torch, "_grouped_mm") or dtype not in GROUPED_MM_DTYPES:
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return all(w * size % 16 == 0 for w in widths)


class GroupedMLP(torch.nn.Module):
    """``E_local`` SwiGLU experts held as ``weight1 [E_local, 2f, h]``, ``weight2 [E_local, h, f]``;
    under expert-TP (``tp_size`` > 1) rank r holds ``weight1[:, [gate_r; up_r]]``
    ``[E_local, 2f/etp, h]`` and ``weight2[..., f_r]`` ``[E_local, h, f/etp]``, ``f_r`` the r-th
    of etp equal slices of the width (Megatron-Core's column/row split of ``linear_fc1/2``), and
    its output is that slice's partial sum.

    Args:
        num_local_experts: E_local. hidden_size: h. ffn_hidden_size: f (``--moe-ffn-hidden-size``).
        first_expert: the global index of local expert 0 (``ep_rank * E_local``).
        seed / layer_number / init_method_std / num_layers: the initialisation (the output
            matmul uses Megatron's scaled init ``std / sqrt(2 num_layers)``).
        grouped_gemm: use ``torch._grouped_mm`` where the dtype allows.
        tp_rank / tp_size: this rank's place in the expert-TP group.
        recompute_act: ``--recompute-modules moe_act`` (Megatron-Core's name): the SwiGLU
            activation ``[M, f]`` is not kept for backward but recomputed from ``gate_up``
            (which its own backward keeps anyway); the same bits, ``M f`` elements fewer saved.

    Raises:
        ValueError: f not divisible by ``tp_size``.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 first_expert: int, seed: int, layer_number: int, init_method_std: float,
                 num_layers: int, grouped_gemm: bool = False, params_dtype=torch.float32,
                 device=None, tp_rank: int = 0, tp_size: int = 1, recompute_act: bool = False):
        super().__init__()
        self.recompute_act = recompute_act
        if ffn_hidden_size % tp_size:
            raise ValueError(f"--moe-ffn-hidden-size ({ffn_hidden_size}) must be divisible by "
                             f"--expert-tensor-parallel-size ({tp_size})")
        self.num_local_experts = num_local_experts
        self.first_expert = first_expert
        self.tp_rank, self.tp_size = tp_rank, tp_size
        f = ffn_hidden_size // tp_size  # this expert-TP rank's slice of the width
        self.grouped_gemm = grouped_gemm and grouped_mm_available(params_dtype, hidden_size, f)
        # On the meta device (a checkpoint's weights, or the planner's inventory) nothing is drawn.
        meta = is_meta_device(device)
        draw_on = "meta" if meta else "cpu"
        w1 = torch.empty(num_local_experts, 2 * f, hidden_size, device=draw_on)
        w2 = torch.empty(num_local_experts, hidden_size, f, device=draw_on)
        full1 = torch.empty(2 * ffn_hidden_size, hidden_size, device=draw_on)
        full2 = torch.empty(hidden_size, ffn_hidden_size, device=draw_on)
        cols = slice(tp_rank * f, (tp_rank + 1) * f)
        for i in range(num_local_experts if not meta else 0):
            # the whole expert is drawn, then sliced: the weights do not depend on expert-TP
            expert = first_expert + i
            normal_block_init(init_method_std, seed, layer_number, "mlp.experts.linear_fc1",
                              expert)(full1)
            normal_block_init(scaled_std(init_method_std, num_layers), seed, layer_number,
                              "mlp.experts.linear_fc2", expert)(full2)
            gate, up = full1.chunk(2)
            w1[i] = torch.cat([gate[cols], up[cols]])
            w2[i] = full2[:, cols]
        self.weight1 = torch.nn.Parameter(w1.to(dtype=params_dtype, device=device))
        self.weight2 = torch.nn.Parameter(w2.to(dtype=params_dtype, device=device))
        if tp_size > 1:  # slices, not copies: each expert-TP rank's counts in the grad norm
            set_tensor_model_parallel_attributes(self.weight1, True, 1, stride=2)
            set_tensor_model_parallel_attributes(self.weight2, True, 2)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x [M, h]`` rows sorted by local expert, ``tokens_per_expert [E_local]`` (int, summing
        to M, zeros allowed) -> ``[M, h]``. M = 0 gives an empty output whose backward still
        gives the weights a (zero) gradient."""
        if x.shape[0] == 0:
            return x + (self.weight1.sum() + self.weight2.sum()) * 0
        if self.grouped_gemm and x.dtype == self.weight1.dtype:
            return self._grouped(x, tokens_per_expert)
        return self._loop(x, tokens_per_expert)

    def _grouped(self, x, tokens_per_expert):
        offs = torch.cumsum(tokens_per_expert.to(torch.int64), 0).to(torch.int32)
        gate_up = torch._grouped_mm(x, self.weight1.transpose(1, 2), offs=offs)
        return _ContiguousGrad.apply(self._activated(
            _ContiguousGrad.apply(gate_up),
            lambda act: torch._grouped_mm(act, self.weight2.transpose(1, 2), offs=offs)))

    def _loop(self, x, tokens_per_expert):
        outs = []
        for i, rows in enumerate(torch.split(x, tokens_per_expert.tolist())):
            if rows.shape[0]:
                outs.append(self._activated(F.linear(rows, self.weight1[i]),
                                            lambda act, i=i: F.linear(act, self.weight2[i])))
        return torch.cat(outs)

    def _activated(self, gate_up, consumer):
        """``consumer(swiglu(gate_up))``; with ``recompute_act`` in training the activation's
        storage is freed once ``consumer`` has saved it, and recomputed in backward."""
        if not (self.recompute_act and self.training and torch.is_grad_enabled()):
            return consumer(swiglu(gate_up))
        ckpt = CheckpointWithoutOutput()
        out = consumer(ckpt.checkpoint(swiglu, gate_up))
        ckpt.discard_output_and_register_recompute(out)
        return out

"""OLMoE's q/k RMSNorm over the whole projection width (``--qk-layernorm-full-width``), split
over tensor-parallel ranks by heads.

OLMoE (transformers' ``OlmoeAttention``) normalises ``q [.., nh d]`` and ``k [.., ng d]`` with an
RMSNorm whose mean square spans every head. At tensor-parallel size T a rank holds ``nh/T``
query heads (``ng/T`` groups), so the mean square is the all-reduced sum of every rank's sum of
squares, in fp32, divided by the whole width; the weight ``[nh d]`` is sharded with the heads
(``tensor_model_parallel``, ``partition_dim`` 0).

Autograd: every rank's loss part depends on the global sum of squares through its own heads
only, so the gradient of that sum is the sum of every rank's part: the all-reduce's backward
is an all-reduce (``reduce_from`` of ``copy_to``: forward sum, backward sum).
"""

from __future__ import annotations

import torch

from megatron.core.process_groups import group_size
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.tensor_parallel.utils import set_tensor_model_parallel_attributes
from megatron.model.rms_norm import RMSNorm


class FullWidthRMSNorm(RMSNorm):
    """``y = x / sqrt(mean over the whole width of x**2 + eps) * weight`` for this rank's slice
    ``x [..., w/T]`` of a width-``w`` projection; ``weight [w/T]``, this rank's heads' part.

    At T = 1 it is :class:`~megatron.model.rms_norm.RMSNorm` (bitwise transformers'
    ``OlmoeRMSNorm``); at T > 1 the fp32 sum of squares is all-reduced over ``tp_group`` and the
    normalised value is cast back to the input dtype before the weight (as ``RMSNorm``).

    Args:
        width: the whole projection width w (``nh * d`` or ``ng * d``).
        tp_group: the tensor-parallel group (None or size 1: no split).
        eps, params_dtype, device: as :class:`RMSNorm`.

    Raises:
        ValueError: ``width`` not divisible by the group's size.
    """

    def __init__(self, width: int, tp_group, *, eps: float = 1e-5,
                 params_dtype: torch.dtype = torch.float32, device=None):
        tp = group_size(tp_group)
        if width % tp:
            raise ValueError(f"the q/k norm width {width} is not divisible by the "
                             f"tensor-parallel size {tp}")
        super().__init__(width // tp, eps, params_dtype=params_dtype, device=device)
        self.width, self.tp_group, self.tp = width, tp_group, tp
        if tp > 1:
            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., w/T]`` (any float dtype) -> the same shape and dtype."""
        if self.tp == 1:
            return super().forward(x)
        xf = x.float()
        square_sum = xf.pow(2).sum(-1, keepdim=True)
        square_sum = reduce_from_tensor_model_parallel_region(
            copy_to_tensor_model_parallel_region(square_sum, self.tp_group), self.tp_group)
        rstd = torch.rsqrt(square_sum / self.width + self.eps)
        return (xf * rstd).to(x.dtype) * self.weight

    def extra_repr(self) -> str:
        return f"{self.width} over {self.tp} tensor ranks, eps={self.eps}"

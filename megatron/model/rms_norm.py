"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

Shapes: s = sequence, b = micro-batch, h = hidden.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _apex_fused_rms_norm():
    """apex's fused kernel, only where apex is importable and CUDA is present (never required)."""
    if not torch.cuda.is_available():
        return None
    try:
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine
    except ImportError:
        return None
    return fused_rms_norm_affine


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x**2) + eps) * weight``, normalising over the last dimension.

    The statistics are computed in fp32 and the normalised value is cast back to the input dtype
    before the weight is applied, as HuggingFace's ``LlamaRMSNorm`` does, so bf16 models round
    the same way as the reference implementation.

    Args:
        hidden_size: size h of the normalised (last) dimension.
        eps: added to the mean square (``--norm-epsilon`` / ``--layernorm-epsilon``).
        sequence_parallel: mark the weight ``sequence_parallel=True`` (its gradient is then
            all-reduced over the tensor-parallel group by ``finalize_model_grads``).
        params_dtype: dtype of the weight.
        device: device of the weight.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel
        self._fused = _apex_fused_rms_norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x [..., h]`` (any float dtype); returns the same shape and dtype."""
        if self._fused is not None and x.is_cuda:
            return self._fused(x, self.weight, (self.hidden_size,), self.eps)
        normed = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps).to(x.dtype)
        return normed * self.weight

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

Shapes: s = sequence, b = micro-batch, h = hidden.
"""

from __future__ import annotations

import torch


def _apex_fused_rms_norm():
    """apex's fused kernel, only where apex is importable and CUDA is present (never required)."""
    if not torch.cuda.is_available():
        return None
    try:
        from apex.normalization.fused_layer_norm import fused_rms_norm_affine
    except ImportError:
        return None
    return fused_rms_norm_affine


class _RMSNormFunction(torch.autograd.Function):
    """``y = (x * rstd).to(x.dtype) * weight`` with ``rstd = 1 / sqrt(mean(x**2) + eps)`` in fp32.

    Autograd of the composite (``F.rms_norm`` then the weight) runs about a dozen element-wise
    passes and keeps the normalised value for the weight gradient; this function keeps only the
    input and the fp32 ``rstd [..., 1]`` and recomputes the normalised value in backward, where
    (Zhang & Sennrich 2019, eq. 4, for ``n = x * rstd`` and ``g = dy * weight`` in fp32)::

        dx = rstd * (g - n * mean(g * n))          dweight = sum over tokens of dy * n
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        # The reference's own arithmetic (HuggingFace LlamaRMSNorm), so outputs match it bitwise.
        rstd = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        ctx.save_for_backward(x, rstd, weight)
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return (xf * rstd).mul_(weight)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad_output):
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            n = normed if x.dtype == torch.float32 else normed.to(x.dtype)
            grad_weight = (grad_output * n).reshape(-1, x.size(-1)).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad_output * weight).float()
            dot = (g * normed).mean(-1, keepdim=True)
            grad_x = g.sub_(normed.mul_(dot)).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None


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
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

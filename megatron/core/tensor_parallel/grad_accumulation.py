"""Gradient-accumulation fusion: weight gradients written straight into ``param.main_grad``.

Megatron-LM's ``--gradient-accumulation-fusion`` (on by default; ``--no-gradient-accumulation-
fusion`` turns it off): instead of autograd materialising a weight gradient ``dW = dY^T X`` that
the data-parallel hook then adds into the fp32 ``main_grad`` buffer, the backward of a linear
layer accumulates the product into ``main_grad`` itself (``main_grad.addmm_(dY^T, X)``: the GEMM's
``beta = 1`` does the addition), and the embedding's backward adds its rows into ``main_grad``
with ``index_add_`` instead of building a dense, zero-filled ``[v, h]`` gradient. That saves one
weight-sized allocation (fresh pages on a CPU), one fill and one add pass per weight and micro-batch.

Contract with :class:`megatron.core.distributed.DistributedDataParallel` (Megatron-Core's): the
backward returns an *uninitialised* placeholder of the weight's shape as the weight's gradient,
so that autograd still runs the parameter's post-accumulate-grad hook (bucket readiness for
``--overlap-grad-reduce``), and sets ``weight.grad_added_to_main_grad = True``; the hook then drops
the placeholder instead of adding it. Fusion applies only where it is safe: the weight has a
``main_grad`` (it is wrapped by DDP), no ``.grad`` yet (autograd would add the placeholder into
an existing ``.grad``), and the running backward will accumulate into the weight (its
``AccumulateGrad`` node executes: ``loss.backward()``, not ``torch.autograd.grad`` or
``backward(inputs=...)`` without it, which get the true gradient and leave ``main_grad`` alone).
Every use of a weight in a backward must take the same path, which the model guarantees by
passing one flag to all its layers.

bf16/fp16 weights with fp32 ``main_grad``: the product is computed in the weight's dtype and added
in fp32, as without fusion (torch has no mixed-dtype GEMM on CPU).
"""

from __future__ import annotations

import torch

__all__ = ["accumulator_of", "fuses_into_main_grad", "linear_weight_grad", "embedding_weight_grad"]


def accumulator_of(ctx, index: int):
    """The node that receives input ``index``'s gradient in the running backward of the custom
    function ``ctx`` (``AccumulateGrad`` for a parameter), or None."""
    next_functions = getattr(ctx, "next_functions", None)
    if not next_functions or index >= len(next_functions):
        return None
    return next_functions[index][0]


def _engine_accumulates(node) -> bool:
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (RuntimeError, AttributeError):  # torch.autograd.grad() asked for this very leaf
        return False


def fuses_into_main_grad(weight: torch.Tensor, enabled: bool, accumulator) -> bool:
    """True when ``weight``'s gradient can be accumulated into ``weight.main_grad`` directly.

    Args:
        weight: the parameter.
        enabled: gradient-accumulation fusion switched on.
        accumulator: the weight's ``AccumulateGrad`` node in the running backward
            (:func:`accumulator_of`); None (or a node this backward does not run) means no.
    """
    return (enabled and weight.requires_grad and _has_main_grad(weight)
            and weight.grad is None and _engine_accumulates(accumulator))


def _has_main_grad(weight: torch.Tensor) -> bool:
    """Whether DDP gave ``weight`` a ``main_grad``. Under ZeRO-2/3 its storage is freed until
    ``allocate_main_grad`` (reading it then raises ``ShardedParameterAccessError``, a
    RuntimeError): it exists all the same."""
    try:
        return getattr(weight, "main_grad", None) is not None
    except RuntimeError:
        return True


def _writable_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """``weight.main_grad``, its storage given back first where DDP frees it between uses
    (sharded gradients, ZeRO-2/3: ``weight.allocate_main_grad``)."""
    allocate = getattr(weight, "allocate_main_grad", None)
    if allocate is not None:
        allocate()
    return weight.main_grad


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)  # never read: the DDP hook drops it


def linear_weight_grad(weight: torch.Tensor, grad_output: torch.Tensor, input_: torch.Tensor,
                       enabled: bool, accumulator=None) -> torch.Tensor:
    """The gradient of ``y = x W^T`` with respect to ``W`` ``[out, in]``, or its placeholder.

    Args:
        weight: ``W [out, in]``.
        grad_output: ``dY [N, out]`` (2-D, tokens flattened), the dtype of ``input_``.
        input_: ``X [N, in]`` (2-D).
        enabled: gradient-accumulation fusion switched on.
        accumulator: the weight's ``AccumulateGrad`` node (see :func:`fuses_into_main_grad`).

    Returns:
        ``dY^T X [out, in]``; or, when fused (see :func:`fuses_into_main_grad`), an uninitialised
        placeholder after ``weight.main_grad += dY^T X``.
    """
    if not fuses_into_main_grad(weight, enabled, accumulator):
        return grad_output.t().mm(input_)
    main_grad = _writable_main_grad(weight)
    if main_grad.dtype == grad_output.dtype:
        main_grad.addmm_(grad_output.t(), input_)
    else:
        main_grad.add_(grad_output.t().mm(input_))
    return _placeholder(weight)


def embedding_weight_grad(weight: torch.Tensor, ids: torch.Tensor, grad_output: torch.Tensor,
                          enabled: bool, accumulator=None) -> torch.Tensor:
    """The gradient of ``y = W[ids]`` with respect to ``W`` ``[v, h]``, or its placeholder.

    Args:
        weight: ``W [v, h]``.
        ids: ``[N]`` int64 row indices in ``[0, v)`` (the same index may repeat).
        grad_output: ``dY [N, h]``.
        enabled: gradient-accumulation fusion switched on.
        accumulator: the weight's ``AccumulateGrad`` node (see :func:`fuses_into_main_grad`).

    Returns:
        The dense ``[v, h]`` gradient (rows of ``dY`` summed per index); or, when fused, an
        uninitialised placeholder after ``weight.main_grad.index_add_(0, ids, dY)``.
    """
    if not fuses_into_main_grad(weight, enabled, accumulator):
        return weight.new_zeros(weight.shape).index_add_(0, ids, grad_output.to(weight.dtype))
    main_grad = _writable_main_grad(weight)
    main_grad.index_add_(0, ids, grad_output.to(main_grad.dtype))
    return _placeholder(weight)

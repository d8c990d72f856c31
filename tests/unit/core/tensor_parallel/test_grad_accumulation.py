"""Gradient-accumulation fusion: weight gradients written into ``main_grad`` inside the backward
equal autograd's gradients, and the weight-sized gradients autograd would build are gone."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.distributed import DistributedDataParallel
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation
from megatron.model.llama import LlamaModel
from tests.helpers.groups import current_groups
from tests.helpers.model import batch, small_config


def _weight_with_main_grad(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
    w.main_grad = torch.randn(shape, generator=g)  # fp32, holds an earlier micro-batch's sum
    return w


def _linear_and_embedding(dtype):
    """A linear weight and an embedding table with main_grad, their inputs and the expected
    weight gradients ``dY^T X`` and the per-row sums."""
    g = torch.Generator().manual_seed(1)
    w, table = _weight_with_main_grad((6, 5), dtype), _weight_with_main_grad((10, 5), dtype, 1)
    x = torch.randn(7, 5, generator=g).to(dtype).requires_grad_()
    ids = torch.tensor([3, 0, 3, 9, 3, 1, 3])
    dy = torch.randn(7, 6, generator=g).to(dtype)
    dense = torch.zeros(10, 5)
    for i, row in zip(ids.tolist(), (dy @ w.detach()).float()):
        dense[i] += row
    hidden = x.detach() + table.detach()[ids]
    return w, table, x, ids, dy, (dy.t() @ hidden).float(), dense


def _forward(w, table, x, ids, fusion=True):
    from megatron.core.tensor_parallel.layers import _Embedding
    hidden = x + _Embedding.apply(ids, table, fusion)  # the table's rows get d hidden = dY W
    return linear_with_grad_accumulation(hidden, w, gradient_accumulation_fusion=fusion,
                                         tp_group=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_adds_weight_gradients_into_main_grad(dtype):
    w, table, x, ids, dy, dw, dtable = _linear_and_embedding(dtype)
    before = w.main_grad.clone(), table.main_grad.clone()
    _forward(w, table, x, ids).backward(dy)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.main_grad, before[0] + dw, **tol)
    torch.testing.assert_close(table.main_grad, before[1] + dtable, **tol)
    # No DDP hook here: the placeholders are still in .grad, flagged for the hook to drop.
    assert w.grad_added_to_main_grad and table.grad_added_to_main_grad
    assert w.grad.shape == w.shape and w.grad.dtype == w.dtype


def test_unfused_cases_get_the_true_gradient_and_leave_main_grad_alone():
    w, table, x, ids, dy, dw, dtable = _linear_and_embedding(torch.float32)
    before = w.main_grad.clone(), table.main_grad.clone()

    def untouched():
        assert torch.equal(w.main_grad, before[0]) and torch.equal(table.main_grad, before[1])
        assert not getattr(w, "grad_added_to_main_grad", False)
        assert not getattr(table, "grad_added_to_main_grad", False)

    # torch.autograd.grad: nothing accumulates into the parameters, the product is returned.
    got_w, got_table = torch.autograd.grad(_forward(w, table, x, ids), [w, table], dy)
    torch.testing.assert_close(got_w, dw)
    torch.testing.assert_close(got_table, dtable)
    untouched()
    (got_x,) = torch.autograd.grad(_forward(w, table, x, ids), [x], dy)
    torch.testing.assert_close(got_x, dy @ w.detach())
    untouched()
    # backward(inputs=...) without the weights: their gradients are not accumulated anywhere.
    _forward(w, table, x, ids).backward(dy, inputs=[x])
    assert w.grad is None and table.grad is None
    untouched()
    # Switched off, or a .grad already there (autograd would add the placeholder to it).
    x.grad = None
    _forward(w, table, x, ids, fusion=False).backward(dy)
    torch.testing.assert_close(w.grad, dw)
    torch.testing.assert_close(table.grad, dtable)
    untouched()
    _forward(w, table, x, ids).backward(dy)
    torch.testing.assert_close(w.grad, 2 * dw)
    untouched()
    # A parameter without main_grad (no DDP) is plain autograd.
    plain = torch.nn.Parameter(w.detach().clone())
    linear_with_grad_accumulation(x.detach(), plain, tp_group=None).backward(dy)
    torch.testing.assert_close(plain.grad, dy.t() @ x.detach())


class _CountWeightSizedAdds(TorchDispatchMode):
    """Counts in-place adds of a ``[v, h]`` tensor (the DDP hook adding an unfused embedding or
    output-layer gradient into ``main_grad``) and accumulating matrix products."""

    def __init__(self, vocab_shape):
        super().__init__()
        self.vocab_shape, self.vocab_adds, self.addmm = vocab_shape, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add_.Tensor and tuple(args[0].shape) == self.vocab_shape:
            self.vocab_adds += 1
        if func is torch.ops.aten.addmm_.default:
            self.addmm += 1
        return func(*args, **(kwargs or {}))


def _ddp_main_grads(config, micro_batches):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(LlamaModel(config, pg_collection=current_groups()),
                                  data_parallel_group=None)
    counter = _CountWeightSizedAdds((config.padded_vocab_size, config.hidden_size))
    for _ in range(2):  # the second iteration starts from a reset buffer
        ddp.zero_grad_buffer()
        with counter:
            for i, (tokens, labels) in enumerate(micro_batches):
                with ddp.no_sync() if i < len(micro_batches) - 1 else torch.enable_grad():
                    ddp(tokens, labels=labels).mean().backward()
        ddp.finish_grad_sync()
    for p in ddp.module.parameters():
        assert p.grad is None and not getattr(p, "grad_added_to_main_grad", False)
    return {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}, counter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_main_grads_equal_autograd(tied, dtype):
    config = small_config(untie_embeddings_and_output_weights=not tied, params_dtype=dtype)
    micro_batches = [batch(config, seed=s) for s in (1, 2)]
    torch.manual_seed(0)
    ref = LlamaModel(config, pg_collection=current_groups())
    for tokens, labels in micro_batches:
        ref(tokens, labels=labels).mean().backward()

    fused, on = _ddp_main_grads(config, micro_batches)
    unfused, off = _ddp_main_grads(config.replace(gradient_accumulation_fusion=False), micro_batches)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(fused[name], p.grad.float(), **tol, msg=name)
        torch.testing.assert_close(unfused[name], p.grad.float(), **tol, msg=name)
    # 2 iterations x 2 micro-batches: every linear's product accumulated in place when fused;
    # unfused, the hook adds the embedding's and the output layer's [v, h] gradients (once per
    # micro-batch for the tied weight, whose two uses autograd sums first).
    # bf16: the output layer's bf16 product is added into the fp32 main_grad (no mixed-dtype
    # GEMM on CPU); the embedding's rows go in by index_add_ either way.
    linears_per_backward = 4 * config.num_layers + 1
    if dtype == torch.float32:
        assert on.addmm == 4 * linears_per_backward and on.vocab_adds == 0
    else:
        assert on.addmm == 0 and on.vocab_adds == 4
    assert off.addmm == 0 and off.vocab_adds == 4 * (1 if tied else 2)

"""Gradient-accumulation fusion: weight gradients written into ``main_grad`` inside the backward
equal autograd's gradients, and the weight-sized gradients autograd would build are gone."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.distributed import DistributedDataParallel
from megatron.core.tensor_parallel.grad_accumulation import (embedding_weight_grad,
                                                             linear_weight_grad)
from megatron.model.llama import LlamaModel
from tests.test_model import batch, small_config


def _weight_with_main_grad(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
    w.main_grad = torch.randn(shape, generator=g)  # fp32, holds an earlier micro-batch's sum
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_weight_grad_adds_into_main_grad(dtype):
    g = torch.Generator().manual_seed(1)
    w = _weight_with_main_grad((6, 5), dtype)
    dy, x = torch.randn(7, 6, generator=g).to(dtype), torch.randn(7, 5, generator=g).to(dtype)
    before = w.main_grad.clone()
    out = linear_weight_grad(w, dy, x, enabled=True)
    assert out.shape == w.shape and out.dtype == w.dtype and w.grad_added_to_main_grad
    torch.testing.assert_close(w.main_grad, before + (dy.t() @ x).float())

    # Not fused: switched off, no main_grad, or a .grad that autograd would add the result to.
    plain = torch.nn.Parameter(w.detach().clone())
    torch.testing.assert_close(linear_weight_grad(plain, dy, x, enabled=True), dy.t() @ x)
    w.grad_added_to_main_grad = False
    torch.testing.assert_close(linear_weight_grad(w, dy, x, enabled=False), dy.t() @ x)
    w.grad = torch.zeros_like(w)
    torch.testing.assert_close(linear_weight_grad(w, dy, x, enabled=True), dy.t() @ x)
    assert not w.grad_added_to_main_grad
    torch.testing.assert_close(w.main_grad, before + (dy.t() @ x).float())  # untouched since


def test_embedding_weight_grad_sums_repeated_rows():
    g = torch.Generator().manual_seed(2)
    w = _weight_with_main_grad((10, 4))
    ids = torch.tensor([3, 0, 3, 9, 3])
    dy = torch.randn(5, 4, generator=g)
    dense = torch.zeros(10, 4)
    for i, row in zip(ids.tolist(), dy):
        dense[i] += row
    before = w.main_grad.clone()
    embedding_weight_grad(w, ids, dy, enabled=True)
    assert w.grad_added_to_main_grad
    torch.testing.assert_close(w.main_grad, before + dense)
    torch.testing.assert_close(embedding_weight_grad(torch.nn.Parameter(w.detach()), ids, dy, True),
                               dense)


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
    ddp = DistributedDataParallel(LlamaModel(config), data_parallel_group=None)
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
    ref = LlamaModel(config)
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

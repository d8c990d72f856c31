"""Tensor-parallel layers equal the dense single-process layers: outputs and every gradient.

Each world builds every layer twice from the same seed: once over the tensor-parallel group and
once over a group of one process (the TP=1 layer, i.e. the dense computation, itself checked
against plain ``x @ W^T + b``). Partitioned weights and weight gradients are all-gathered and
compared with the TP=1 ones.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           VocabParallelEmbedding,
                                           param_is_not_tensor_parallel_duplicate)
from tests.helpers.dist import run_distributed

S, B, H, FFN, V = 8, 2, 8, 16, 32
TOL = dict(rtol=1e-5, atol=1e-5)


def _init(w):
    torch.nn.init.normal_(w, std=0.5)


def _pair(cls, seed, *args, single_group, **kwargs):
    """(parallel layer, TP=1 layer) built from the same seed."""
    torch.manual_seed(seed)
    par = cls(*args, init_method=_init, tp_group=ps.get_tensor_model_parallel_group(), **kwargs)
    torch.manual_seed(seed)
    ref = cls(*args, init_method=_init, tp_group=single_group,
              **{k: v for k, v in kwargs.items() if k != "sequence_parallel"})
    if getattr(ref, "bias", None) is not None:  # zero-initialised: give the bias values
        with torch.no_grad():
            torch.manual_seed(seed + 1)
            full = torch.randn(ref.bias.shape)
            ref.bias.copy_(full)
            par.bias.copy_(_chunk(full, 0) if par.bias.tensor_model_parallel else full)
    return par, ref


def _tp():
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _chunk(t, dim):
    world, rank = _tp()
    return t.chunk(world, dim=dim)[rank]


def _gather(t, dim):
    world, _ = _tp()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _close(a, b, what):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _check_column(single, sequence_parallel=False, gather_output=False):
    par, ref = _pair(ColumnParallelLinear, 11, H, FFN, bias=True, gather_output=gather_output,
                     sequence_parallel=sequence_parallel, single_group=single)
    name = f"column(sp={sequence_parallel}, gather={gather_output})"
    _close(_gather(par.weight.detach(), 0), ref.weight.detach(), name + " weight = TP=1 split")
    assert par.weight.tensor_model_parallel and par.weight.partition_dim == 0
    torch.manual_seed(12)
    x, dy = torch.randn(S, B, H), torch.randn(S, B, FFN)
    x_ref = _leaf(x)
    y_ref, bias_out = ref(x_ref)
    assert bias_out is None
    _close(y_ref, x @ ref.weight.detach().t() + ref.bias.detach(), name + " TP=1 = dense")
    y_ref.backward(dy)

    x_par = _leaf(_chunk(x, 0) if sequence_parallel else x)
    y_par, _ = par(x_par)
    expected = y_ref.detach() if gather_output else _chunk(y_ref.detach(), -1)
    _close(y_par, expected, name + " output")
    y_par.backward(dy if gather_output else _chunk(dy, -1))
    x_grad = _chunk(x_ref.grad, 0) if sequence_parallel else x_ref.grad
    _close(x_par.grad, x_grad, name + " input grad")
    _close(_gather(par.weight.grad, 0), ref.weight.grad, name + " weight grad")
    _close(_gather(par.bias.grad, 0), ref.bias.grad, name + " bias grad")


def _check_row(single, sequence_parallel=False, input_is_parallel=True):
    par, ref = _pair(RowParallelLinear, 21, FFN, H, bias=True, input_is_parallel=input_is_parallel,
                     sequence_parallel=sequence_parallel, single_group=single)
    name = f"row(sp={sequence_parallel}, input_is_parallel={input_is_parallel})"
    _close(_gather(par.weight.detach(), 1), ref.weight.detach(), name + " weight = TP=1 split")
    assert par.weight.tensor_model_parallel and par.weight.partition_dim == 1
    assert not par.bias.tensor_model_parallel
    assert getattr(par.bias, "sequence_parallel", False) == sequence_parallel
    torch.manual_seed(22)
    x, dy = torch.randn(S, B, FFN), torch.randn(S, B, H)
    x_ref = _leaf(x)
    y_ref, _ = ref(x_ref)
    _close(y_ref, x @ ref.weight.detach().t() + ref.bias.detach(), name + " TP=1 = dense")
    y_ref.backward(dy)

    x_par = _leaf(_chunk(x, -1) if input_is_parallel else x)
    y_par, _ = par(x_par)
    _close(y_par, _chunk(y_ref.detach(), 0) if sequence_parallel else y_ref.detach(), name + " output")
    y_par.backward(_chunk(dy, 0) if sequence_parallel else dy)
    _close(x_par.grad, _chunk(x_ref.grad, -1) if input_is_parallel else x_ref.grad, name + " input grad")
    _close(_gather(par.weight.grad, 1), ref.weight.grad, name + " weight grad")
    bias_grad = par.bias.grad.clone()
    if sequence_parallel:  # each rank saw s/TP tokens: the sum over ranks is the full gradient
        dist.all_reduce(bias_grad, group=ps.get_tensor_model_parallel_group())
    _close(bias_grad, ref.bias.grad, name + " bias grad")


def _check_skip_bias_add(single):
    for cls, sizes in ((ColumnParallelLinear, (H, FFN)), (RowParallelLinear, (FFN, H))):
        par, _ = _pair(cls, 31, *sizes, bias=True, skip_bias_add=True, single_group=single)
        x = torch.randn(S, B, sizes[0] // _tp()[0] if cls is RowParallelLinear else sizes[0])
        y, bias = par(x)
        assert bias is par.bias
        y_with_bias, _ = _pair(cls, 31, *sizes, bias=True, single_group=single)[0](x)
        _close(y + bias, y_with_bias, f"{cls.__name__} skip_bias_add")


def _check_embedding(single):
    par, ref = _pair(VocabParallelEmbedding, 41, V, H, single_group=single)
    _close(_gather(par.weight.detach(), 0), ref.weight.detach(), "embedding weight = TP=1 split")
    torch.manual_seed(42)
    ids = torch.cat([torch.arange(V), torch.randint(0, V, (B * S * 2 - V,))]).view(2 * B, S)
    dy = torch.randn(2 * B, S, H)
    y_ref = ref(ids)
    _close(y_ref, F.embedding(ids, ref.weight.detach()), "embedding TP=1 = dense")
    y_ref.backward(dy)
    y_par = par(ids)
    _close(y_par, y_ref.detach(), "embedding output")
    y_par.backward(dy)
    _close(_gather(par.weight.grad, 0), ref.weight.grad, "embedding weight grad")
    copied = copy.deepcopy(par)  # a copy shares the process group
    assert copied.tp_group is par.tp_group
    _close(copied(ids), y_par.detach(), "deep-copied embedding output")


def _check_errors():
    with pytest.raises(TypeError, match="tp_group"):
        ColumnParallelLinear(H, FFN, init_method=_init)  # no group given: never looked up
    tp_group = ps.initialize_model_parallel(_world_size(), 1).tp.group
    with pytest.raises(ValueError, match=r"output_size \(7\) is not divisible"):
        ColumnParallelLinear(H, 7, init_method=_init, tp_group=tp_group)
    with pytest.raises(ValueError, match=r"input_size \(7\) is not divisible"):
        RowParallelLinear(7, H, init_method=_init, tp_group=tp_group)
    with pytest.raises(ValueError, match=r"num_embeddings .*\(7\) is not divisible"):
        VocabParallelEmbedding(7, H, init_method=_init, tp_group=tp_group)


def _world_size():
    return dist.get_world_size()


def _layers_world(tp):
    _check_errors()
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    single = singles[rank]
    for gather_output in (False, True):
        _check_column(single, gather_output=gather_output)
    _check_column(single, sequence_parallel=True)
    for input_is_parallel in (True, False):
        _check_row(single, input_is_parallel=input_is_parallel)
    _check_row(single, sequence_parallel=True)
    _check_skip_bias_add(single)
    _check_embedding(single)
    replicated = torch.nn.Parameter(torch.zeros(1))
    return param_is_not_tensor_parallel_duplicate(replicated, ps.get_tensor_model_parallel_group())


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_equal_dense(tp):
    duplicates_counted = run_distributed(tp, _layers_world, tp)
    assert duplicates_counted == [True] + [False] * (tp - 1)


def test_single_process_layers_and_errors():
    torch.manual_seed(0)
    col = ColumnParallelLinear(H, FFN, init_method=_init, bias=False, tp_group=None)
    torch.manual_seed(0)
    master = torch.empty(FFN, H)
    _init(master)
    assert torch.equal(col.weight.detach(), master)
    assert col.bias is None and col(torch.ones(1, 1, H))[0].shape == (1, 1, FFN)
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(H, FFN, init_method=_init, gather_output=True, sequence_parallel=True,
                             tp_group=None)
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(FFN, H, init_method=_init, input_is_parallel=False,
                          sequence_parallel=True, tp_group=None)
    layer = RowParallelLinear(FFN, H, init_method=_init, params_dtype=torch.bfloat16, tp_group=None)
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16


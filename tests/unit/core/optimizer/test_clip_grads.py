"""Global gradient norm and clipping at TP=2 x PP=2 equal the dense single-model values."""

import math

import pytest
import torch

from megatron.core import parallel_state as ps
from tests.helpers.dist import run_distributed


def _dense_grads():
    """Per stage: weight grad [4, 6] (TP-partitioned on dim 0), bias grad [4] (replicated);
    plus the tied embedding grad [6, 3] (TP-partitioned), held by both stages."""
    g = torch.Generator().manual_seed(3)
    stages = [(torch.randn(4, 6, generator=g), torch.randn(4, generator=g)) for _ in range(2)]
    emb = torch.randn(6, 3, generator=g)
    stages[1][0][0, 0] = 0.0  # one zero for count_zeros
    return stages, emb


def _param(value, **attrs):
    p = torch.nn.Parameter(torch.zeros_like(value))
    p.grad = value.clone()
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _local_params():
    stages, emb = _dense_grads()
    tp, stage = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    w, b = stages[stage]
    return [_param(w.chunk(2, 0)[tp], tensor_model_parallel=True, partition_dim=0),
            _param(b),
            _param(emb.chunk(2, 0)[tp], tensor_model_parallel=True, partition_dim=0,
                   shared_embedding=True)]


def _norms_and_clipping(max_norms):
    from megatron.core.optimizer import (OptimizerConfig, clip_grad_norm_fp32, count_zeros_fp32,
                                         get_megatron_optimizer)

    groups = ps.initialize_model_parallel(2, 2)
    results = []
    for max_norm in max_norms:
        params = _local_params()
        inf_norm = clip_grad_norm_fp32(params, max_norm=1e9, norm_type=math.inf,
                                       pg_collection=groups)
        zeros = count_zeros_fp32(params, pg_collection=groups, data_parallel_group=None)
        model = torch.nn.Module()
        for i, p in enumerate(params):
            model.register_parameter(f"p{i}", p)
        opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=max_norm), [model],
                                     pg_collection=groups)
        opt_norm = opt.get_grad_norm()
        l2_norm = clip_grad_norm_fp32(params, max_norm=max_norm, pg_collection=groups)
        results.append((l2_norm, inf_norm, opt_norm, zeros, [p.grad.tolist() for p in params]))
    return results  # plain lists: queued tensors would share memory with an exiting child


def test_global_norm_tp2_pp2_equals_dense():
    """Partitioned params count their shard, replicated ones count once (TP rank 0), the tied
    embedding counts once (first stage); clipping scales every shard as the dense clip does."""
    max_norms = [1.0, 1e3]
    out = run_distributed(4, _norms_and_clipping, max_norms)
    stages, emb = _dense_grads()
    dense = [t for s in stages for t in s] + [emb]
    expected_inf = max(t.abs().max().item() for t in dense)
    expected_zeros = sum((t == 0).sum().item() for t in dense)
    for k, max_norm in enumerate(max_norms):
        params = [torch.nn.Parameter(torch.zeros_like(t)) for t in dense]
        for p, t in zip(params, dense):
            p.grad = t.clone()
        expected = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        assert (expected > max_norm) == (k == 0)  # the first case clips, the second does not
        for rank, per_norm in enumerate(out):
            l2, inf, opt_norm, zeros, grads = per_norm[k]
            tp, stage = rank % 2, rank // 2
            assert l2 == pytest.approx(expected, rel=1e-6)
            assert opt_norm == pytest.approx(expected, rel=1e-6)
            assert inf == pytest.approx(expected_inf, rel=1e-6)
            assert zeros == expected_zeros
            w, b, e = params[2 * stage].grad, params[2 * stage + 1].grad, params[4].grad
            torch.testing.assert_close(torch.tensor(grads[0]), w.chunk(2, 0)[tp], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(torch.tensor(grads[1]), b, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(torch.tensor(grads[2]), e.chunk(2, 0)[tp], rtol=1e-6, atol=1e-7)


def test_squared_norm_is_layout_exact_at_millions_of_elements():
    """The squared norm of a 4M-element gradient, whole or split as tensor parallelism splits it
    (two row halves, two column halves, odd pieces), equals the fp64 sum within 1e-8 relative
    (each fp32 row sum rounds by ~6e-8, at random). torch's ``_foreach_norm`` on the CPU (one fp32
    accumulator per tensor) is off by more than 1e-6, and by a different amount for the halves:
    that made the clip factor depend on the layout."""
    from megatron.core.optimizer.clip_grads import grad_norm_power_fp32

    g = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = g.double().square().sum().item()

    def power(grads):
        return grad_norm_power_fp32(grads, model_parallel_group=None,
                                    data_parallel_group=None).item()

    layouts = {"whole": [g], "rows": list(g.chunk(2, 0)),
               "columns": [c.contiguous() for c in g.chunk(2, 1)],
               "odd pieces": [g.reshape(-1)[:1000003], g.reshape(-1)[1000003:]]}
    for name, grads in layouts.items():
        assert power(grads) == pytest.approx(exact, rel=1e-8), name

    def foreach(grads):
        return sum(n.double().item() ** 2 for n in torch._foreach_norm(grads))

    whole, halves = foreach([g]), foreach(layouts["rows"])
    assert abs(whole - exact) / exact > 1e-6 and abs(halves - whole) / exact > 1e-6

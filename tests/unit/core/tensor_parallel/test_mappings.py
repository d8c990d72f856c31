"""Forward and backward semantics of the f/g mappings, checked against values every rank can
compute locally: rank r's input is ``_x(r)``, its upstream gradient ``_dy(r)``."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import mappings as m
from tests.helpers.dist import run_distributed


def _x(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def _dy(rank, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(200 + rank))


def _run(fn, x, dy_shape, rank):
    """Forward ``fn`` on a leaf copy of x, backward with this rank's upstream gradient."""
    leaf = x.clone().requires_grad_(True)
    y = fn(leaf)
    y.backward(_dy(rank, dy_shape))
    return y.detach(), leaf.grad


def _mappings_world(tp):
    tp_group = ps.initialize_model_parallel(tp, 1).tp
    r, group = tp_group.rank, tp_group.group
    eq = torch.testing.assert_close
    shape = (2 * tp, 3, 2 * tp)  # [s, b, h], both ends divisible by TP
    xs = [_x(i, shape) for i in range(tp)]
    x = xs[r]

    def dys(s):
        return [_dy(i, s) for i in range(tp)]

    part_last = shape[:2] + (2,)
    part_first = (2,) + shape[1:]

    # f: identity forward, all-reduce backward
    y, g = _run(lambda t: m.copy_to_tensor_model_parallel_region(t, group), x, shape, r)
    eq(y, x)
    eq(g, sum(dys(shape)))
    # g: all-reduce forward, identity backward; the input is not modified
    before = x.clone()
    y, g = _run(lambda t: m.reduce_from_tensor_model_parallel_region(t, group), x, shape, r)
    eq(y, sum(xs))
    eq(g, _dy(r, shape))
    assert torch.equal(x, before)
    # scatter / gather along the last dim
    y, g = _run(lambda t: m.scatter_to_tensor_model_parallel_region(t, group), x, part_last, r)
    eq(y, x.chunk(tp, -1)[r])
    eq(g, _scattered_grad(r, part_last, tp, -1))
    y, g = _run(lambda t: m.gather_from_tensor_model_parallel_region(t, group), x,
                shape[:2] + (shape[2] * tp,), r)
    eq(y, torch.cat(xs, -1))
    eq(g, _dy(r, shape[:2] + (shape[2] * tp,)).chunk(tp, -1)[r])
    # sequence parallel: scatter / gather / reduce-scatter along the first dim
    y, g = _run(lambda t: m.scatter_to_sequence_parallel_region(t, group), x, part_first, r)
    eq(y, x.chunk(tp, 0)[r])
    eq(g, _scattered_grad(r, part_first, tp, 0))
    full_first = (shape[0] * tp,) + shape[1:]
    y, g = _run(lambda t: m.gather_from_sequence_parallel_region(t, group), x, full_first, r)
    eq(y, torch.cat(xs, 0))
    eq(g, sum(dys(full_first)).chunk(tp, 0)[r])  # reduce-scatter of the partial gradients
    y, g = _run(lambda t: m.gather_from_sequence_parallel_region(
        t, group, tensor_parallel_output_grad=False), x, full_first, r)
    eq(g, _dy(r, full_first).chunk(tp, 0)[r])  # split only
    y, g = _run(lambda t: m.reduce_scatter_to_sequence_parallel_region(t, group), x, part_first, r)
    eq(y, sum(xs).chunk(tp, 0)[r])
    eq(g, _scattered_grad(r, part_first, tp, 0))
    # indivisible sizes are refused with the dimension named
    with pytest.raises(ValueError, match="sequence length"):
        m.scatter_to_sequence_parallel_region(torch.zeros(2 * tp + 1, 1, 1), group)
    with pytest.raises(ValueError, match="last dimension"):
        m.scatter_to_tensor_model_parallel_region(torch.zeros(1, 1, 2 * tp + 1), group)
    return True


def _scattered_grad(rank, part_shape, tp, dim):
    """The input gradient of a scatter: every rank's upstream gradient in its chunk (all-gather)."""
    return torch.cat([_dy(i, part_shape) for i in range(tp)], dim)


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_forward_backward(tp):
    assert run_distributed(tp, _mappings_world, tp) == [True] * tp


def test_world_of_one_is_identity():
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in (m.copy_to_tensor_model_parallel_region, m.reduce_from_tensor_model_parallel_region,
               m.scatter_to_tensor_model_parallel_region, m.gather_from_tensor_model_parallel_region,
               m.scatter_to_sequence_parallel_region, m.gather_from_sequence_parallel_region,
               m.reduce_scatter_to_sequence_parallel_region):
        y = fn(x, None)  # None: a world of one
        assert torch.equal(y, x)
        (grad,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert torch.equal(grad, torch.ones_like(x))

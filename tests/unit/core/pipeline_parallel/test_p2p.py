"""Point-to-point exchange between pipeline stages on gloo worlds (TP x PP layouts)."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.schedules import PipelineConfig
from tests.helpers.dist import run_distributed

SHAPE = [3, 2, 4]  # [s, b, h]


def _filled(rank, kind):
    # Encodes sender and flow, so a mismatched pairing shows up as a wrong value.
    return torch.full(SHAPE, 100.0 * kind + rank)


def _exchange(tp, pp):
    import torch.distributed as dist
    groups = ps.initialize_model_parallel(tp, pp)
    pp_group = groups.pp
    config = PipelineConfig(hidden_size=SHAPE[-1])
    rank = dist.get_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    out = {}

    # 1. Every stage at once: activation forward and gradient backward in one batched step
    #    (with PP=2 the next and previous rank coincide: tags and order must keep them apart).
    from_prev, from_next = p2p.communicate(
        tensor_send_next=None if last else _filled(rank, 1),
        tensor_send_prev=None if first else _filled(rank, 2),
        recv_prev=not first, recv_next=not last, tensor_shape=SHAPE, config=config,
        pp_group=pp_group)
    out["full_prev"] = None if first else from_prev.unique().tolist()
    out["full_next"] = None if last else from_next.unique().tolist()
    out["requires_grad"] = (from_prev if from_prev is not None else from_next).requires_grad

    # 2. The 1F1B steady-state pairs: even stages send forward and receive backward, while their
    #    next (odd) stage sends backward and receives forward.
    pp_rank = ps.get_pipeline_model_parallel_rank()
    if pp_rank % 2 == 0:
        got = p2p.send_forward_recv_backward(_filled(rank, 3), SHAPE, config, pp_group)
        out["pair"] = None if got is None else got.unique().tolist()
    else:
        got = p2p.send_backward_recv_forward(_filled(rank, 4), SHAPE, config, pp_group)
        out["pair"] = got.unique().tolist()

    # 3. Plain sends/receives along the whole pipeline, forward then backward.
    x = p2p.recv_forward(SHAPE, config, pp_group)
    p2p.send_forward(_filled(rank, 5) if x is None else x + 1, SHAPE, config, pp_group)
    g = p2p.recv_backward(SHAPE, config, pp_group)
    p2p.send_backward(_filled(rank, 6) if g is None else g + 1, SHAPE, config, pp_group)
    out["chain_fwd"] = None if x is None else x.unique().tolist()
    out["chain_bwd"] = None if g is None else g.unique().tolist()
    out["first_stage_recv_is_none"] = (p2p.recv_forward(SHAPE, config, pp_group) is None
                                       if first else None)
    out["prev"], out["next"], out["pp_rank"] = prev, nxt, pp_rank

    # 4. A tensor of the wrong shape is refused before anything is posted.
    with pytest.raises(ValueError, match="--seq-length"):
        p2p.communicate(tensor_send_next=torch.zeros(1, 2, 4), tensor_send_prev=None,
                        recv_prev=False, recv_next=False, tensor_shape=SHAPE, config=config,
                        pp_group=pp_group)
    with pytest.raises(ValueError, match="dtype"):
        p2p.communicate(tensor_send_next=torch.zeros(SHAPE, dtype=torch.float64),
                        tensor_send_prev=None, recv_prev=False, recv_next=False,
                        tensor_shape=SHAPE, config=config, pp_group=pp_group)
    return out


@pytest.mark.parametrize("tp,pp", [(1, 4), (2, 2)])
def test_p2p_exchanges(tp, pp):
    world = tp * pp
    outs = run_distributed(world, _exchange, tp, pp)
    stage_of = {}
    for rank, o in enumerate(outs):
        stage_of[rank] = o["pp_rank"]
    for rank, o in enumerate(outs):
        r, prev, nxt = o["pp_rank"], o["prev"], o["next"]
        assert stage_of[prev] == (r - 1) % pp and stage_of[nxt] == (r + 1) % pp
        assert o["full_prev"] == (None if r == 0 else [100.0 + prev])
        assert o["full_next"] == (None if r == pp - 1 else [200.0 + nxt])
        assert o["requires_grad"]
        if r % 2 == 0:
            assert o["pair"] == (None if r == pp - 1 else [400.0 + nxt])
        else:
            assert o["pair"] == [300.0 + prev]
        # forward chain: stage 0 sends 500 + rank0, each stage adds 1
        first_rank = rank - r * (world // pp)
        assert o["chain_fwd"] == (None if r == 0 else [500.0 + first_rank + r - 1])
        last_rank = rank + (pp - 1 - r) * (world // pp)
        assert o["chain_bwd"] == (None if r == pp - 1 else [600.0 + last_rank + (pp - 2 - r)])
        assert o["first_stage_recv_is_none"] in ((True,) if r == 0 else (None,))

"""Interleaved 1F1B (virtual pipeline stages) on gloo worlds equals no pipelining in one process:
every loss and every gradient, with forward-only and per-token variants."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import interleaved, schedules
from megatron.core.pipeline_parallel.schedules import PipelineConfig
from tests.helpers.dist import run_distributed
from tests.helpers.pipeline import (B, H, S, ToyStage, check_losses, make_batches,
                                    make_forward_step, make_grad_hooks, reference)

V = 2  # model chunks per rank


def _interleaved(pp, cases):
    groups = ps.initialize_model_parallel(1, pp, virtual_pipeline_model_parallel_size=V)
    rank = groups.pp.rank
    fn = schedules.get_forward_backward_func(groups)
    assert fn is schedules.forward_backward_pipelining_with_interleaving
    for m, forward_only, per_token in cases:
        # chunk c of rank r is virtual stage c * PP + r: one toy layer each
        chunks = [ToyStage([c * pp + rank]) for c in range(V)]
        no_sync, finalize, _, finalized = make_grad_hooks()
        config = PipelineConfig(hidden_size=H, calculate_per_token_loss=per_token,
                                no_sync_func=no_sync, finalize_model_grads_func=finalize)
        losses = fn(forward_step_func=make_forward_step(),
                    data_iterator=[iter(make_batches(m)) for _ in range(V)], model=chunks,
                    num_microbatches=m, seq_length=S, micro_batch_size=B,
                    forward_only=forward_only, config=config, pg_collection=groups)
        ref_losses, ref = reference(m, per_token, layers=pp * V)
        case = (m, forward_only, per_token)
        check_losses(losses, ref_losses, case)
        if forward_only:
            assert finalized == [] and all(p.grad is None for c in chunks for p in c.parameters())
            continue
        assert len(finalized) == 1, case
        for c, chunk in enumerate(chunks):
            layer = ref.layers[c * pp + rank]
            for got, want in zip(chunk.parameters(), layer.parameters()):
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=str(case))
    with pytest.raises(ValueError, match="divisible by --pipeline-model-parallel-size"):
        fn(forward_step_func=make_forward_step(), data_iterator=[iter([])] * V,
           model=[ToyStage([0]) for _ in range(V)], num_microbatches=pp + 1, seq_length=S,
           micro_batch_size=B, config=PipelineConfig(H), pg_collection=groups)
    return True


@pytest.mark.parametrize("pp,cases", [
    (2, [(2, False, False), (4, False, False), (6, False, True), (4, True, False)]),
    (4, [(4, False, False), (8, False, False), (8, False, True), (4, True, False)]),
])
def test_interleaved_equals_no_pipelining(pp, cases):
    # m == PP (every step is warmup) and m > PP (steady 1F1B between chunks); per-token loss.
    assert all(run_distributed(pp, _interleaved, pp, cases))


def test_schedule_tables():
    # PP = 2, v = 2, m = 4: micro-batches in groups of PP per chunk
    assert [interleaved.get_model_chunk_id(k, 2, 2, True) for k in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [interleaved.get_model_chunk_id(k, 2, 2, False) for k in range(8)] == [1, 1, 0, 0, 1, 1, 0, 0]
    assert [interleaved.get_microbatch_id(k, 2, 2) for k in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    # warmup 2 (PP - r - 1) + (v - 1) PP, capped; all-warmup when m == PP or forward-only
    assert interleaved.get_interleaved_warmup(8, 4, 0, 2) == (10, False)
    assert interleaved.get_interleaved_warmup(8, 4, 3, 2) == (4, False)
    assert interleaved.get_interleaved_warmup(4, 4, 3, 2) == (8, True)
    assert interleaved.get_interleaved_warmup(8, 4, 3, 2, forward_only=True) == (16, True)


def test_bad_chunking_is_refused():
    with pytest.raises(ValueError, match="list of model chunks"):
        interleaved._check(ToyStage([0]), None, 4, 2, 2)
    with pytest.raises(ValueError, match="one data iterator per model chunk"):
        interleaved._check([ToyStage([0]), ToyStage([1])], iter([]), 4, 2, 2)

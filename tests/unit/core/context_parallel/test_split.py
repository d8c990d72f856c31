"""The load-balanced split (pure) and the context-parallel loss rule (a CP = 2 world)."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.context_parallel import (check_context_parallel_seq_length,
                                            context_parallel_indices, context_parallel_positions,
                                            get_batch_on_this_cp_rank,
                                            reduce_loss_for_context_parallel,
                                            split_for_context_parallel)
from megatron.model.attention_mask import AttentionMask
from tests.helpers.dist import run_distributed


def test_indices_are_chunk_i_and_its_mirror():
    # The worked example of the module docstring: s = 16, CP = 2.
    assert context_parallel_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_parallel_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4):
        held = torch.cat([context_parallel_indices(32, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))  # every token once
    # Balanced causal work: sum over held positions of (t + 1) keys is the same on every rank.
    work = [int((context_parallel_indices(64, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1


def test_positions_and_batch_split():
    pos = context_parallel_positions(8, 3, 2, 1)
    assert pos.shape == (3, 4) and pos[2].tolist() == [2, 3, 4, 5]
    tokens = torch.arange(2 * 8).view(2, 8)
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, 8),
             "attention_mask": None, "position_ids": tokens % 8}
    mine = get_batch_on_this_cp_rank(batch, 2, 0)
    assert mine["tokens"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert mine["position_ids"].tolist() == [[0, 1, 6, 7], [0, 1, 6, 7]]
    assert mine["attention_mask"] is None and mine["loss_mask"].shape == (2, 4)
    assert get_batch_on_this_cp_rank(batch, 1, 0)["tokens"] is tokens
    with pytest.raises(ValueError, match="dense attention mask tensor cannot be split"):
        get_batch_on_this_cp_rank(dict(batch, attention_mask=torch.zeros(2, 1, 8, 8).bool()), 2, 0)
    # A document mask keeps the ids of the whole sequence and learns its split.
    documents = AttentionMask.from_eod(tokens % 3, 0)
    mask = get_batch_on_this_cp_rank(dict(batch, attention_mask=documents), 2, 1)["attention_mask"]
    assert mask.document_ids is documents.document_ids and (mask.cp_size, mask.cp_rank) == (2, 1)
    with pytest.raises(ValueError, match="dense attention mask cannot be split"):
        get_batch_on_this_cp_rank(dict(batch, attention_mask=AttentionMask.from_dense(
            torch.zeros(2, 1, 8, 8).bool())), 2, 0)


def test_seq_length_check_names_flags_and_fix():
    check_context_parallel_seq_length(24, 1)
    check_context_parallel_seq_length(24, 2)
    with pytest.raises(ValueError, match=r"--seq-length \(20\) must be divisible by 2 x "
                                         r"--context-parallel-size \(4\) = 8 .* use e.g. 16 or 24"):
        check_context_parallel_seq_length(20, 4)
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size \(2\) under "
                                         r"--sequence-parallel.* = 8"):
        check_context_parallel_seq_length(12, 2, 2, sequence_parallel=True)
    with pytest.raises(ValueError, match="rank 2 outside 0..1"):
        context_parallel_indices(8, 2, 2)


def _grads(w, x, target, mask, per_token, group=None):
    """Gradient of the masked mean (or per-token sum / count) loss of a linear model; over
    ``group`` as the schedule and the DP x CP gradient reduction would combine it."""
    w = w.clone().requires_grad_()
    losses = ((x @ w) - target).pow(2).sum(-1)  # [b, s] per-token loss
    loss_sum, count = (losses * mask).sum(), mask.sum()
    loss, count = reduce_loss_for_context_parallel(loss_sum, count, group)
    (loss if per_token else loss / count).backward()
    grad = w.grad
    if group is not None:
        dist.all_reduce(grad, group=group)
        if per_token:  # finalize_model_grads: divide by the token counts summed over DP x CP
            dist.all_reduce(count, group=group)
            grad = grad / count
        else:  # DDP: average over DP x CP
            grad = grad / dist.get_world_size(group)
    elif per_token:
        grad = grad / count
    return loss_sum.detach(), grad


def _loss_world():
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=gen), torch.randn(2, 8, 3, generator=gen)
    target = torch.randn(2, 8, 2, generator=gen)
    mask = (torch.rand(2, 8, generator=gen) > 0.4).float()  # uneven counts per rank
    split = [split_for_context_parallel(t, cp, rank) for t in (x, target, mask)]
    counts = [float(split_for_context_parallel(mask, cp, r).sum()) for r in range(cp)]
    assert counts[0] != counts[1]
    for per_token in (False, True):
        _, expected = _grads(w, x, target, mask, per_token)
        _, got = _grads(w, *split, per_token, group=group)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    return True


def test_loss_rule_gives_unsplit_gradients_with_uneven_masks():
    assert run_distributed(2, _loss_world) == [True, True]

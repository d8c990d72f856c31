"""pretrain_llama's batch masks equal Megatron-LM's loop implementation of
get_ltor_masks_and_position_ids (reproduced plainly here as the oracle)."""

import itertools

import pytest
import torch

from pretrain_llama import get_ltor_masks_and_position_ids


def _megatron_reference(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    b, s = data.shape
    att_b = b if reset_attention_mask else 1
    mask = torch.tril(torch.ones((att_b, s, s))).view(att_b, 1, s, s)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand_as(data).clone()
    for i in range(b):
        eod_index = [j for j in range(s) if data[i, j] == eod]
        prev = 0
        for j in eod_index:
            if reset_attention_mask:
                mask[i, 0, (j + 1):, :(j + 1)] = 0
            if reset_position_ids:
                position_ids[i, (j + 1):] -= (j + 1 - prev)
                prev = j + 1
    return (mask < 0.5), loss_mask, position_ids


@pytest.mark.parametrize("reset_pos, reset_att, eod_mask", list(itertools.product([False, True], repeat=3)))
def test_masks_equal_megatron(reset_pos, reset_att, eod_mask):
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 5, (3, 24), generator=gen)  # eod = 0 occurs often, also at both ends
    data[0, 0] = data[0, -1] = 0
    att, loss_mask, pos = get_ltor_masks_and_position_ids(data, 0, reset_pos, reset_att, eod_mask)
    ref_att, ref_loss, ref_pos = _megatron_reference(data, 0, reset_pos, reset_att, eod_mask)
    assert torch.equal(loss_mask, ref_loss)
    assert torch.equal(pos, ref_pos)
    if reset_att:
        # The mask object: Megatron-LM's dense tensor, and documents ending at every EOD.
        assert att.kind == "document" and torch.equal(att.to_dense(), ref_att)
        b, s = data.shape
        ends = sorted({i * s + j + 1 for i in range(b) for j in range(s) if data[i, j] == 0}
                      | {i * s for i in range(b + 1)})
        assert att.cu_seqlens().tolist() == ends
    else:
        assert att is None  # plain causal attention (the model's default)
        assert torch.equal(ref_att[0, 0], torch.triu(torch.ones(24, 24, dtype=torch.bool), 1))

"""The reward model's pieces against closed forms: the pairwise loss ``-log sigmoid(r_c - r_r)``
(InstructGPT eq. 1) and its gradient in plain Python math, the last-token read-out by index."""

import math

import pytest
import torch

from megatron.model.reward_head import last_token_scores, pairwise_reward_loss


def test_pairwise_loss_closed_form_and_gradient():
    chosen = torch.tensor([1.5, -0.2, 0.0, 3.0], requires_grad=True)
    rejected = torch.tensor([0.5, 0.7, 0.0, -1.0], requires_grad=True)
    losses, m = pairwise_reward_loss(chosen, rejected)
    losses.sum().backward()
    for i in range(4):
        d = float(chosen[i]) - float(rejected[i])
        sig = 1 / (1 + math.exp(-d))
        assert float(losses[i]) == pytest.approx(math.log1p(math.exp(-d)), rel=1e-6)
        assert float(chosen.grad[i]) == pytest.approx(-(1 - sig), rel=1e-6)
        assert float(rejected.grad[i]) == pytest.approx(1 - sig, rel=1e-6)
        assert float(m["rewards/margins"][i]) == pytest.approx(d, rel=1e-6)
        assert float(m["rewards/accuracies"][i]) == (1.0 if d > 0 else 0.0)
    assert float(losses[2]) == pytest.approx(math.log(2), rel=1e-7)  # a tie: log 2
    assert m["rewards/chosen"].tolist() == pytest.approx([1.5, -0.2, 0.0, 3.0])


def test_last_token_scores_read_the_last_real_position():
    scores = torch.arange(12, dtype=torch.float32).view(3, 4)
    got = last_token_scores(scores, torch.tensor([4, 1, 2]))
    assert got.tolist() == [3.0, 4.0, 9.0]

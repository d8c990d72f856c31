"""The DPO loss against its closed form (eq. 7 of Rafailov et al. 2023) in plain Python math, and
sequence log-probabilities against log-softmax of the logits."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.training.dpo_loss import dpo_loss, sequence_logps


def test_sequence_logps_are_log_softmax_sums():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    losses = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none").view(3, 5)
    logp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    want = [sum(float(logp[r, t]) for t in range(5) if mask[r, t]) for r in range(3)]
    assert sequence_logps(losses, mask).tolist() == pytest.approx(want, rel=1e-6)
    assert sequence_logps(losses, mask, average=True).tolist() == pytest.approx(
        [want[0] / 3, want[1] / 2, 0.0], rel=1e-6)


def test_dpo_loss_closed_form():
    pc, pr = torch.tensor([-3.0, -7.5, -2.0]), torch.tensor([-4.0, -6.0, -2.0])
    rc, rr = torch.tensor([-3.5, -7.0, -1.0]), torch.tensor([-3.8, -6.5, -3.0])
    beta = 0.1
    losses, m = dpo_loss(pc, pr, rc, rr, beta)
    for i in range(3):
        c = beta * (float(pc[i]) - float(rc[i]))
        r = beta * (float(pr[i]) - float(rr[i]))
        assert float(losses[i]) == pytest.approx(math.log1p(math.exp(-(c - r))), rel=1e-6)
        assert float(m["rewards/chosen"][i]) == pytest.approx(c, rel=1e-6, abs=1e-7)
        assert float(m["rewards/rejected"][i]) == pytest.approx(r, rel=1e-6, abs=1e-7)
        assert float(m["rewards/margins"][i]) == pytest.approx(c - r, rel=1e-6, abs=1e-7)
        assert float(m["rewards/accuracies"][i]) == (1.0 if c > r else 0.0)
    # Policy equal to the reference: log 2 per pair, whatever beta.
    same, _ = dpo_loss(pc, pr, pc, pr, 3.0)
    assert same.tolist() == pytest.approx([math.log(2)] * 3, rel=1e-6)


def test_dpo_gradient_and_sft_term():
    pc = torch.tensor([-3.0, -1.0], requires_grad=True)
    pr = torch.tensor([-2.0, -4.0], requires_grad=True)
    rc, rr = torch.tensor([-3.0, -2.0]), torch.tensor([-2.5, -3.0])
    beta, w = 0.5, 0.2
    nll = torch.tensor([1.5, 0.5])
    losses, _ = dpo_loss(pc, pr, rc, rr, beta, sft_weight=w, policy_chosen_nll=nll)
    losses.sum().backward()
    for i in range(2):
        z = beta * ((float(pc[i]) - float(rc[i])) - (float(pr[i]) - float(rr[i])))
        sig = 1 / (1 + math.exp(-z))
        assert float(losses[i]) == pytest.approx(-math.log(sig) + w * float(nll[i]), rel=1e-6)
        # d/dpi_c -log sigma(z) = -beta (1 - sigma(z)); d/dpi_r = +beta (1 - sigma(z))
        assert float(pc.grad[i]) == pytest.approx(-beta * (1 - sig), rel=1e-6)
        assert float(pr.grad[i]) == pytest.approx(beta * (1 - sig), rel=1e-6)
    with pytest.raises(ValueError, match="dpo-beta"):
        dpo_loss(pc, pr, rc, rr, 0.0)
    with pytest.raises(ValueError, match="policy_chosen_nll"):
        dpo_loss(pc, pr, rc, rr, 0.1, sft_weight=1.0)

"""The DPO loss and its logged quantities (Rafailov et al. 2023, "Direct Preference
Optimization", eq. 7), from sequence log-probabilities of response tokens.

The model returns per-token cross entropies ``-log p(label)`` (vocabulary-parallel at TP), so a
sequence's log-probability of its response is :func:`sequence_logps`: minus the masked sum of
those losses (the mask covers the response tokens, as the preference datasets'
``_loss_mask_document`` do).

Not yet wired into a training script (a DPO run needs paired chosen/rejected micro-batches and a
reference pass); this module is the loss those will call.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F


def sequence_logps(token_losses: torch.Tensor, loss_mask: torch.Tensor,
                   average: bool = False) -> torch.Tensor:
    """``[b]`` fp32 log-probabilities of the masked (response) tokens of each row.

    Args:
        token_losses: ``[b, s]`` per-token cross entropy ``-log p(label_t)`` (nats).
        loss_mask: ``[b, s]`` 1 on response labels, 0 elsewhere.
        average: divide by each row's response tokens (length normalisation, as SimPO / IPO's
            variants); a row without response tokens then gives 0.
    """
    mask = loss_mask.float()
    total = -(token_losses.float() * mask).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1.0) if average else total


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             reference_chosen: torch.Tensor, reference_rejected: torch.Tensor, beta: float,
             sft_weight: float = 0.0, policy_chosen_nll: Optional[torch.Tensor] = None):
    """The sigmoid DPO loss per pair and the logged rewards.

    ``loss_i = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` (eq. 7), plus
    ``sft_weight * policy_chosen_nll_i`` when an SFT term is asked for (RPO, Pang et al. 2024).

    Args:
        policy_chosen, policy_rejected, reference_chosen, reference_rejected: ``[b]`` sequence
            log-probabilities (nats; :func:`sequence_logps`), the reference ones without grad.
        beta: ``--dpo-beta`` (> 0).
        sft_weight: weight of the chosen responses' NLL (0: pure DPO).
        policy_chosen_nll: ``[b]`` the chosen responses' NLL (per token, usually); needed when
            ``sft_weight`` is not 0.

    Returns:
        ``(losses [b], metrics)``; metrics (detached, ``[b]``): ``rewards/chosen``
        ``= beta * (pi_c - ref_c)``, ``rewards/rejected``, ``rewards/margins`` (their difference),
        ``rewards/accuracies`` (1.0 where chosen > rejected).

    Raises:
        ValueError: ``beta <= 0``, or ``sft_weight`` without ``policy_chosen_nll``.
    """
    if beta <= 0:
        raise ValueError(f"--dpo-beta {beta}: must be > 0")
    chosen = beta * (policy_chosen.float() - reference_chosen.float())
    rejected = beta * (policy_rejected.float() - reference_rejected.float())
    losses = -F.logsigmoid(chosen - rejected)
    if sft_weight:
        if policy_chosen_nll is None:
            raise ValueError("an SFT term (sft_weight) needs policy_chosen_nll")
        losses = losses + sft_weight * policy_chosen_nll.float()
    metrics: Dict[str, torch.Tensor] = {
        "rewards/chosen": chosen.detach(), "rewards/rejected": rejected.detach(),
        "rewards/margins": (chosen - rejected).detach(),
        "rewards/accuracies": (chosen > rejected).float().detach()}
    return losses, metrics

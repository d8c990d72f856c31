"""A scalar reward head on the LLaMA model (DeepSpeed-Chat step 2; transformers'
``LlamaForSequenceClassification`` with ``num_labels=1``: ``score = Linear(hidden, 1, bias=False)``
on the final norm's output).

:func:`attach_reward_head` turns the last pipeline stage's :class:`~megatron.model.LlamaModel`
into a reward model in place: the stage's ``forward(tokens, positions, mask)`` (no labels) returns
``[b, s]`` scores, one per position, instead of logits; :func:`last_token_scores` reads each row's
score at its last non-padding position. The head's weight ``[1, h]`` is replicated on every
tensor-parallel rank (the full hidden state is there; under sequence parallelism it is gathered
first, with a backward that keeps this rank's slice, so no gradient is counted twice). The
vocabulary output layer stays in the model (a loaded checkpoint holds it) but is frozen and unused.

Loading: a checkpoint without ``reward_head.weight`` (an SFT or pretrained one, with
``--finetune``) keeps the head's initial weights (normal, ``std``, from a fixed seed: the same
on every rank and layout); a reward model's own checkpoint restores it.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

HEAD = "reward_head.weight"
HEAD_SEED = 20240  # the head's initial draw: layout-independent


def _reward_logits(self, hidden: torch.Tensor) -> torch.Tensor:
    """``[s, b, h]`` (``[s/TP, b, h]`` under sequence parallelism) -> ``[s, b]`` scores."""
    if self.sequence_parallel:
        # Every rank computes the whole gradient of the gathered states: keep its slice.
        hidden = gather_from_sequence_parallel_region(hidden, self.tp_group,
                                                      tensor_parallel_output_grad=False)
    return F.linear(hidden, self.reward_head.weight).squeeze(-1)


def _keep_initial_head(module, state_dict, prefix, *args):
    """Load pre-hook: a checkpoint without the head keeps the initial one."""
    if prefix + HEAD not in state_dict:
        state_dict[prefix + HEAD] = module.reward_head.weight.detach().clone()


def attach_reward_head(model, std: float = 0.02):
    """Make ``model`` (a last-stage :class:`~megatron.model.LlamaModel`, before wrapping) a reward
    model in place: a ``reward_head`` ``Linear(h, 1, bias=False)`` in the model's parameter dtype
    and device, ``N(0, std)`` from :data:`HEAD_SEED`; the vocabulary output layer frozen. Stages
    without the output (``post_process=False``) are returned unchanged. Returns ``model``."""
    if not model.post_process:
        return model
    config = model.config
    weight = torch.empty(1, config.hidden_size, dtype=torch.float32)
    weight.normal_(0.0, std, generator=torch.Generator().manual_seed(HEAD_SEED))
    device = next(model.parameters()).device
    model.reward_head = torch.nn.Linear(config.hidden_size, 1, bias=False, device=device,
                                        dtype=config.params_dtype)
    with torch.no_grad():
        model.reward_head.weight.copy_(weight)
    # LlamaModel has an output_layer only on the last stage with untied embeddings
    output_layer = model._modules.get("output_layer")
    for p in (output_layer.parameters() if output_layer is not None else ()):
        p.requires_grad_(False)
    model._logits = types.MethodType(_reward_logits, model)
    model._register_load_state_dict_pre_hook(_keep_initial_head, with_module=True)
    return model


def last_token_scores(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[b]`` fp32: row ``i``'s score at position ``lengths[i] - 1`` (its last non-padding token).

    Args:
        scores: ``[b, s]`` per-position scores.
        lengths: ``[b]`` int64, tokens of each row before its padding (1 to s).
    """
    index = (lengths.long() - 1).clamp(min=0).to(scores.device).unsqueeze(1)
    return scores.float().gather(1, index).squeeze(1)


def pairwise_reward_loss(chosen: torch.Tensor, rejected: torch.Tensor):
    """The reward model's pairwise loss ``-log sigmoid(r_c - r_r)`` per pair (InstructGPT,
    Ouyang et al. 2022, eq. 1; DeepSpeed-Chat step 2) and the logged values.

    Args:
        chosen, rejected: ``[b]`` scores of the pairs' chosen and rejected rows.

    Returns:
        ``(losses [b], metrics)``: metrics (detached, ``[b]``) ``rewards/chosen``,
        ``rewards/rejected``, ``rewards/margins`` (``r_c - r_r``), ``rewards/accuracies`` (1.0
        where ``r_c > r_r``).
    """
    margin = chosen.float() - rejected.float()
    return -F.logsigmoid(margin), {
        "rewards/chosen": chosen.detach().float(), "rewards/rejected": rejected.detach().float(),
        "rewards/margins": margin.detach(), "rewards/accuracies": (margin > 0).float().detach()}

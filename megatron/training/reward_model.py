"""Reward-model training (DeepSpeed-Chat step 2): ``finetune_llama.py --reward-model``.

The model is the LLaMA model with a scalar head on its final norm's output
(:func:`megatron.model.reward_head.attach_reward_head`, transformers'
``LlamaForSequenceClassification`` with one label); a row's reward is the head's score at its
last non-padding position. Data: the preference pairs DPO reads (``--data-path
{prefix}_chosen_document``, rows chosen and rejected interleaved, megatron/training/pairs.py).
Loss per pair: ``-log sigmoid(r_c - r_r)``; the iteration's loss is the mean over the global
batch's pairs. Logged: ``reward loss``, ``rewards/chosen``, ``rewards/rejected``,
``rewards/margins``, ``rewards/accuracies`` (means over the pairs).

Start from an SFT or pretrained checkpoint with ``--load CKPT --finetune`` (the head keeps its
initial draw); the saved checkpoint holds ``reward_head.weight`` and exports with
``tools/checkpoint/convert.py --saver hf`` as ``LlamaForSequenceClassification``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from megatron.config.sections import ConfigSection
from megatron.model.reward_head import attach_reward_head, last_token_scores, pairwise_reward_loss
from megatron.training.pairs import check_pair_flags, pair_batch, pair_datasets, report_sums
from megatron.usage_error import UsageError

LOGGED = ("reward loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
          "rewards/accuracies")


@dataclass(frozen=True)
class RewardConfig:
    """The reward model's flags (``config.extra["reward"]``)."""

    reward_model: bool = False
    """``--reward-model``: train a scalar reward head with the pairwise loss on preference pairs.
    Default off."""


def add_reward_args(parser):
    group = parser.add_argument_group("reward model")
    group.add_argument("--reward-model", action="store_true",
                       help="train a reward model (scalar head, pairwise loss) on preference pairs")
    return parser


REWARD_SECTION = ConfigSection("reward", RewardConfig, add_reward_args)


def check_reward_flags(config) -> None:
    """Raises UsageError: ``--reward-model`` with ``--dpo``, or a pair-stage refusal
    (:func:`megatron.training.pairs.check_pair_flags`)."""
    if config.extra["dpo"].dpo:
        raise UsageError("--reward-model and --dpo: choose one stage")
    check_pair_flags(config, "--reward-model")


def with_reward_head(model_provider):
    """``model_provider`` (the entry script's, e.g. ``pretrain_llama.model_provider``) whose last
    stage carries the reward head (:func:`~megatron.model.reward_head.attach_reward_head`)."""
    def provider(config, pg_collection, device, *, pre_process=True, post_process=True,
                 vp_stage=None):
        model = model_provider(config, pg_collection, device, pre_process=pre_process,
                               post_process=post_process, vp_stage=vp_stage)
        return attach_reward_head(model, std=config.model.init_method_std)
    return provider


class RewardModel:
    """One reward-model run's datasets provider and forward step (the ``pretrain`` hooks).

    Args:
        config: the run's frozen :class:`~megatron.config.Config`.
        check_ids: ``check_ids(tokens)`` raises ValueError for ids outside the vocabulary.
        pad_id: padding id of the rows.
    """

    def __init__(self, config, check_ids, pad_id: int):
        self.config, self.check_ids, self.pad_id = config, check_ids, pad_id

    def datasets_provider(self, config, train_val_test_num_samples):
        return pair_datasets(config, train_val_test_num_samples, self.pad_id, "reward model")

    def forward_step(self, data_iterator, model):
        """One micro-batch of pairs: ``(scores [2m, s], loss_func)``."""
        device = next(model.parameters()).device
        tokens, _, _, position_ids, lengths, _ = pair_batch(
            next(data_iterator), device, self.check_ids)
        return model(tokens, position_ids, None), partial(self.loss_func, lengths)

    @staticmethod
    def loss_func(lengths, output_tensor):
        """``(sum of pair losses, pairs, logged (sum, pairs) of this rank)``
        (the training step sums them over the data-parallel group)."""
        rewards = last_token_scores(output_tensor, lengths).view(-1, 2)
        losses, metrics = pairwise_reward_loss(rewards[:, 0], rewards[:, 1])
        pairs = torch.tensor(float(losses.numel()), device=losses.device)
        sums = report_sums([losses, *(metrics[k] for k in LOGGED[1:]), pairs])
        return losses.sum(), pairs.to(torch.int64), dict(zip(LOGGED, sums))

"""Mixture-of-experts layer in Megatron-Core's names: ``router.py`` (top-k routing, expert bias),
``experts.py`` (grouped expert weights), ``shared_experts.py``, ``token_dispatcher.py``
(all-to-all / all-gather over the expert-parallel group), ``capacity.py`` (token dropping on the
whole micro-batch), ``moe_utils.py`` (load-balancing and z losses, their backward),
``moe_layer.py`` (``MoELayer``)."""

from megatron.core.transformer.moe.moe_layer import (MoELayer, collect_aux_losses, is_moe_layer,
                                                     moe_token_group)

__all__ = ["MoELayer", "collect_aux_losses", "is_moe_layer", "moe_token_group"]

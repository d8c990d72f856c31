"""Context parallelism: one sequence split over ranks, attention exact across the split.

``split``: the load-balanced causal split of a batch and its positions; ``attention``: the ring
(``p2p``) and all-gather attentions; ``block_attention``: one block of attention with its
log-sum-exp; ``loss``: the loss and token count over the split.
"""

from megatron.core.context_parallel.attention import CP_COMM_TYPES, context_parallel_attention
from megatron.core.context_parallel.loss import reduce_loss_for_context_parallel
from megatron.core.context_parallel.split import (check_context_parallel_seq_length,
                                                  context_parallel_indices,
                                                  context_parallel_positions,
                                                  get_batch_on_this_cp_rank,
                                                  split_for_context_parallel)

__all__ = ["CP_COMM_TYPES", "context_parallel_attention", "check_context_parallel_seq_length",
           "context_parallel_indices", "context_parallel_positions", "get_batch_on_this_cp_rank",
           "reduce_loss_for_context_parallel", "split_for_context_parallel"]

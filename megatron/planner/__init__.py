"""Memory and layout planning for LLaMA training (``tools/plan.py``): per-rank memory
(:mod:`megatron.planner.memory`) and a simple iteration-time model (:mod:`megatron.planner.cost`)."""

from megatron.planner.cost import Estimate, Hardware, Layout, estimate, rank_layouts
from megatron.planner.memory import (MemoryEstimate, activation_bytes_per_layer, estimate_memory,
                                     grad_buffer_numel, optimizer_state_bytes, param_numels)

__all__ = ["Estimate", "Hardware", "Layout", "MemoryEstimate", "activation_bytes_per_layer",
           "estimate", "estimate_memory", "grad_buffer_numel", "optimizer_state_bytes",
           "param_numels", "rank_layouts"]

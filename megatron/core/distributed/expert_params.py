"""Which parameters are expert parameters: the one test DDP, the optimizer and checkpoints share.

Megatron-Core marks an expert parameter with ``param.allreduce = False`` (its gradient is not
all-reduced over the whole data-parallel group but over the expert-data-parallel group
``expt_dp``); ``param.is_expert = True`` is accepted as the same mark. Expert parameters get
buffers of their own (reduced over ``expt_dp``), their own optimizer part (norm summed over
``tp_ep_pp``) and checkpoint boxes replicated over ``expt_dp``.
"""

from __future__ import annotations

import torch


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """True for a parameter marked ``allreduce = False`` (Megatron-Core) or ``is_expert = True``."""
    marks = vars(param)  # a parameter's own attributes: no probe of the class
    return marks.get("allreduce", True) is False or bool(marks.get("is_expert", False))


def mark_expert(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Mark ``param`` as an expert parameter (Megatron-Core's ``allreduce = False``)."""
    param.allreduce = False
    return param

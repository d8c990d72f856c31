"""One forward pass of a pipeline-parallel, tensor-parallel model for inference.

Stages run in turn: each non-first stage receives the hidden states ``[s, b, h]`` from the previous
pipeline rank (``torch.distributed.recv``), each non-last stage sends its output to the next. The
last stage all-gathers its vocabulary partitions over the tensor-parallel group, so every rank of
the last stage holds the full logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized()


def gather_vocab_logits(logits: torch.Tensor) -> torch.Tensor:
    """``[b, s, v/T] -> [b, s, v]``: all-gather over the tensor-parallel group (forward only)."""
    if not _distributed() or ps.get_tensor_model_parallel_world_size() == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   inference_params=None) -> Optional[torch.Tensor]:
    """Run ``tokens [b, s]`` (int64, needed on every rank for its shape) through the pipeline.

    Collective over the pipeline group (point-to-point) and, on the last stage, the
    tensor-parallel group (all-gather).

    Returns:
        full-vocabulary logits ``[b, s, v]`` (padded vocabulary, model dtype) on last-stage ranks;
        None on other stages.
    """
    b, s = tokens.shape
    first = not _distributed() or ps.is_pipeline_first_stage()
    last = not _distributed() or ps.is_pipeline_last_stage()
    config = model.config
    device = tokens.device
    if not first:
        hidden = torch.empty(s, b, config.hidden_size, dtype=config.params_dtype, device=device)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank(),
                  group=ps.get_pipeline_model_parallel_group())
        model.set_input_tensor(hidden)
    out = model(tokens if first else None, position_ids, None, inference_params=inference_params)
    if not last:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank(),
                  group=ps.get_pipeline_model_parallel_group())
        return None
    return gather_vocab_logits(out)

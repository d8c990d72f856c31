"""One forward pass of a pipeline-parallel, tensor-parallel model for inference.

Stages run in turn through core's point-to-point communication
(:mod:`megatron.core.pipeline_parallel.p2p_communication`): each non-first stage receives the
hidden states ``[s, b, h]`` from the previous pipeline rank, each non-last stage sends its output
to the next. The last stage all-gathers its vocabulary partitions over the tensor-parallel group
(:func:`megatron.core.tensor_parallel.mappings.all_gather_last_dim`), so every rank of the last
stage holds the full logits. The groups come from the ``pg_collection`` argument.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.common import PipelineConfig
from megatron.core.tensor_parallel.mappings import all_gather_last_dim


def gather_vocab_logits(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """``[b, s, v/T] -> [b, s, v]``: all-gather over the tensor-parallel group ``tp_group``
    (forward only; None: a world of one)."""
    return all_gather_last_dim(logits, tp_group)


@torch.no_grad()
def forward_logits(model, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   inference_params=None, *, pg_collection) -> Optional[torch.Tensor]:
    """Run ``tokens [b, s]`` (int64, needed on every rank for its shape) through the pipeline.

    Collective over the pipeline group (point-to-point) and, on the last stage, the
    tensor-parallel group (all-gather).

    Args:
        model: this rank's stage (``LlamaModel``), in eval mode.
        pg_collection: this rank's process groups
            (:class:`~megatron.core.process_groups.ProcessGroupCollection`).

    Returns:
        full-vocabulary logits ``[b, s, v]`` (padded vocabulary, model dtype) on last-stage ranks;
        None on other stages.
    """
    b, s = tokens.shape
    pp = pg_collection.pp
    config = model.config
    wire = PipelineConfig(hidden_size=config.hidden_size, params_dtype=config.params_dtype)
    shape = (s, b, config.hidden_size)
    first, last = pg_collection.is_pipeline_first_stage(), pg_collection.is_pipeline_last_stage()
    if not first:
        model.set_input_tensor(p2p.recv_forward(shape, wire, pp, requires_grad=False))
    out = model(tokens if first else None, position_ids, None, inference_params=inference_params)
    if not last:
        p2p.send_forward(out, shape, wire, pp)
        return None
    return gather_vocab_logits(out, pg_collection.tp.group)

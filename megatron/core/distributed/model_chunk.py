"""The model-chunk protocol: what the training loop, the optimizers and the checkpoints ask of a
model chunk, instead of probing it for attributes.

A chunk is a :class:`~megatron.core.distributed.DistributedDataParallel` wrapper (the training
program's), or a plain ``torch.nn.Module`` (tests, tools): :func:`as_model_chunk` gives either
the protocol, a plain module as a chunk whose gradients and parameters need no synchronisation.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel


@runtime_checkable
class ModelChunk(Protocol):
    """Gradient sync, parameter sync, reshard."""

    def finish_grad_sync(self) -> None:
        """Complete the data-parallel gradient reduction (collective)."""

    def start_param_sync(self, expert: Optional[bool] = None) -> None:
        """Launch the parameter all-gathers after a distributed-optimizer step."""

    def finish_param_sync(self) -> None:
        """Complete pending all-gathers; ZeRO-3: gather every unit (collective). Call before
        reading the weights outside a forward (evaluation, saving, loading into them)."""

    def wait_param_sync(self) -> None:
        """Wait for the all-gathers in flight (never starts one)."""

    def reshard_params(self) -> None:
        """ZeRO-3: copy just-loaded full parameters into the shards and free them."""


class PlainChunk:
    """A module without data-parallel wrapper as a :class:`ModelChunk`: nothing to sync."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def finish_grad_sync(self) -> None:
        pass

    def start_param_sync(self, expert: Optional[bool] = None) -> None:
        pass

    def finish_param_sync(self) -> None:
        pass

    def wait_param_sync(self) -> None:
        pass

    def reshard_params(self) -> None:
        pass


def as_model_chunk(chunk: torch.nn.Module) -> ModelChunk:
    """``chunk`` itself when it is a :class:`DistributedDataParallel`, else a
    :class:`PlainChunk` of it."""
    return chunk if isinstance(chunk, DistributedDataParallel) else PlainChunk(chunk)

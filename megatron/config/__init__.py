"""The frozen configuration of a run, built once by ``main()`` and passed down.

One :class:`Config` carries a section per concern, each a frozen dataclass whose field names are
the argparse ``dest`` names of ``megatron/arguments/parser.py`` (a grep leads from a flag to the code
that uses it) and whose field docstrings give the flag, the unit and the default:

- :class:`ModelConfig` (``model.py``): what ``LlamaModel`` reads;
- :class:`ParallelConfig` (``parallel.py``): the layout and the gradient reduction;
- :class:`OptimizerConfig`, :class:`SchedulerConfig` (``megatron.core.optimizer``);
- :class:`TrainingConfig` (``training.py``): batches, length, evaluation, stopping;
- :class:`DataConfig` (``data.py``): datasets, loading and the tokenizer;
- :class:`CheckpointConfig` (``checkpoint.py``), :class:`LoggingConfig` (``logging.py``);
- ``extra``: the sections an entry script registers for its own flags
  (:class:`ConfigSection`, ``sections.py``), by name.
- :class:`MoEConfig` (``moe.py``): the mixture-of-experts flags.

:func:`build_config` (``builder.py``) is the only reader of the argparse namespace and computes
the derived values; :func:`checkpoint_args` (``saved_args.py``) turns a configuration back into
the plain dict of Megatron names that checkpoints store.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from megatron.config.builder import (FLAGS_NOT_IN_CONFIG, build_config, build_model_config,
                                     params_dtype_from_args, rope_scaling_from_args)
from megatron.config.checkpoint import CheckpointConfig
from megatron.config.data import DataConfig
from megatron.config.logging import LoggingConfig
from megatron.config.model import ModelConfig
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.saved_args import checkpoint_args
from megatron.config.sections import ConfigSection
from megatron.config.training import TrainingConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfig, SchedulerConfig

__all__ = ["CheckpointConfig", "Config", "ConfigSection", "DataConfig", "FLAGS_NOT_IN_CONFIG", "LoggingConfig",
           "ModelConfig", "MoEConfig", "OptimizerConfig", "ParallelConfig", "SchedulerConfig",
           "TrainingConfig", "build_config", "build_model_config", "checkpoint_args",
           "params_dtype_from_args", "rope_scaling_from_args"]


@dataclass(frozen=True)
class Config:
    """Every configuration of a run (:func:`build_config`).

    Raises:
        ValueError: if two sections disagree on a flag both hold (tensor-parallel size,
            sequence parallelism, seed).
    """

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    moe: MoEConfig = MoEConfig()
    # The entry script's registered sections, ``{name: frozen section}`` (:class:`ConfigSection`),
    # read-only; not a dataclass field (the fields are the built-in sections), set by
    # :meth:`with_extra`.
    extra: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    def with_extra(self, extra: Mapping[str, Any]) -> "Config":
        """This configuration with ``extra`` as its registered sections."""
        new = dataclasses.replace(self)
        object.__setattr__(new, "extra", MappingProxyType(dict(extra)))
        return new

    def __getstate__(self):
        state = dict(self.__dict__)
        if "extra" in state:  # a mappingproxy does not pickle; ranks are spawned with it
            state["extra"] = dict(state["extra"])
        return state

    def __setstate__(self, state):
        state = dict(state)
        extra = state.pop("extra", None)
        self.__dict__.update(state)
        if extra is not None:
            object.__setattr__(self, "extra", MappingProxyType(extra))

    def __post_init__(self):
        for flag, a, b in (
                ("--tensor-model-parallel-size", self.model.tensor_model_parallel_size,
                 self.parallel.tensor_model_parallel_size),
                ("--sequence-parallel", self.model.sequence_parallel,
                 self.parallel.sequence_parallel),
                ("--seed", self.model.seed, self.training.seed)):
            if a != b:
                raise ValueError(f"{flag}: the model section has {a}, another section {b}")

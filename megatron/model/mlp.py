"""SwiGLU feed-forward block (Shazeer 2020, "GLU Variants Improve Transformer"), as in LLaMA.

Shapes: s = sequence, b = micro-batch, h = hidden, f = ffn_hidden_size, T = tensor-parallel size.
"""

from __future__ import annotations

import torch

from megatron.config import ModelConfig
from megatron.core.tensor_parallel.checkpoint_without_output import CheckpointWithoutOutput
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                  TensorParallelGroupMixin)
from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer.swiglu import swiglu
from megatron.core.transformer.initialization import (fused_init_method, normal_block_init,
                                                      scaled_std)
from megatron.model.recompute import recompute_active, selective_modules


class SwiGLUMLP(TensorParallelGroupMixin, torch.nn.Module):
    """``down(silu(gate(x)) * up(x))``, tensor-parallel over f (Megatron-LM's ``ParallelMLP``).

    ``dense_h_to_4h`` fuses gate and up: a ColumnParallelLinear ``h -> 2f`` whose rows on each
    rank are ``[gate rows of the rank; up rows of the rank]`` (Megatron-LLaMA's layout); a naive
    split of ``[gate; up]`` would give rank 0 only gate rows. ``dense_4h_to_h`` is a
    RowParallelLinear ``f -> h`` with the scaled init.

    Selective recompute (:mod:`megatron.model.recompute`): ``mlp`` re-runs the whole block in
    backward; ``act`` keeps neither the activation's intermediate nor its output
    ``[s, b, f/T]`` (recomputed from the kept ``gate_up`` when backward reaches ``dense_4h_to_h``).

    Args:
        config: the model configuration.
        layer_number: global 1-based layer number (seeds the initialisation).
        pg_collection: the process groups (the linears use ``pg_collection.tp``).
        device: device of the parameters.

    Raises:
        ValueError: if ``--ffn-hidden-size`` is not divisible by the tensor-parallel size.
    """

    def __init__(self, config: ModelConfig, layer_number: int, *, pg_collection, device=None):
        super().__init__()
        tp, f = config.tensor_model_parallel_size, config.ffn_hidden_size
        if f % tp:
            raise ValueError(f"--ffn-hidden-size ({f}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp})")
        self._set_group(pg_collection.tp.group)
        common = dict(bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype, device=device, tp_group=self.tp_group,
                      gradient_accumulation_fusion=config.gradient_accumulation_fusion)
        std, seed = config.init_method_std, config.seed
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, 2 * f, gather_output=False,
            init_method=fused_init_method(
                [(f, normal_block_init(std, seed, layer_number, "mlp.gate")),
                 (f, normal_block_init(std, seed, layer_number, "mlp.up"))], tp),
            **common)
        self.dense_4h_to_h = RowParallelLinear(
            f, config.hidden_size, input_is_parallel=True,
            init_method=normal_block_init(scaled_std(std, config.num_layers), seed, layer_number,
                                          "mlp.dense_4h_to_h"),
            **common)
        modules = selective_modules(config)
        self.recompute_mlp = "mlp" in modules
        self.recompute_act = "act" in modules and not self.recompute_mlp

    def fused_row_blocks(self):
        """The logical blocks of this rank's fused rows, for checkpoints in global coordinates
        (:mod:`megatron.model.sharded_state`): ``{parameter: [(block, local rows)]}``."""
        rows = self.dense_h_to_4h.weight.shape[0] // 2
        blocks = [("gate", rows), ("up", rows)]
        return {"dense_h_to_4h.weight": blocks, "dense_h_to_4h.bias": blocks}

    @staticmethod
    def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate_up)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.dense_h_to_4h(hidden)
        if not (self.recompute_act and recompute_active(self)):
            out, _ = self.dense_4h_to_h(self._swiglu(gate_up))
            return out
        ckpt = CheckpointWithoutOutput()
        out, _ = self.dense_4h_to_h(ckpt.checkpoint(self._swiglu, gate_up))
        ckpt.discard_output_and_register_recompute(out)
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]`` (all-reduced over the tensor-parallel group), or
        ``[s/T, b, h] -> [s/T, b, h]`` with sequence parallelism."""
        if self.recompute_mlp and recompute_active(self):
            return checkpoint(self._forward, False, hidden, tp_group=self.tp_group)
        return self._forward(hidden)

"""The LLaMA language model as one pipeline stage (Touvron et al. 2023, "LLaMA", section 2.2).

Shapes: b = micro-batch, s = sequence, h = hidden, v = padded vocabulary, T = tensor-parallel size.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron.config import ModelConfig
from megatron.core.context_parallel import context_parallel_positions
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.fused_cross_entropy import linear_cross_entropy
from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, TensorParallelGroupMixin,
                                                  VocabParallelEmbedding,
                                                  linear_with_grad_accumulation)
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.model.attention import check_attention_config, check_attention_mask
from megatron.model.attention_mask import AttentionMask
from megatron.model.chunked_attention import attention_temperature
from megatron.core.transformer.initialization import init_vocab_rows, normal_block_init
from megatron.model.recompute import forward_layers
from megatron.model.rms_norm import RMSNorm
from megatron.model.rotary import RotaryEmbedding
from megatron.model.transformer import TransformerLayer, hidden_dropout


def _check_config(config: ModelConfig, layer_numbers: Sequence[int], pg_collection) -> None:
    check_attention_config(config)
    if config.padded_vocab_size % config.tensor_model_parallel_size:
        raise ValueError(f"padded vocabulary size ({config.padded_vocab_size}) must be divisible by "
                         f"--tensor-model-parallel-size ({config.tensor_model_parallel_size}); "
                         "pad it with megatron.tokenizer.vocab_size_with_padding")
    bad = [n for n in layer_numbers if not 1 <= n <= config.num_layers]
    if bad:
        raise ValueError(f"layer numbers {bad} outside 1..--num-layers ({config.num_layers})")
    if pg_collection.cp.size != config.context_parallel_size:
        raise ValueError(f"config.context_parallel_size ({config.context_parallel_size}) differs "
                         f"from the size of the context-parallel group it is given "
                         f"({pg_collection.cp.size}): pass the groups of initialize_model_parallel")
    tp = pg_collection.tp.size
    if tp != config.tensor_model_parallel_size:
        raise ValueError(f"config.tensor_model_parallel_size ({config.tensor_model_parallel_size}) "
                         f"differs from the size of the tensor-parallel group it is given ({tp}): "
                         "pass the groups of initialize_model_parallel")


class LlamaModel(TensorParallelGroupMixin, torch.nn.Module):
    """LLaMA (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU), tensor-parallel, one
    pipeline stage.

    Submodules (present where the stage needs them): ``word_embeddings`` (first stage),
    ``layers`` (the stage's transformer layers, local index; ``layers[i].layer_number`` is
    global and 1-based), ``final_layernorm`` and ``output_layer`` (last stage, untied), or
    ``word_embeddings_for_head`` (last stage with tied embeddings and PP > 1: a copy of the word
    embedding, initialised identically, as Megatron-LM's legacy model).

    With ``sequence_parallel`` (and TP > 1; Korthikanti et al. 2022, section 4.2.2) the hidden
    states between the tensor-parallel blocks, and so the tensors passed between pipeline stages,
    are ``[s/T, b, h]``: this rank's contiguous sequence chunk; s must be divisible by T.

    With context parallelism (``pg_collection.cp`` of CP > 1 ranks) every tensor of the stage
    holds this rank's ``s/CP`` tokens, chunks ``i`` and ``2 CP - 1 - i`` of the sequence in ``2 CP``
    (:mod:`megatron.core.context_parallel.split`; the caller splits ``input_ids``, ``labels`` and
    ``position_ids``); attention is the exact split attention over the CP group, and sequence
    parallelism splits the ``s/CP`` tokens again over TP.

    Args:
        config: the model configuration (its ``tensor_model_parallel_size`` must equal the size
            of ``pg_collection.tp``, its ``context_parallel_size`` that of ``pg_collection.cp``).
        pg_collection: the process groups
            (:class:`~megatron.core.process_groups.ProcessGroupCollection`; the layers use its
            ``tp``, attention its ``cp``; ``ProcessGroupCollection.world_of_one()`` in a single
            process).
        pre_process: this stage embeds tokens (first pipeline stage).
        post_process: this stage computes logits / loss (last pipeline stage).
        layer_numbers: global 1-based numbers of the stage's layers (default: all);
            see :func:`megatron.model.get_layer_numbers`.
        device: device of the parameters (default: CPU).
        moe_config: the MoE section (:class:`~megatron.core.transformer.moe.moe_config.MoEConfig`) for a
            mixture-of-experts model, None for a dense one (see ``TransformerLayer``).

    Raises:
        ValueError: heads, groups, ffn or vocabulary not divisible by TP; layer numbers out of
            range; a config TP or CP size that disagrees with the process groups.
    """

    def __init__(self, config: ModelConfig, *, pg_collection, pre_process: bool = True,
                 post_process: bool = True, layer_numbers: Optional[Sequence[int]] = None,
                 device=None, moe_config=None):
        super().__init__()
        layer_numbers = list(range(1, config.num_layers + 1)) if layer_numbers is None else list(layer_numbers)
        _check_config(config, layer_numbers, pg_collection)
        self.config = config
        self._set_group(pg_collection.tp.group)
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.input_tensor = None
        # The layers ignore sequence_parallel at TP=1 (nothing to split); so does the model.
        self.sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        # Context parallelism: the stage sees s / CP tokens of each sequence (chunks cp_rank and
        # 2 CP - 1 - cp_rank); only attention communicates over the CP group.
        self.cp_size, self.cp_rank = pg_collection.cp.size, pg_collection.cp.rank
        self.rotary = RotaryEmbedding(config.kv_channels, config.rotary_base, config.rope_scaling)

        if pre_process:
            self.word_embeddings = self._make_word_embeddings(device)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, n, pg_collection=pg_collection, device=device,
                             moe_config=moe_config)
            for n in layer_numbers)
        if post_process:
            self.final_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon,
                                           sequence_parallel=self.sequence_parallel,
                                           params_dtype=config.params_dtype, device=device)
            if not self.share_embeddings_and_output_weights:
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, config.padded_vocab_size, bias=False, gather_output=False,
                    sequence_parallel=self.sequence_parallel,
                    init_method=self._vocab_init("output_layer"),
                    params_dtype=config.params_dtype, device=device, tp_group=self.tp_group,
                    gradient_accumulation_fusion=config.gradient_accumulation_fusion)
            elif not pre_process:
                self.word_embeddings_for_head = self._make_word_embeddings(device)
        if self.share_embeddings_and_output_weights and pre_process != post_process:
            # finalize_model_grads all-reduces this weight's gradient over the embedding group;
            # intermediate stages (and chunks) hold no copy.
            self.shared_embedding_or_output_weight().shared_embedding = True

    def _make_word_embeddings(self, device) -> VocabParallelEmbedding:
        # Seeded by name only, so the last stage's copy equals the first stage's embedding.
        c = self.config
        return VocabParallelEmbedding(c.padded_vocab_size, c.hidden_size,
                                      init_method=self._vocab_init("word_embeddings"),
                                      params_dtype=c.params_dtype, device=device,
                                      tp_group=self.tp_group,
                                      reduce_scatter_embeddings=self.sequence_parallel,
                                      gradient_accumulation_fusion=c.gradient_accumulation_fusion)

    def _vocab_init(self, name: str):
        """N(0, std) on the real vocabulary rows from block ``(seed, 0, name)``'s generator,
        zero padding rows (layout-independent)."""
        c = self.config
        return init_vocab_rows(normal_block_init(c.init_method_std, c.seed, 0, name),
                               c.vocab_size)

    def set_input_tensor(self, input_tensor) -> None:
        """Give a non-first stage its input ``[s, b, h]`` (a list of one tensor is accepted, as
        Megatron-Core's schedules pass it)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word-embedding weight ``[v/T, h]`` on the first stage; on the last stage the
        tied copy, or the output-layer weight when untied. Raises RuntimeError elsewhere."""
        if self.pre_process:
            return self.word_embeddings.weight
        if self.post_process:
            if self.share_embeddings_and_output_weights:
                return self.word_embeddings_for_head.weight
            return self.output_layer.weight
        raise RuntimeError("shared_embedding_or_output_weight() called on an intermediate "
                           "pipeline stage, which holds no embedding")

    def _output_weight(self) -> torch.Tensor:
        if not self.share_embeddings_and_output_weights:
            return self.output_layer.weight
        return self.shared_embedding_or_output_weight()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.share_embeddings_and_output_weights:
            return self.output_layer(hidden)[0]
        if not self.sequence_parallel:
            # forward: identity; backward: all-reduce over the tensor-parallel group.
            hidden = copy_to_tensor_model_parallel_region(hidden, self.tp_group)
        # With sequence parallelism: all-gather of the sequence forward, reduce-scatter backward.
        return linear_with_grad_accumulation(
            hidden, self.shared_embedding_or_output_weight(), sequence_parallel=self.sequence_parallel,
            gradient_accumulation_fusion=self.config.gradient_accumulation_fusion,
            tp_group=self.tp_group)

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[AttentionMask] = None,
                labels: Optional[torch.Tensor] = None, inference_params=None) -> torch.Tensor:
        """Run the stage.

        Args:
            input_ids: ``[b, s]`` int64 token ids (first stage; ignored elsewhere, may be None).
            position_ids: ``[b, s]`` int64 (None: ``0..s-1``, or under context parallelism the
                true positions of this rank's chunks; ``--reset-position-ids`` restarts them at
                each document).
            attention_mask: None (causal) or an
                :class:`~megatron.model.attention_mask.AttentionMask` (document ids of packed
                sequences, ``--reset-attention-mask``; under context parallelism the mask given
                the split, ``for_context_parallel``).
            labels: ``[b, s]`` int64 next-token targets (last stage).
            inference_params: None (training), or a :class:`megatron.inference.InferenceParams`
                KV cache for generation (pass ``position_ids`` of the new tokens then).

        Returns:
            Last stage with labels: per-token loss ``[b, s]`` fp32 (unreduced), a softmax over
            the true vocabulary (``config.true_vocab_size``; the padding columns excluded). Last
            stage without labels: logits ``[b, s, v/T]`` of this tensor-parallel rank's
            vocabulary partition, padding columns included as computed (generation never
            samples them: ``megatron.inference.sample``).
            Other stages: hidden ``[s, b, h]`` (``[s/T, b, h]`` with sequence parallelism) for the
            next stage.

        Raises:
            RuntimeError: a non-first stage without :meth:`set_input_tensor`.
            ValueError: with sequence parallelism, s not divisible by T.
        """
        tp = self.config.tensor_model_parallel_size
        check_attention_mask(attention_mask)
        if attention_mask is not None and attention_mask.cp_size != self.cp_size:
            raise ValueError(f"the attention mask is split for context-parallel size "
                             f"{attention_mask.cp_size}, the model runs at {self.cp_size}: "
                             "split the batch with get_batch_on_this_cp_rank")
        if self.pre_process:
            if self.sequence_parallel and input_ids.shape[1] % tp:
                raise ValueError(f"--sequence-parallel needs --seq-length ({input_ids.shape[1]}) "
                                 f"divisible by --tensor-model-parallel-size ({tp})")
            if self.sequence_parallel:
                # Megatron's order: the partial embeddings are reduce-scattered along the
                # sequence (no all-reduce then scatter), giving [s/T, b, h].
                hidden = self.word_embeddings(input_ids)
            else:
                hidden = self.word_embeddings(input_ids).transpose(0, 1).contiguous()
            hidden = hidden_dropout(hidden, self.config.hidden_dropout, self.training,
                                    self.sequence_parallel)
        else:
            if self.input_tensor is None:
                raise RuntimeError("a non-first pipeline stage needs set_input_tensor() before forward")
            hidden = self.input_tensor
        s, b = hidden.shape[:2]
        if self.sequence_parallel:
            s *= tp
        if position_ids is None:
            # This rank's tokens' true positions (0..s-1 at CP = 1).
            position_ids = context_parallel_positions(s * self.cp_size, b, self.cp_size,
                                                      self.cp_rank, hidden.device)
        rotary = self.rotary(position_ids)
        if self.config.attn_temperature_tuning:  # the NoPE layers' query scale (Llama 4)
            c = self.config
            rotary = rotary + (attention_temperature(position_ids, c.attn_temperature_floor_scale,
                                                     c.attn_temperature_scale),)
        hidden = forward_layers(self.layers, hidden, rotary, attention_mask, inference_params,
                                self.config, tp_group=self.tp_group)
        if not self.post_process:
            return hidden

        hidden = self.final_layernorm(hidden)
        if labels is not None and not self.sequence_parallel:
            # Output layer and loss fused: one fp32 [s*b, v/T] buffer instead of four.
            loss = linear_cross_entropy(
                copy_to_tensor_model_parallel_region(hidden, self.tp_group), self._output_weight(),
                labels.t(), tp_group=self.tp_group,
                gradient_accumulation_fusion=self.config.gradient_accumulation_fusion,
                vocab_size=self.config.true_vocab_size)
            return loss.t().contiguous()
        logits = self._logits(hidden)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous(),
                                            tp_group=self.tp_group,
                                            vocab_size=self.config.true_vocab_size)
        return loss.t().contiguous()

"""Build this rank's pipeline stage of a LLaMA from a checkpoint's stored arguments and load it."""

from __future__ import annotations

import glob
import os

import torch

from megatron.checkpointing import (CheckpointError, find_checkpoint, get_checkpoint_dir,
                                    load_checkpoint, read_saved_args)
from megatron.config import CheckpointConfig, ModelConfig
from megatron.model import get_layer_numbers
from megatron.model.llama import LlamaModel

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def checkpoint_args(load_dir: str) -> dict:
    """The ``args`` dict stored in the checkpoint named by ``load_dir``'s tracker (our names;
    a Megatron-LM checkpoint's translated).

    Raises:
        CheckpointError: no tracker file, no shard, a torch_dist checkpoint recording no arguments.
    """
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir} " + ("is a file" if os.path.lexists(load_dir)
                              else "does not exist") + ": give the checkpoint folder (the one "
                              "holding latest_checkpointed_iteration.txt)")
    found = find_checkpoint(load_dir)
    if found is None:
        raise CheckpointError(f"--load {load_dir} has no latest_checkpointed_iteration.txt")
    folder = get_checkpoint_dir(load_dir, *found)
    from megatron.checkpointing import torch_dist

    if torch_dist.is_torch_dist_checkpoint(folder):
        from megatron.checkpointing.foreign import megatron_lm_dist
        if megatron_lm_dist.is_megatron_lm(folder):
            return dict(megatron_lm_dist.saved_args(folder), ckpt_format="torch_dist")
        common = torch_dist.read_common(folder)
        if not isinstance(common.get("args"), dict) or not common["args"]:
            raise CheckpointError(f"{os.path.join(folder, torch_dist.COMMON_FILE)} records no args "
                                  "(the model's sizes): the model cannot be built from it")
        return dict(common["args"], ckpt_format="torch_dist",
                    true_vocab_size=common.get("true_vocab_size"))
    shards = sorted(glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt")))
    if not shards:
        raise CheckpointError(f"{folder} holds no mp_rank_*/model_optim_rng.pt")
    return read_saved_args(shards[0])


def model_config_from_args(saved: dict) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint's stored arguments."""
    if saved.get("bf16"):
        dtype = torch.bfloat16
    elif saved.get("fp16"):
        dtype = torch.float16
    else:
        dtype = _DTYPES.get(saved.get("params_dtype"), torch.float32)
    return ModelConfig(
        num_layers=saved["num_layers"], hidden_size=saved["hidden_size"],
        ffn_hidden_size=saved["ffn_hidden_size"], num_attention_heads=saved["num_attention_heads"],
        num_query_groups=saved.get("num_query_groups"), kv_channels=saved.get("kv_channels"),
        padded_vocab_size=saved["padded_vocab_size"], true_vocab_size=saved.get("true_vocab_size"),
        max_position_embeddings=saved["max_position_embeddings"],
        norm_epsilon=saved.get("norm_epsilon", 1e-5), rotary_base=saved.get("rotary_base", 10000.0),
        rope_scaling=saved.get("rope_scaling"),
        untie_embeddings_and_output_weights=saved.get("untie_embeddings_and_output_weights", True),
        qk_layernorm=bool(saved.get("qk_layernorm")), add_qkv_bias=bool(saved.get("add_qkv_bias")),
        qk_layernorm_full_width=bool(saved.get("qk_layernorm_full_width")),
        params_dtype=dtype, tensor_model_parallel_size=saved["tensor_model_parallel_size"],
        **llama4_attention_fields(saved))


def moe_config_for_inference(saved: dict):
    """The :class:`~megatron.core.transformer.moe.moe_config.MoEConfig` a mixture-of-experts checkpoint's stored
    arguments give for generation, None for a dense checkpoint.

    Routing is the trained one (top-k, score function, expert bias, groups, shared expert), but
    **dropless**: ``moe_expert_capacity_factor`` is None whatever the run trained with. A
    capacity is taken over the tokens of one forward, so with it a token's experts would depend
    on the other tokens of its step (the other requests, the chunking of its prompt); dropless,
    each token's experts and weights are a function of that token alone (Megatron-Core's
    inference runs dropless too). No router loss is computed (coefficients 0).
    """
    import dataclasses

    from megatron.core.transformer.moe.moe_config import MoEConfig

    if not saved.get("num_experts"):
        return None
    names = {f.name for f in dataclasses.fields(MoEConfig)}
    values = {k: v for k, v in saved.items() if k in names and v is not None}
    freq = values.get("moe_layer_freq", 1)
    values["moe_layer_freq"] = tuple(freq) if isinstance(freq, (list, tuple)) else freq
    values.setdefault("moe_ffn_hidden_size", saved["ffn_hidden_size"])
    values.update(moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
                  moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
                  moe_router_load_balancing_type="none")
    return MoEConfig(**values)


def llama4_attention_fields(saved: dict) -> dict:
    """Llama 4's attention fields recorded in ``saved`` (none for other models)."""
    from megatron.model.chunked_attention import ATTENTION_FIELDS
    out = {k: saved[k] for k in ATTENTION_FIELDS if saved.get(k) is not None}
    if "no_rope_freq" in out:
        out["no_rope_freq"] = tuple(out["no_rope_freq"])
    return out


def load_model_for_inference(load_dir: str, pg_collection, device=None):
    """This rank's stage of the checkpoint at ``load_dir``, weights loaded, in eval mode.

    Args:
        load_dir: the checkpoint folder (``--load``).
        pg_collection: the process groups of ``initialize_model_parallel`` with the
            checkpoint's TP and PP sizes (any sizes for a ``--ckpt-format torch_dist`` one) and
            context-parallel size 1 (a checkpoint trained with ``--context-parallel-size`` holds the
            same weights at every CP size: generation loads it at CP = 1; the KV-cache decoding
            does not split sequences); for a mixture-of-experts checkpoint, its expert-parallel
            size (:func:`moe_config_for_inference`: routing runs dropless).
        device: where the parameters go (default CPU).

    Returns:
        ``(model, saved_args)``.

    Raises:
        CheckpointError: the process layout differs from the checkpoint's (reshard it with
            ``tools/checkpoint/convert.py --loader megatron --saver megatron``).
        ValueError: groups with a context-parallel size above 1.
    """
    if pg_collection.cp.size > 1:
        raise ValueError(f"generation does not run under context parallelism (the groups have "
                         f"CP={pg_collection.cp.size}): initialize the groups with "
                         f"context_parallel_size=1; the checkpoint loads at any CP size")
    saved = checkpoint_args(load_dir)
    tp, pp = pg_collection.tp.size, pg_collection.pp.size
    want = (saved.get("tensor_model_parallel_size", 1), saved.get("pipeline_model_parallel_size", 1))
    if saved.get("ckpt_format") == "torch_dist":  # loads at any layout
        want = (tp, pp)
        saved = dict(saved, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        if saved.get("true_vocab_size"):  # the vocabulary padded as this TP size pads it
            from megatron.tokenizer import vocab_size_with_padding
            saved["padded_vocab_size"] = vocab_size_with_padding(
                saved["true_vocab_size"], saved.get("make_vocab_size_divisible_by", 128), tp)
    if (tp, pp) != want:
        raise CheckpointError(f"{load_dir} was saved at TP={want[0]}, PP={want[1]} but this run has "
                              f"TP={tp}, PP={pp}; reshard with tools/checkpoint/convert.py --loader "
                              f"megatron --saver megatron --target-tensor-parallel-size {tp} "
                              f"--target-pipeline-parallel-size {pp}")
    config = model_config_from_args(saved)
    if saved.get("num_experts") and tp > 1 and pg_collection.ep.size > 1:
        import dataclasses  # MoE tokens split over the tensor ranks: sequence parallelism

        config = dataclasses.replace(config, sequence_parallel=True)
    model = LlamaModel(config, pg_collection=pg_collection,
                       pre_process=pg_collection.is_pipeline_first_stage(),
                       post_process=pg_collection.is_pipeline_last_stage(),
                       layer_numbers=get_layer_numbers(config.num_layers, pp, pg_collection.pp.rank),
                       device=device, moe_config=moe_config_for_inference(saved))
    load_checkpoint([model], None, None, CheckpointConfig(load=load_dir, finetune=True),
                    pg_collection, run_flags=saved)
    return model.eval(), saved

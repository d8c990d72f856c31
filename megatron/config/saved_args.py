"""The ``args`` a checkpoint stores: a plain dict of Megatron names, made from the configuration.

Megatron-LM's checkpoints store its argparse namespace; ours store its values as plain data
(``torch.load(weights_only=True)`` reads them), so ``--use-checkpoint-args``, our converters and
Megatron's tools find the names they look for: every field of every section under its ``dest``
name, and the values of the flags that have no field because validation fixes or folds them
(``normalization``, ``position_embedding_type``, ``swiglu``, ``group_query_attention``, the
``--rope-scaling-*`` values of ``ModelConfig.rope_scaling``). ``params_dtype`` is left out: Megatron
stores a ``torch.dtype`` there, which plain data cannot hold (``bf16`` / ``fp16`` say it).
"""

from __future__ import annotations

import dataclasses

# The --rope-scaling-* flags' defaults, recorded when the run does not scale RoPE.
_ROPE_DEFAULTS = {"rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0,
                  "rope_scaling_high_freq_factor": 4.0,
                  "rope_scaling_original_max_position_embeddings": 8192}
_ROPE_KEYS = {"rope_scaling_factor": "factor", "rope_scaling_low_freq_factor": "low_freq_factor",
              "rope_scaling_high_freq_factor": "high_freq_factor",
              "rope_scaling_original_max_position_embeddings": "original_max_position_embeddings"}
_SECTIONS = ("model", "parallel", "optimizer", "scheduler", "training", "data", "checkpoint",
             "logging")
_LEFT_OUT = ("params_dtype",)


def plain(value):
    """A JSON-compatible copy of a value (tuples become lists, other objects strings)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


def implied_args(config) -> dict:
    """The values of the flags without a field, as the configuration implies them."""
    model = config.model
    scaling = model.rope_scaling or {}
    implied = {"normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True,
               "group_query_attention": model.num_query_groups != model.num_attention_heads,
               "use_rope_scaling": model.rope_scaling is not None}
    for name, key in _ROPE_KEYS.items():
        implied[name] = scaling.get(key, _ROPE_DEFAULTS[name])
    return implied


def checkpoint_args(config) -> dict:
    """The plain ``{dest: value}`` dict of a :class:`~megatron.config.Config` that checkpoints
    store as ``args`` (sorted by name)."""
    out = {}
    for section in _SECTIONS:
        part = getattr(config, section)
        for f in dataclasses.fields(part):
            if f.name not in _LEFT_OUT:
                out[f.name] = plain(getattr(part, f.name))
    out.update(implied_args(config))
    return dict(sorted(out.items()))

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

from megatron.usage_error import UsageError

# The --rope-scaling-* flags' defaults, recorded when the run does not scale RoPE.
_ROPE_DEFAULTS = {"rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0,
                  "rope_scaling_high_freq_factor": 4.0,
                  "rope_scaling_original_max_position_embeddings": 8192}
_ROPE_KEYS = {"rope_scaling_factor": "factor", "rope_scaling_low_freq_factor": "low_freq_factor",
              "rope_scaling_high_freq_factor": "high_freq_factor",
              "rope_scaling_original_max_position_embeddings": "original_max_position_embeddings"}
_SECTIONS = ("model", "parallel", "optimizer", "scheduler", "training", "data", "checkpoint",
             "logging", "moe")
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


def _precision(flags: dict) -> str | None:
    if "bf16" not in flags and "fp16" not in flags:
        return None
    return "bf16" if flags.get("bf16") else "fp16" if flags.get("fp16") else "fp32"


def check_resume_precision(saved_args: dict, run_flags: dict, load_dir: str, iteration) -> None:
    """Refuse to resume an optimizer state saved in another precision (fp32 / bf16 / fp16): its
    main parameters, moments and loss scaler belong to that precision's optimizer. Nothing is
    checked when either side does not record its precision.

    Raises:
        UsageError: naming both precisions and the fixes (``--finetune``, ``--no-load-optim``).
    """
    saved, run = _precision(saved_args), _precision(run_flags)
    if saved is None or run is None or saved == run:
        return
    flag = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "no --bf16 / --fp16"}
    raise UsageError(
        f"{'fp32' if run == 'fp32' else flag[run]}: the checkpoint at --load {load_dir} (iteration "
        f"{iteration}) was saved in {saved} with its optimizer state, which this {run} run cannot "
        "resume (the optimizer's main parameters, moments and loss scaling differ); pass "
        "--finetune (weights only; iteration, optimizer and schedule start afresh) or "
        "--no-load-optim (weights, iteration and schedule; a new optimizer state), or resume in "
        f"{saved} ({flag[saved]})")

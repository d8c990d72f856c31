"""Checkpoints written by other systems in Megatron's legacy layout (``--ckpt-format torch``):
NVIDIA Megatron-LM (Megatron-Core or legacy-model tensor names) and Alibaba Megatron-LLaMA.

They share our folder layout and tracker file but pickle Python objects in ``args`` (read here
without executing anything: :mod:`.safe_pickle`) and, for Megatron-LM, name tensors and order the
fused QKV differently (:mod:`.megatron_lm`, the one mapping the converter uses too).

- ``--load`` of a Megatron-LM checkpoint loads the weights directly at the layout it was saved
  with (:func:`state_for_load`); it is a weights-only load (training starts at iteration 0), as
  for a ``release`` checkpoint.
- ``--load`` of a Megatron-LLaMA checkpoint is refused with the ``tools/checkpoint/convert.py``
  command that converts it (its args lack values the model needs, and its output layer is
  replicated, not vocabulary-parallel).
"""

from __future__ import annotations

import argparse
import os
import types
from dataclasses import dataclass, field

import torch

from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
from megatron.checkpointing.foreign import megatron_lm
from megatron.core.dist_checkpointing.safe_pickle import flatten, load_raw, to_plain

MEGATRON_LM, MEGATRON_LLAMA = "Megatron-LM", "Megatron-LLaMA"
# args fields only Megatron-LLaMA's argument parser has
_MEGATRON_LLAMA_FIELDS = ("causal_lm", "overlapped_distributed_optimizer")


@dataclass
class Foreign:
    """One shard of another system's checkpoint: ``system``, Megatron-LM's ``naming`` ("core" or
    "legacy"), ``args`` (plain dict), the raw ``state`` (tensors memory-mapped) and ``path``."""
    system: str
    naming: str | None
    args: dict
    state: dict
    path: str
    notes: list = field(default_factory=list)


def identify(path: str) -> Foreign | None:
    """The shard ``path`` as another system's, or None when it holds only tensors and plain values
    (ours; a damaged file of ours is also None, so that our loader reports it).

    Raises:
        CheckpointError: it pickles a class that is not read as plain data (names file and class).
    """
    if not os.path.isfile(path):  # a pipe would block the open below: our reader names it
        return None
    try:
        if not torch.serialization.get_unsafe_globals_in_checkpoint(path):
            return None
    except Exception:  # not a zip, damaged: for our own reader to report
        return None
    state = load_raw(path)
    raw_args = state.get("args")
    args = to_plain(raw_args) if raw_args is not None else {}
    if not isinstance(args, dict):
        raise CheckpointError(f"{path}: its args are a {type(raw_args).__name__}, not a namespace")
    model = state.get(megatron_lm.model_keys(state)[0], {})
    keys = flatten(model) if isinstance(model, dict) else {}
    llama = (isinstance(raw_args, types.SimpleNamespace) or "lm_head.weight" in keys
             or any(f in args for f in _MEGATRON_LLAMA_FIELDS))
    if llama:
        return Foreign(MEGATRON_LLAMA, None, args, state, path)
    return Foreign(MEGATRON_LM, megatron_lm.naming(model), args, state, path)


def describe(foreign: Foreign) -> str:
    """``"a Megatron-LM checkpoint (Megatron-Core tensor names)"`` and the like."""
    if foreign.system == MEGATRON_LLAMA:
        what = "written by its training" if foreign.args.get("seq_length") else (
            "written by its conversion tool")
    else:
        what = {"core": "Megatron-Core tensor names", "legacy": "legacy-model tensor names"}.get(
            foreign.naming, "tensor names not recognised")
    return f"a {foreign.system} checkpoint ({what})"


def convert_command(load_dir: str, loader: str, tp: int, pp: int, extra: str = "") -> str:
    """The ``tools/checkpoint/convert.py`` command writing ``load_dir`` as ours at TP x PP."""
    out = load_dir.rstrip("/") + f"-ours-tp{tp}pp{pp}"
    return (f"python tools/checkpoint/convert.py --model-type GPT --loader {loader} --saver "
            f"megatron --load-dir {load_dir} --save-dir {out} --target-tensor-parallel-size {tp} "
            f"--target-pipeline-parallel-size {pp}{extra}, then train with --load {out} --finetune")


def megatron_lm_args(foreign: Foreign, overrides: dict | None = None) -> dict:
    """Our model arguments of a Megatron-LM shard (:func:`megatron_lm.our_args`), after checking
    its ``checkpoint_version``; flag overrides are noted in ``foreign.notes``."""
    version = foreign.state.get("checkpoint_version", 3.0)
    if float(version) < 2.0:
        raise CheckpointError(f"{foreign.path} has checkpoint_version {version} (its fused QKV is "
                              "in a pre-2.0 order); re-save it with a current Megatron-LM")
    return megatron_lm.our_args(foreign.args, foreign.path, overrides, foreign.notes)


def _refuse_megatron_llama(foreign: Foreign, run: dict, tp: int, pp: int):
    eps = foreign.args.get("layernorm_epsilon")
    extra = "" if eps is not None else f" --norm-epsilon {run.get('norm_epsilon')}"
    raise CheckpointError(
        f"--load {run['load']} is {describe(foreign)}, which is not loaded directly; convert it "
        f"first: {convert_command(run['load'], 'megatron-llama', tp, pp, extra)}")


def state_for_load(probe: str, path: str, run: dict, tp: int, pp: int, ep: int = 1) -> dict | None:
    """This rank's shard as :func:`megatron.checkpointing.load_checkpoint` reads ours, or None
    when the checkpoint is ours.

    Args:
        probe: a shard of the checkpoint that exists (this rank's, or the first one).
        path: this rank's shard at this run's layout (TP x PP x EP ranks).
        ep: this run's expert-parallel size (a MoE checkpoint loads at the EP it was saved at).
        run: the run's plain values under Megatron's names (``load``, ``finetune``,
            ``no_load_optim``, the model flags: :func:`megatron.config.checkpoint_args`).

    Returns:
        ``{"model"/"model0"...: our state dicts, "args": our-named args, "iteration": 0,
        "weights_only_load": True, "notes": [...]}``.

    Raises:
        CheckpointError: a Megatron-LLaMA checkpoint (with the command converting it); another
            layout or model than this run's; optimizer state present without ``--finetune`` or
            ``--no-load-optim``.
    """
    foreign = identify(probe)
    if foreign is None:
        return None
    if foreign.system == MEGATRON_LLAMA:
        _refuse_megatron_llama(foreign, run, tp, pp)
    overrides = {name: run.get(name)
                 for name in ("norm_epsilon", "rotary_base", "max_position_embeddings")}
    ours = megatron_lm_args(foreign, overrides)
    saved = (ours["tensor_model_parallel_size"], ours["pipeline_model_parallel_size"])
    saved_ep = ours.get("expert_model_parallel_size", 1)
    if saved_ep != ep:
        raise CheckpointError(
            f"--load {run['load']} is {describe(foreign)} saved at expert-parallel size "
            f"{saved_ep}, but this run has --expert-model-parallel-size {ep}: run at EP={saved_ep}, "
            "or re-cut it: " + convert_command(run["load"], "megatron", tp, pp))
    if saved != (tp, pp):
        raise CheckpointError(
            f"--load {run['load']} is {describe(foreign)} saved at TP={saved[0]}, PP={saved[1]}, "
            f"but this run has TP={tp}, PP={pp}: run at its layout, or re-cut it: "
            + convert_command(run["load"], "megatron", tp, pp))
    check_run_matches(ours, run, f"--load {run['load']} ({describe(foreign)})")
    if path != probe:
        foreign = identify(path) if os.path.isfile(path) else None
        if foreign is None:  # this rank's shard is missing: our loader says so, naming it
            return None
    if not run.get("finetune") and not run.get("no_load_optim") and (
            foreign.state.get("optimizer") is not None):
        raise CheckpointError(f"{path} holds Megatron-LM optimizer state, which is not read; pass "
                              "--finetune (or --no-load-optim) to load the weights only")
    state = {"args": ours, "iteration": 0, "weights_only_load": True,
             "notes": foreign.notes + [f"{describe(foreign)}: weights only, training starts at "
                                       "iteration 0"]}
    for key in megatron_lm.model_keys(foreign.state):
        state[key] = megatron_lm.to_our_state_dict(foreign.state[key], ours, tp)
    return state


# model arguments that must agree between the run and the checkpoint: (field, flag)
_MUST_MATCH = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
               ("ffn_hidden_size", "--ffn-hidden-size"),
               ("num_attention_heads", "--num-attention-heads"),
               ("num_query_groups", "--num-query-groups"), ("kv_channels", "--kv-channels"),
               ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
               ("num_experts", "--num-experts"), ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
               ("moe_router_topk", "--moe-router-topk"),
               ("moe_router_score_function", "--moe-router-score-function"),
               ("moe_router_pre_softmax", "--moe-router-pre-softmax"),
               ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"))


def check_run_matches(saved: dict, run, source: str) -> None:
    """Refuse a run whose model flags differ from the checkpoint's (tensor shapes alone cannot
    tell heads from channels).

    Args:
        saved: the checkpoint's model values, under our names.
        run: the run's values (a dict, or an argparse namespace before the configuration exists).

    Raises:
        CheckpointError: naming the flag, this run's value and the checkpoint's.
    """
    run = vars(run) if isinstance(run, argparse.Namespace) else dict(run)
    run = dict(run, num_query_groups=run.get("num_query_groups") if run.get(
        "group_query_attention") else run.get("num_attention_heads"))
    if run.get("kv_channels") is None and run.get("hidden_size") and run.get("num_attention_heads"):
        run["kv_channels"] = run["hidden_size"] // run["num_attention_heads"]
    if run.get("num_experts") and run.get("moe_ffn_hidden_size") is None:
        run["moe_ffn_hidden_size"] = run.get("ffn_hidden_size")
    for name, flag in _MUST_MATCH:
        if name not in saved and name != "num_experts":
            continue  # a dense checkpoint: its MoE fields are not recorded
        given = run.get(name)
        if name == "num_experts" and name in run and given != saved.get(name):
            raise CheckpointError(f"{source} has num_experts={saved.get(name)} but this run has "
                                  f"--num-experts {given}; pass the checkpoint's value")
        if name in run and given is not None and given != saved.get(name):
            raise CheckpointError(f"{source} has {name}={saved.get(name)} but this run has {flag} "
                                  f"{given}; pass the checkpoint's value")


def saved_args(foreign: Foreign) -> dict:
    """Our-named model arguments of another system's shard, for ``--use-checkpoint-args`` and
    inference (values the args lose are left out: the run's flags supply them).

    Raises:
        CheckpointError: a Megatron-LLaMA checkpoint (convert it), or a missing value.
    """
    if foreign.system == MEGATRON_LLAMA:
        raise CheckpointError(f"{foreign.path} is {describe(foreign)}; convert it with "
                              "tools/checkpoint/convert.py --loader megatron-llama first")
    ours = megatron_lm_args(foreign)
    # Megatron-LM's HF loader hard-codes seq_length 4096: the run's --seq-length decides.
    return {k: v for k, v in ours.items() if v is not None and k != "seq_length"}


def first_shard(folder: str) -> str | None:
    """The first ``mp_rank_*/model_optim_rng.pt`` of a checkpoint folder (any naming)."""
    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name, "model_optim_rng.pt")
        if name.startswith("mp_rank_") and os.path.isfile(path):
            return path
    return None

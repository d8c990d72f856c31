"""Loader ``--loader megatron`` (alias ``megatron-lm``): checkpoints in Megatron's legacy layout
(``--ckpt-format torch``) at any TP/PP: ours, and NVIDIA Megatron-LM's (Megatron-Core or
legacy-model tensor names, found from the first shard; :mod:`megatron.checkpointing.foreign`).

Reads the tracker (``release`` or an iteration), finds the layout from the ``mp_rank_*`` folders,
takes the model shape from the stored ``args`` and streams one pipeline stage at a time (its
tensor-parallel shards memory-mapped). The output layer comes from the *last* stage; with tied
embeddings the first stage's word embedding is the one streamed. Megatron-LM's shards are renamed
and their fused QKV reordered by the same mapping ``pretrain_llama.py --load`` uses; values their
args lose or may hold wrongly come from ``--norm-epsilon``, ``--rotary-base`` and
``--max-position-embeddings``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

import torch

from megatron.config import rope_scaling_from_args
from megatron.checkpointing import CheckpointError, find_checkpoint, get_checkpoint_dir
from megatron.checkpointing.foreign import (MEGATRON_LM, describe, identify, megatron_lm,
                                          megatron_lm_args)
from megatron.core.dist_checkpointing.safe_pickle import load_raw
from megatron.model.chunked_attention import ATTENTION_FIELDS
from tools.checkpoint import expert_shards, llama4_layout, moe_layout, optimizer_state
from tools.checkpoint.saver_megatron import MOE_ARGS
from tools.checkpoint.layout import DTYPES, load_torch_file, partitions_to_layer, unpad_vocab

_SHARD = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_dp_(\d{3}))?$")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("megatron loader")
    add_foreign_arguments(group)


def add_foreign_arguments(group) -> None:
    """The flags supplying what another system's checkpoint args lack (shared by the loaders)."""
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="vocabulary size without padding, when the checkpoint does not store it")
    group.add_argument("--norm-epsilon", type=float, default=None,
                       help="RMSNorm epsilon of a Megatron-LM / Megatron-LLaMA checkpoint (overrides "
                            "its args; required where they lack it)")
    group.add_argument("--rotary-base", type=float, default=None,
                       help="RoPE theta of a Megatron-LM checkpoint (overrides its args)")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="maximum positions of a Megatron-LM checkpoint (Megatron-LM's HF "
                            "loader records 4096)")


def foreign_overrides(args) -> dict:
    return {k: getattr(args, k, None) for k in ("norm_epsilon", "rotary_base",
                                                "max_position_embeddings", "true_vocab_size")}


def find_shards(load_dir: str):
    """``(folder, {(tp_rank, pp_rank): path}, tp, pp)`` of the checkpoint named by the tracker.

    Data-parallel copies (``_dp_DDD``, Megatron-LLaMA) are skipped: the lowest is used. Folders
    without ``model_optim_rng.pt`` (Megatron-LLaMA's distributed-optimizer ``optim.pt`` /
    ``distrib_optim.pt`` folders) are not shards.

    Raises:
        CheckpointError: no tracker, no shards, or an incomplete TP x PP grid.
    """
    found = find_checkpoint(load_dir)  # a tracker that is a pipe or a folder: named, not opened
    if found is None:
        raise CheckpointError(f"--load-dir {load_dir} has no latest_checkpointed_iteration.txt")
    folder = get_checkpoint_dir(load_dir, *found)
    shards = {}
    for path in sorted(glob.glob(os.path.join(folder, "mp_rank_*"))):
        m = _SHARD.match(os.path.basename(path))
        if not m:
            continue
        key = (int(m.group(1)), int(m.group(2) or 0))
        if os.path.isfile(os.path.join(path, "model_optim_rng.pt")):  # not optim.pt-only folders
            shards.setdefault(key, os.path.join(path, "model_optim_rng.pt"))
    if not shards:
        raise CheckpointError(f"{folder} holds no mp_rank_*/model_optim_rng.pt")
    tp = max(t for t, _ in shards) + 1
    pp = max(p for _, p in shards) + 1
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in shards]
    if missing:
        raise CheckpointError(f"{folder} is incomplete: no shard for (tensor rank, pipeline rank) "
                              f"{missing[:4]}")
    return folder, shards, tp, pp


def meta_from_args(saved: dict, padded_rows: int, true_vocab_size, expert_parallel: bool = False,
                   experts: str = "foreign") -> dict:
    """The converter's ``meta`` from a checkpoint's recorded ``saved`` args. ``experts`` says how
    its shards hold the routed experts: ``"legacy"`` (ours: split as the recorded expert-TP
    says, 1 or TP), ``"whole"`` (a torch_dist checkpoint read whole, at any recorded expert-TP)
    or ``"foreign"`` (another system's: expert-TP 1 only, refused otherwise).

    Raises:
        CheckpointError / ExpertError: MoE settings not converted (naming the setting)."""
    meta = {k: saved.get(k) for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "max_position_embeddings", "seq_length", "norm_epsilon", "rotary_base",
        "rope_scaling", "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
        "tokenizer_type", "tokenizer_model", "hf_token_ids", "qk_layernorm", "qk_layernorm_full_width",
        "add_qkv_bias", *MOE_ARGS, *ATTENTION_FIELDS)}
    if llama4_layout.is_llama4(saved):
        meta.update(llama4_layout.meta_from_args(saved, expert_parallel),
                    hf_architecture=llama4_layout.MODEL_TYPE)
    elif meta["num_experts"]:
        _check_moe_args(saved, expert_parallel, split_experts=experts != "foreign")
        meta["moe_ffn_hidden_size"] = meta["moe_ffn_hidden_size"] or meta["ffn_hidden_size"]
    if meta["num_experts"]:  # whole experts (1) or split over the tensor ranks (TP)
        meta["expert_tensor_parallel_size"] = (moe_layout.check_saved_expert_tp(saved)
                                               if experts == "legacy" else 1)
    meta["num_query_groups"] = meta["num_query_groups"] or meta["num_attention_heads"]
    if meta["rope_scaling"] is None and saved.get("use_rope_scaling"):  # a training checkpoint
        meta["rope_scaling"] = rope_scaling_from_args(argparse.Namespace(**saved))
    meta["kv_channels"] = meta["kv_channels"] or meta["hidden_size"] // meta["num_attention_heads"]
    meta["norm_epsilon"] = meta["norm_epsilon"] or 1e-5
    meta["rotary_base"] = meta["rotary_base"] or 10000.0
    meta["true_vocab_size"] = true_vocab_size or saved.get("true_vocab_size")
    meta["vocab_rows"] = padded_rows
    return meta


def _check_moe_args(saved: dict, expert_parallel: bool = False,
                    split_experts: bool = False) -> None:
    """Refuse MoE settings these converters do not carry (before anything is written); an
    expert-parallel size > 1 only where the caller joins the experts (``expert_parallel``: our
    own shards, :mod:`tools.checkpoint.expert_shards`), an expert-tensor-parallel size > 1 only
    where it joins split experts or reads whole ones (``split_experts``: ours).

    Raises:
        CheckpointError: naming the recorded setting.
    """
    freq = saved.get("moe_layer_freq", 1)
    if not (freq == 1 or (isinstance(freq, (list, tuple)) and all(f == 1 for f in freq))):
        raise CheckpointError(f"--moe-layer-freq {freq!r}: only checkpoints with every layer MoE "
                              "are converted")
    checked = (("moe_router_score_function", "softmax"),
               ("moe_router_topk_scaling_factor", None), ("moe_router_num_groups", None),
               ("moe_router_enable_expert_bias", False), ("moe_apply_probs_on_input", False),
               ("moe_expert_capacity_factor", None))
    if not split_experts:
        checked = (("expert_tensor_parallel_size", 1),) + checked
    if not expert_parallel:
        checked = (("expert_model_parallel_size", 1),) + checked
    for key, default in checked:
        value = saved.get(key, default)
        if value not in (default, None) and not (default is False and value is False):
            raise CheckpointError(f"--{key.replace('_', '-')} {value!r} in the checkpoint's args is "
                                  "not converted (the Mixtral / Qwen-MoE routers and experts at "
                                  "expert-parallel size 1 only)")


def load_checkpoint(args):
    """``(meta, stream)`` of the checkpoint under ``args.load_dir`` (see ``convert.py``)."""
    from megatron.checkpointing import torch_dist

    found = find_checkpoint(args.load_dir)
    if found is not None:
        folder = get_checkpoint_dir(args.load_dir, *found)
        if torch_dist.is_torch_dist_checkpoint(folder):
            return load_torch_dist(folder, args)
    ep, ep_args = expert_shards.saved_expert_parallel_size(args.load_dir)
    if ep > 1:  # our MoE shards at EP > 1: each (tensor, pipeline) rank's experts in EP folders
        folder, joined, tp, pp = expert_shards.find_expert_shards(
            args.load_dir, ep, int(ep_args.get("pipeline_model_parallel_size") or 1),
            int(ep_args.get("tensor_model_parallel_size") or 1),
            moe_layout.saved_expert_tp(ep_args))
        shards = {k: expert_shards.own_shard(v) for k, v in joined.items()}
    else:
        folder, shards, tp, pp = find_shards(args.load_dir)
    foreign = identify(shards[(0, 0)])
    if foreign is not None:
        return load_megatron_lm(foreign, shards, tp, pp, args)
    _refuse_overrides(args)
    first = load_torch_file(shards[(0, 0)])
    saved = moe_layout.shard_args(first)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{shards[(0, 0)]} stores no args dict; it is not a checkpoint of "
                              "ours, Megatron-LM's or Megatron-LLaMA's")
    # Megatron's keys with virtual pipeline stages: model0, model1, ... (one per chunk).
    chunks = sorted((k for k in first if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    chunks = chunks if "model" not in first and chunks else ["model"]
    embedding = first[chunks[0]]["word_embeddings.weight"]
    padded = embedding.shape[0] * tp
    meta = meta_from_args(saved, padded, getattr(args, "true_vocab_size", None), ep > 1,
                          experts="legacy")
    meta["params_dtype"] = {v: k for k, v in DTYPES.items()}[embedding.dtype]
    if getattr(args, "include_optimizer", False) and len(chunks) > 1:
        raise CheckpointError(f"{shards[(0, 0)]}: --include-optimizer is not supported for "
                              f"checkpoints with virtual pipeline stages ({', '.join(chunks)}); "
                              "convert the weights only")
    if getattr(args, "include_optimizer", False):
        optimizer_state.refuse_distributed(shards[(0, 0)])
        common = optimizer_state.unpack(first, shards[(0, 0)])[1]
        meta["optimizer"] = dict(common, **{k: first.get(k) for k in (
            "iteration", "consumed_train_samples", "consumed_valid_samples",
            "opt_param_scheduler")}, source_args=saved)
        del first
        groups = joined if ep > 1 else {key: [(path, True)] for key, path in shards.items()}
        return meta, stream_with_optimizer(groups, tp, pp, meta)
    # Virtual stage v * PP + p is chunk v of pipeline rank p: streamed in that order as PP x v
    # plain stages (a shard file is read once per chunk).
    if ep > 1:
        stages = [[lambda t=t, p=p, key=key: expert_shards.read_joined(joined[(t, p)], key)
                   for t in range(tp)] for key in chunks for p in range(pp)]
    else:
        stages = [[lambda t=t, p=p, key=key: load_torch_file(shards[(t, p)])[key]
                   for t in range(tp)] for key in chunks for p in range(pp)]
    return meta, stream_stages(stages, meta, names=OUR_NAMES)


def _refuse_overrides(args) -> None:
    if any(v is not None for k, v in foreign_overrides(args).items() if k != "true_vocab_size"):
        raise CheckpointError(f"{args.load_dir} is one of our checkpoints, which record their "
                              "norm epsilon, RoPE theta and positions: drop --norm-epsilon, "
                              "--rotary-base and --max-position-embeddings")


def load_torch_dist(folder: str, args):
    """``(meta, stream)`` of one of our ``--ckpt-format torch_dist`` checkpoints: its global
    tensors read whole in this process, streamed as one TP = PP = 1 stage (fused QKV and
    gate/up rebuilt from their global q/k/v and gate/up tensors)."""
    from megatron.checkpointing import torch_dist
    from megatron.checkpointing.foreign import megatron_lm_dist
    from megatron.model.sharded_state import single_process_state_dict

    foreign = megatron_lm_dist.is_megatron_lm(folder)
    if getattr(args, "include_optimizer", False):
        raise CheckpointError(
            f"{folder} is a torch_dist checkpoint of Megatron-LM: its optimizer state is not "
            "converted; convert its weights only (drop --include-optimizer)" if foreign else
            f"{folder} is a torch_dist checkpoint: pretrain_llama.py --load reads it, optimizer "
            "included, at any TP/PP/DP layout; convert its weights only (drop --include-optimizer)")
    if foreign:
        return load_megatron_lm_torch_dist(folder, args)
    _refuse_overrides(args)
    common = torch_dist.read_common(folder)
    state = single_process_state_dict(torch_dist.read_tensors(folder))
    embedding = state["word_embeddings.weight"]
    meta = meta_from_args(common["args"], embedding.shape[0],  # global experts: any EP it ran at
                          getattr(args, "true_vocab_size", None) or common.get("true_vocab_size"),
                          expert_parallel=True, experts="whole")
    meta["params_dtype"] = {v: k for k, v in DTYPES.items()}[embedding.dtype]
    return meta, stream_stages([[lambda: state]], meta, names=OUR_NAMES)


def load_megatron_lm_torch_dist(folder: str, args):
    """``(meta, stream)`` of a Megatron-LM ``torch_dist`` checkpoint
    (:mod:`megatron.checkpointing.foreign.megatron_lm_dist`): read whole in this process, our
    global tensors streamed as one TP = PP = 1 stage."""
    from megatron.checkpointing.foreign import megatron_lm_dist
    from megatron.model.sharded_state import single_process_state_dict

    notes = []
    ours, tensors = megatron_lm_dist.whole_model(folder, foreign_overrides(args), notes)
    for note in notes:
        print(f" {note}")
    state = single_process_state_dict(tensors)
    embedding = state["word_embeddings.weight"]
    meta = meta_from_args(ours, embedding.shape[0], ours["true_vocab_size"])
    meta["params_dtype"] = {v: k for k, v in DTYPES.items()}[embedding.dtype]
    return meta, stream_stages([[lambda: state]], meta, names=OUR_NAMES)


def load_megatron_lm(foreign, shards, tp: int, pp: int, args):
    """``(meta, stream)`` of a Megatron-LM checkpoint (``foreign``: its first shard), each shard
    mapped to our names and QKV order by :func:`megatron_lm.to_our_state_dict`; a MoE one saved
    at expert-parallel size > 1 (its ``mp_rank_TT[_PPP]_EEE`` folders, told from pipeline stages
    by its args) with each (tensor, pipeline) rank's expert shards joined."""
    if foreign.system != MEGATRON_LM:
        raise CheckpointError(f"{args.load_dir} is {describe(foreign)}: use --loader megatron-llama")
    if getattr(args, "include_optimizer", False):
        raise CheckpointError(f"{args.load_dir} is {describe(foreign)}: its optimizer state is not "
                              "converted; convert the weights only (drop --include-optimizer)")
    ours = megatron_lm_args(foreign, foreign_overrides(args))
    ep = ours.get("expert_model_parallel_size", 1)
    if ep > 1:
        _, groups, tp, pp = expert_shards.find_expert_shards(
            args.load_dir, ep, ours["pipeline_model_parallel_size"],
            ours["tensor_model_parallel_size"])
    else:
        groups = {key: [(path, True)] for key, path in shards.items()}
    if (ours["tensor_model_parallel_size"], ours["pipeline_model_parallel_size"]) != (tp, pp):
        raise CheckpointError(f"{args.load_dir}: args say TP={ours['tensor_model_parallel_size']}, "
                              f"PP={ours['pipeline_model_parallel_size']} but the folder holds "
                              f"TP={tp}, PP={pp} shards")
    for note in foreign.notes:
        print(f" {note}")
    chunks = megatron_lm.model_keys(foreign.state)
    embedding = megatron_lm.top_tensor(foreign.state[chunks[0]], "word_embeddings.weight")
    meta = meta_from_args(ours, embedding.shape[0] * tp, ours["true_vocab_size"], ep > 1)
    meta["params_dtype"] = {v: k for k, v in DTYPES.items()}[embedding.dtype]

    def rank_state(entries, key):
        states = [megatron_lm.to_our_state_dict(load_raw(path)[key], ours, tp)
                  for path, _ in entries]
        if len(states) == 1:
            return states[0]
        where = f"{os.path.dirname(os.path.dirname(expert_shards.own_shard(entries)))}: "
        return moe_layout.join_expert_shards(states, where, own=[own for _, own in entries])

    stages = [[lambda t=t, p=p, key=key: rank_state(groups[(t, p)], key) for t in range(tp)]
              for key in chunks for p in range(pp)]
    return meta, stream_stages(stages, meta, names=OUR_NAMES)


OUR_NAMES = {"embedding": "word_embeddings.weight", "layer": "layers.{}.", "final_norm":
             "final_layernorm.weight", "output": "output_layer.weight",
             "reward_head": "reward_head.weight"}


def stream_stages(stages, meta: dict, names: dict):
    """Stream logical tensors from ``stages[p][t]()`` (a callable returning the flat state dict of
    tensor rank t, pipeline stage p), one stage loaded at a time.

    ``names`` gives the keys: ``embedding``, ``layer`` (a prefix with ``{}`` for the local layer
    index), ``final_norm``, ``output`` (per-rank vocabulary partitions) or ``output_replicated``
    (the full output weight on every rank, Megatron-LLaMA's ``lm_head``).
    """
    for p, loaders in enumerate(stages):
        states = [load() for load in loaders]
        yield from stage_messages(states, p, len(stages), meta, names)
        del states


def stage_messages(states, p: int, pp: int, meta: dict, names: dict, rows: int | None = None):
    """The messages of pipeline stage ``p`` of ``pp`` from its per-tensor-rank flat state dicts
    (vocabulary cut to ``rows``, default the true vocabulary size)."""
    rows = rows or meta["true_vocab_size"] or meta["vocab_rows"]

    def vocab(parts):
        return unpad_vocab(torch.cat(parts, 0), rows)

    per_stage = meta["num_layers"] // pp
    if p == 0:
        yield "embeddings", {"word_embeddings": vocab([s[names["embedding"]] for s in states])}
    for i in range(per_stage):
        prefix = names["layer"].format(i)
        parts = [{k[len(prefix):]: v for k, v in s.items() if k.startswith(prefix)} for s in states]
        if not parts[0]:
            raise CheckpointError(f"pipeline stage {p} lacks layer {i} ({prefix}*)")
        layer = partitions_to_layer(parts, meta)
        if "router" in layer:
            layer["expert_checksums"] = moe_layout.expert_checksums(layer)
        yield "layer", layer
    if p == pp - 1:
        output = None
        if meta["untie_embeddings_and_output_weights"]:
            if "output_replicated" in names:
                output = unpad_vocab(states[0][names["output_replicated"]], rows)
            else:
                output = vocab([s[names["output"]] for s in states])
        final = {"final_norm": states[0][names["final_norm"]], "output_layer": output}
        if names.get("reward_head") in states[0]:  # a reward model's [1, h] scalar head
            final["reward_head"] = states[0][names["reward_head"]]
        yield "final", final


def read_with_optimizer(entries):
    """``(model state, {quantity: flat state})`` of one (tensor rank, pipeline rank) from its
    shards ``entries`` (:func:`tools.checkpoint.expert_shards.find_expert_shards`' form: one
    ``(path, own)`` per expert-parallel rank, or the one shard): the weights and each optimizer
    quantity joined over the expert ranks alike (the Adam moments of the experts go with them).

    Raises:
        ExpertError: a replicated tensor or its optimizer state differing between expert ranks.
    """
    states = []
    for path, _ in entries:
        ckpt = load_torch_file(path)
        states.append((ckpt["model"], optimizer_state.unpack(ckpt, path)[0]))
        del ckpt
    if len(states) == 1:
        return states[0]
    where = f"{os.path.dirname(os.path.dirname(expert_shards.own_shard(entries)))}: "
    own = [o for _, o in entries]
    model = moe_layout.join_expert_shards([m for m, _ in states], where, own)
    return model, {q: moe_layout.join_expert_shards([u[q] for _, u in states],
                                                    f"{where}optimizer {q}: ", own)
                   for q in optimizer_state.QUANTITIES}


def stream_with_optimizer(groups, tp: int, pp: int, meta: dict):
    """Like :func:`stream_stages` over our shards (``groups``: ``{(tensor rank, pipeline rank):
    entries}`` of :func:`read_with_optimizer`), each payload with an ``"optimizer"`` entry:
    ``{quantity: payload of the same message}`` (see :mod:`tools.checkpoint.optimizer_state`).
    Vocabulary rows stay padded: the padded rows are trained too (they are in the softmax)."""
    rows = meta["vocab_rows"]
    for p in range(pp):
        read = [read_with_optimizer(groups[(t, p)]) for t in range(tp)]
        model = stage_messages([m for m, _ in read], p, pp, meta, OUR_NAMES, rows)
        per_q = {q: stage_messages([u[q] for _, u in read], p, pp, meta, OUR_NAMES, rows)
                 for q in optimizer_state.QUANTITIES}
        for kind, payload in model:
            yield kind, dict(payload, optimizer={q: next(g)[1] for q, g in per_q.items()})
        del read

"""Saver ``--saver megatron``: a ``release/`` checkpoint in our (Megatron legacy) layout at the
target TP/PP, loadable by ``megatron.checkpointing.load_checkpoint`` (``--load DIR --finetune``).

At ``--target-expert-parallel-size`` EP > 1 each (tensor rank, stage) shard is written once per
expert-parallel rank e (``mp_rank_TT[_PPP]_EEE``, Megatron-LM's naming), holding experts
``e E/EP .. (e+1) E/EP - 1`` in ``mlp.experts.weight1/2`` and the same copy of everything else.
At ``--target-expert-tensor-parallel-size`` TP tensor rank t's shards hold slice t of those
experts (``weight1 [E/EP, 2f/TP, h]``, ``weight2 [E/EP, h, f/TP]``,
:func:`tools.checkpoint.moe_layout.split_experts`); at 1 (the default) whole experts.

Streaming: each layer's tensor-parallel pieces are spilled to a per-rank file as the layer
arrives; when a stage's last layer is in, the shards of that stage are written one (tensor rank,
pipeline stage) at a time from the memory-mapped spill files, so memory stays near the largest
output shard. The word embedding is kept only for a tied last stage with PP > 1. Files are written
under ``release.tmp/`` and the folder and the tracker are put in place only after every file
exists.

``--include-optimizer`` (from ``--loader megatron``): the Adam moments and fp32 main parameters
are re-split exactly like the weights (:mod:`tools.checkpoint.optimizer_state`; a model with
experts keeps its dense and expert optimizer parts, and the experts' state goes with them to
their expert rank at any ``--target-expert-parallel-size``) and the
checkpoint is written as ``iter_XXXXXXX`` of the source's iteration with its scheduler state and
consumed samples, so ``--load`` resumes training at the new layout. RNG states are not carried
(they are per tensor-parallel rank): resume with ``--no-load-rng``.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch

from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file
from megatron.checkpointing import (CHECKPOINT_VERSION, get_checkpoint_name,
                                    get_checkpoint_tracker_filename)
from megatron.tokenizer import vocab_size_with_padding
from megatron.model.chunked_attention import ATTENTION_FIELDS
from tools.checkpoint import model_flags, moe_layout, optimizer_state
from tools.checkpoint.layout import DTYPES, check_layout, layer_to_partitions, pad_vocab, split


def add_arguments(parser) -> None:
    group = parser.add_argument_group("megatron saver")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                       help="vocabulary padding multiple (per TP rank); default: the source's, else 128")
    group.add_argument("--target-ckpt-format", choices=["torch", "torch_dist"], default="torch",
                       help="torch: the legacy per-rank shards at the target layout (default); "
                            "torch_dist: the layout-free distributed format, resharded by --load")


def check_target(args) -> None:
    """Refuse a ``--save-dir`` that already holds a checkpoint (its tracker file, a ``release/``
    or an ``iter_*`` folder, stale or not), before anything is read or written: the converted
    checkpoint could not be put in place, or would mix with the old one.

    Raises:
        FileExistsError: naming the folder and what it holds.
    """
    save = args.save_dir
    if not os.path.isdir(save):
        if os.path.exists(save):
            raise FileExistsError(f"--save-dir {save} is a file, not a folder; choose an empty "
                                  "folder")
        return
    held = sorted(n for n in os.listdir(save)
                  if n == os.path.basename(get_checkpoint_tracker_filename(save)) or n == "release"
                  or (n.startswith("iter_") and not n.endswith(".tmp")))
    if held:
        raise FileExistsError(f"--save-dir {save} already holds a checkpoint ({', '.join(held)}); "
                              "choose an empty folder, or remove those first")


def checkpoint_args(meta: dict, tp: int, pp: int, padded: int, dtype: str, divisible_by: int,
                    ep: int = 1, expert_tp: int = 1) -> dict:
    """The ``args`` entry (plain values; the names ``--use-checkpoint-args`` takes over)."""
    return {
        "num_layers": meta["num_layers"], "hidden_size": meta["hidden_size"],
        "ffn_hidden_size": meta["ffn_hidden_size"], "num_attention_heads": meta["num_attention_heads"],
        "num_query_groups": meta["num_query_groups"],
        "group_query_attention": meta["num_query_groups"] != meta["num_attention_heads"],
        "kv_channels": meta["kv_channels"], "max_position_embeddings": meta["max_position_embeddings"],
        "seq_length": meta.get("seq_length") or meta["max_position_embeddings"],
        "position_embedding_type": "rope", "use_rotary_position_embeddings": True,
        "add_position_embedding": False, "rotary_base": meta["rotary_base"],
        "rope_scaling": meta.get("rope_scaling"), "add_bias_linear": False, "swiglu": True,
        "untie_embeddings_and_output_weights": meta["untie_embeddings_and_output_weights"],
        "normalization": "RMSNorm", "norm_epsilon": meta["norm_epsilon"],
        "make_vocab_size_divisible_by": divisible_by, "padded_vocab_size": padded,
        "true_vocab_size": meta["true_vocab_size"],
        "tokenizer_type": meta.get("tokenizer_type") or ("PretrainedFromHF" if meta.get("tokenizer_dir") else None),
        "tokenizer_model": meta.get("tokenizer_model") or meta.get("tokenizer_dir"),
        "tokenizer_name_or_path": meta.get("tokenizer_dir"),
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "bf16": dtype == "bf16", "fp16": dtype == "fp16", "params_dtype": dtype,
        "hf_token_ids": meta.get("hf_token_ids"), **rope_scaling_flags(meta.get("rope_scaling")),
        "qk_layernorm": bool(meta.get("qk_layernorm")),
        "qk_layernorm_full_width": bool(meta.get("qk_layernorm_full_width")),
        "add_qkv_bias": bool(meta.get("add_qkv_bias")), **moe_args(meta, ep, expert_tp),
        **{k: (list(meta[k]) if isinstance(meta[k], tuple) else meta[k])
           for k in ATTENTION_FIELDS if meta.get(k) is not None},
    }


MOE_ARGS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
            "moe_aux_loss_coeff", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
            "hf_architecture", "moe_router_score_function", "moe_apply_probs_on_input")


def moe_args(meta: dict, ep: int = 1, expert_tp: int = 1) -> dict:
    """The MoE entries of the recorded args (Megatron-Core's dests; none for a dense model):
    the shards' expert-parallel size ``ep`` and expert-tensor-parallel size ``expert_tp``."""
    if not meta.get("num_experts"):
        return {}
    out = {k: meta.get(k) for k in MOE_ARGS}
    out.update(moe_layer_freq=list(meta["moe_layer_freq"]) if meta.get("moe_layer_freq") else 1,
               expert_model_parallel_size=ep, expert_tensor_parallel_size=expert_tp)
    out["moe_router_score_function"] = out["moe_router_score_function"] or "softmax"
    out["moe_apply_probs_on_input"] = bool(out["moe_apply_probs_on_input"])
    return out


def rope_scaling_flags(scaling) -> dict:
    """Megatron-LM's ``--use-rope-scaling`` / ``--rope-scaling-*`` values of a Llama-3.1
    ``rope_scaling`` dict, so ``--use-checkpoint-args`` rebuilds the scaled model."""
    if scaling is None:
        return {"use_rope_scaling": False}
    return {"use_rope_scaling": True, "rope_scaling_factor": scaling["factor"],
            "rope_scaling_low_freq_factor": scaling["low_freq_factor"],
            "rope_scaling_high_freq_factor": scaling["high_freq_factor"],
            "rope_scaling_original_max_position_embeddings":
                scaling["original_max_position_embeddings"]}


def save_checkpoint(meta: dict, stream, args) -> str:
    """Consume the loader's stream; write ``args.save_dir/release`` (with ``--include-optimizer``:
    ``iter_XXXXXXX`` of the source's iteration, with optimizer, scheduler and sample counts;
    with ``--target-ckpt-format torch_dist``: a layout-free ``release``,
    :mod:`tools.checkpoint.torch_dist_writer`), then print the ``pretrain_llama.py`` flags it
    needs (:mod:`tools.checkpoint.model_flags`). Returns that folder.

    Raises:
        ValueError: the target layout does not divide the model, or (with the optimizer) changes
            the padded vocabulary, or a target layout or the optimizer with torch_dist (before
            anything is written).
        FileExistsError: ``--save-dir`` already holds a checkpoint (:func:`check_target`).
    """
    if getattr(args, "target_ckpt_format", "torch") == "torch_dist":
        return _save_torch_dist(meta, stream, args)
    final, ckpt_args = _save_legacy(meta, stream, args)
    print(model_flags.describe(ckpt_args, args.save_dir, final), flush=True)
    return final


def _save_torch_dist(meta: dict, stream, args) -> str:
    given = [f"--target-{kind.replace('_', '-')}-parallel-size"
             for kind in ("tensor", "pipeline", "expert", "expert_tensor")
             if (getattr(args, f"target_{kind}_parallel_size", None) or 1) != 1]
    if given:
        raise ValueError(f"--target-ckpt-format torch_dist is layout-free (--load reshards it to "
                         f"any TP / PP / EP): drop {', '.join(given)}")
    if getattr(args, "include_optimizer", False):
        raise ValueError("--target-ckpt-format torch_dist writes the weights only: drop "
                         "--include-optimizer (or write --target-ckpt-format torch)")
    check_target(args)
    from tools.checkpoint import torch_dist_writer

    scratch = os.path.join(args.save_dir, ".legacy.tmp")  # the TP = PP = 1 shard, then removed
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        legacy, ckpt_args = _save_legacy(meta, stream, argparse.Namespace(
            **dict(vars(args), save_dir=scratch, target_ckpt_format="torch")))
        final = torch_dist_writer.write_release(
            os.path.join(legacy, "mp_rank_00", "model_optim_rng.pt"), args.save_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(model_flags.describe(ckpt_args, args.save_dir, final), flush=True)
    return final


def _save_legacy(meta: dict, stream, args):
    """:func:`save_checkpoint` in the legacy format: ``(folder, its recorded args)``."""
    tp = args.target_tensor_parallel_size or 1
    pp = args.target_pipeline_parallel_size or 1
    ep = getattr(args, "target_expert_parallel_size", None) or 1
    expert_tp = getattr(args, "target_expert_tensor_parallel_size", None) or 1
    check_layout(meta, tp, pp, ep, expert_tp)
    dtype_name = args.target_params_dtype or meta.get("params_dtype", "fp32")
    dtype = DTYPES[dtype_name]
    divisible_by = (args.make_vocab_size_divisible_by or meta.get("make_vocab_size_divisible_by")
                    or 128)
    vocab_rows = meta["true_vocab_size"] or meta["vocab_rows"]
    padded = vocab_size_with_padding(vocab_rows, divisible_by, tp)
    optim = meta.get("optimizer") if getattr(args, "include_optimizer", False) else None
    if optim is not None and padded != meta["vocab_rows"]:
        raise ValueError(f"--include-optimizer: the padded vocabulary would change from "
                         f"{meta['vocab_rows']} to {padded} rows at tensor-parallel size {tp} "
                         "(the padded rows are trained, so the model would change); pass "
                         "--make-vocab-size-divisible-by so that both layouts pad to the same size")
    save = args.save_dir
    check_target(args)
    name = "release" if optim is None else f"iter_{int(optim['iteration']):07d}"
    staging = os.path.join(save, name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    ckpt_args = checkpoint_args(meta, tp, pp, padded, dtype_name, divisible_by, ep, expert_tp)
    extra = {"iteration": 0, "optimizer": None, "opt_param_scheduler": None, "rng_state": None}
    if optim is not None:
        ckpt_args = dict(optim["source_args"], **ckpt_args)
        extra = {k: optim[k] for k in ("iteration", "consumed_train_samples",
                                       "consumed_valid_samples", "opt_param_scheduler")}
    writer = _StageWriter(staging, tp, pp, ckpt_args, extra, optim,
                          mixed=dtype_name != "fp32", ep=ep)
    try:
        final = _write(meta, stream, args, optim, writer, tp, pp, dtype, padded, save, name,
                       staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # no half-written release.tmp left behind
        raise
    return final, ckpt_args


def _write(meta, stream, args, optim, writer, tp, pp, dtype, padded, save, name, staging) -> str:
    per_stage = meta["num_layers"] // pp
    expert_tp = writer.ckpt_args.get("expert_tensor_parallel_size") or 1

    def cast(t):
        return t.detach().to(dtype).contiguous()

    def fp32(t):
        return t.detach().float().contiguous()

    def vocab_parts(weight, convert=cast):
        return split(pad_vocab(convert(weight), padded), tp, 0)

    def place(payload, kind, to_rank):
        """Partition one message (weights, then each optimizer quantity) and hand each rank's
        pieces to ``to_rank(rank, quantity or None, {name: tensor})``."""
        weights = payload["optimizer"]["main"] if optim and dtype == torch.float32 else payload
        sources = [(None, weights, cast)] + [(q, payload["optimizer"][q], fp32)
                                            for q in (optimizer_state.QUANTITIES if optim else ())]
        for q, part, convert in sources:
            if kind == "embeddings":
                for r, piece in enumerate(vocab_parts(part["word_embeddings"], convert)):
                    to_rank(r, q, {"word_embeddings.weight": piece})
            elif kind == "layer":
                tensors = {k: convert(v) for k, v in part.items() if isinstance(v, torch.Tensor)}
                for r, piece in enumerate(layer_to_partitions(tensors, tp, expert_tp)):
                    to_rank(r, q, {f"layers.{writer.local}.{k}": v for k, v in piece.items()})
            else:  # final
                for r in range(tp):
                    to_rank(r, q, {"final_layernorm.weight": convert(part["final_norm"])})
                if meta["untie_embeddings_and_output_weights"]:
                    for r, piece in enumerate(vocab_parts(part["output_layer"], convert)):
                        to_rank(r, q, {"output_layer.weight": piece})
                elif pp > 1:
                    for r, piece in enumerate(vocab_parts(embedding[q], convert)):
                        to_rank(r, q, {"word_embeddings_for_head.weight": piece})

    embedding = {}
    experts = moe_layout.ExpertGate(meta, "megatron saver") if moe_layout.is_moe(meta) else None
    layers = 0
    for kind, payload in stream:
        if kind not in ("embeddings", "layer", "final"):
            raise ValueError(f"unknown message {kind!r} from the loader")
        if kind == "layer":
            if experts is not None and "router" in payload:  # before the cast: the checksums are of the source's bytes
                experts.layer(layers, payload, payload.get("expert_checksums"))
            layers += 1
        if kind == "embeddings" and not meta["untie_embeddings_and_output_weights"] and pp > 1:
            # tied: the last stage holds a copy (the same values, and the same Adam state, since
            # Megatron all-reduces the two copies' gradients)
            embedding = {None: payload["word_embeddings"]}
            embedding.update({q: payload["optimizer"][q]["word_embeddings"] for q in
                              (optimizer_state.QUANTITIES if optim else ())})
        place(payload, kind, writer.add)
        if kind == "layer":
            writer.local += 1
            if writer.local == per_stage and writer.stage < pp - 1:
                writer.finish_stage()
        elif kind == "final":
            writer.finish_stage()
        del payload  # else it lives on while the loader builds the next message
    if experts is not None:
        experts.finish()
    final = os.path.join(save, name)
    os.replace(staging, final)
    tracker = get_checkpoint_tracker_filename(save)
    with open(tracker + ".tmp", "w", encoding="utf-8") as f:
        f.write(name if optim is None else str(int(optim["iteration"])))
    os.replace(tracker + ".tmp", tracker)
    return final


class _StageWriter:
    """Writes one (tensor rank, pipeline stage) shard at a time.

    Pieces of the current stage are spilled per tensor rank to ``.spill`` files as they come (one
    layer in memory); at the end of a stage each rank's pieces are read back memory-mapped and its
    shard written, so the peak is about one output shard, not a whole stage of TP shards.
    """

    def __init__(self, staging, tp, pp, ckpt_args, extra, optim, mixed, ep=1):
        self.staging, self.tp, self.pp, self.ep = staging, tp, pp, ep
        self.ckpt_args, self.extra, self.optim, self.mixed = ckpt_args, extra, optim, mixed
        self.stage, self.local, self.spills = 0, 0, [[] for _ in range(tp)]
        self.pending = [dict() for _ in range(tp)]
        os.makedirs(staging, exist_ok=True)

    def add(self, rank: int, quantity, tensors: dict) -> None:
        prefix = "" if quantity is None else f"optimizer/{quantity}/"
        self.pending[rank].update({prefix + k: v for k, v in tensors.items()})
        if quantity == (optimizer_state.QUANTITIES[-1] if self.optim else None):
            self._spill(rank)  # the last piece of this message for this rank

    def _spill(self, rank: int) -> None:
        path = os.path.join(self.staging, f".spill_{rank}_{len(self.spills[rank])}.pt")
        torch.save(self.pending[rank], path)
        self.spills[rank].append(path)
        self.pending[rank] = {}

    def finish_stage(self) -> None:
        for r in range(self.tp):
            flat = {}
            for path in self.spills[r]:
                flat.update(load_torch_file(path, what="spill file", mmap=True, verify=False))
            model = {k: v for k, v in flat.items() if not k.startswith("optimizer/")}
            state = dict(self.extra, model=model, args=self.ckpt_args,
                         checkpoint_version=CHECKPOINT_VERSION)
            quantities = {q: {k[len(f"optimizer/{q}/"):]: v for k, v in flat.items()
                              if k.startswith(f"optimizer/{q}/")}
                          for q in (optimizer_state.QUANTITIES if self.optim else ())}
            for e in range(self.ep):
                name = get_checkpoint_name(self.staging, 0, release=False,
                                           pipeline_parallel=self.pp > 1, tensor_rank=r,
                                           pipeline_rank=self.stage,
                                           expert_parallel=self.ep > 1, expert_rank=e)
                # get_checkpoint_name adds iter_0000000/; the staging folder stands for the
                # final one.
                name = name.replace(os.path.join(self.staging, "iter_0000000"), self.staging, 1)
                os.makedirs(os.path.dirname(name), exist_ok=True)
                local = state if self.ep == 1 else dict(
                    state, model=moe_layout.local_experts(model, e, self.ep))
                if self.optim is not None:  # the experts' Adam state goes with them
                    local["optimizer"] = optimizer_state.pack(
                        local["model"], {q: moe_layout.local_experts(v, e, self.ep)
                                         for q, v in quantities.items()}, self.optim, self.mixed)
                torch.save(local, name)
                del local
            del flat, model, state, quantities
            for path in self.spills[r]:
                os.remove(path)
            self.spills[r] = []
        self.stage, self.local = self.stage + 1, 0

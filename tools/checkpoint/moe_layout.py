"""Mixture-of-experts weights in the converters: logical names, the Hub's two expert layouts,
our ``mlp.experts.weight1/2`` layout, and the expert gate (every expert of every layer read and
written exactly once, checksummed on both sides).

Logical MoE layer tensors (beside the attention and norm keys of
:data:`tools.checkpoint.layout.LAYER_KEYS`, replacing ``gate``/``up``/``down``):

- ``router`` ``[E, h]`` (HF ``block_sparse_moe.gate.weight`` / ``mlp.gate.weight``;
  ours ``mlp.router.weight``);
- ``experts_gate``, ``experts_up`` ``[E, f, h]`` and ``experts_down`` ``[E, h, f]`` (HF per
  expert ``experts.{e}.w1 / w3 / w2.weight``; transformers 5's fused ``experts.gate_up_proj
  [E, 2f, h]`` = ``[gate; up]`` per expert and ``experts.down_proj [E, h, f]``; ours
  ``mlp.experts.weight1 [E, 2f, h]`` = ``[gate; up]`` and ``mlp.experts.weight2 [E, h, f]``).

At expert-TP 1 (Megatron-Core's ``--expert-tensor-parallel-size 1``) every tensor rank's shard
holds the whole ``weight1`` / ``weight2`` of its layers, and the loader refuses shards whose
copies differ. At expert-TP = TP tensor rank r holds slice r of every expert, as the training
code splits them (Megatron-Core's column split of ``linear_fc1``, row split of ``linear_fc2``):
``weight1 [E, 2f/TP, h]`` = ``[gate rows r; up rows r]``, ``weight2 [E, h, f/TP]`` = columns r
(:func:`split_experts`, :func:`join_split_experts`). The shared expert is whole on every rank
either way.
"""

from __future__ import annotations

import hashlib
import re
from typing import Dict, List

import torch

MOE_KEYS = ("router", "experts_gate", "experts_up", "experts_down")
# Hub per-expert names per architecture: the block's prefix and the parts (Mixtral's w1 = gate,
# w3 = up, w2 = down; Qwen3-MoE's gate_proj / up_proj / down_proj)
HF_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", {"w1": "experts_gate", "w3": "experts_up", "w2": "experts_down"}),
    "qwen3_moe": ("mlp", {"gate_proj": "experts_gate", "up_proj": "experts_up",
                          "down_proj": "experts_down"}),
}
HF_EXPERT_NAMES["qwen2_moe"] = HF_EXPERT_NAMES["olmoe"] = HF_EXPERT_NAMES["qwen3_moe"]
# Qwen2-MoE's shared expert and its sigmoid gate: logical key -> HF name under the layer
HF_SHARED = {"shared_gate": "mlp.shared_expert.gate_proj.weight",
             "shared_up": "mlp.shared_expert.up_proj.weight",
             "shared_down": "mlp.shared_expert.down_proj.weight",
             "shared_expert_gate": "mlp.shared_expert_gate.weight"}
HF_EXPERT_PARTS = HF_EXPERT_NAMES["mixtral"][1]
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_HF_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class ExpertError(ValueError):
    """A missing, duplicated, misshapen or altered expert (names the layer and the expert)."""


def checksum(t: torch.Tensor) -> str:
    """blake2b (16 bytes, hex) of the tensor's bytes in its own dtype."""
    data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def expert_checksums(layer: Dict[str, torch.Tensor]) -> List[str]:
    """One checksum per expert e over its ``gate[e]``, ``up[e]``, ``down[e]``."""
    return [checksum(torch.cat([layer["experts_gate"][e].reshape(-1), layer["experts_up"][e].reshape(-1),
                                layer["experts_down"][e].reshape(-1)]))
            for e in range(layer["experts_gate"].shape[0])]


def is_moe(meta: dict) -> bool:
    return bool(meta.get("num_experts"))


def moe_layer_indices(meta: dict) -> List[int]:
    """0-based indices of the MoE layers: ``meta["moe_layer_freq"]``'s 1s (Llama 4 interleaves
    dense layers), or every layer."""
    freq = meta.get("moe_layer_freq")
    if isinstance(freq, (list, tuple)):
        return [i for i, v in enumerate(freq) if v]
    return list(range(meta["num_layers"]))


def hf_expert_index(names) -> Dict[int, dict]:
    """``{layer: {"per_expert": {e: {part: [names]}}, "fused": {kind: [names]}}}`` of the expert
    tensors among ``names`` (both of the Hub's layouts)."""
    index: Dict[int, dict] = {}
    for name in names:
        m = _HF_EXPERT.match(name)
        if m:
            entry = index.setdefault(int(m.group(1)), {"per_expert": {}, "fused": {}})
            entry["per_expert"].setdefault(int(m.group(2)), {}).setdefault(m.group(3), []).append(name)
            continue
        m = _HF_FUSED.match(name)
        if m:
            entry = index.setdefault(int(m.group(1)), {"per_expert": {}, "fused": {}})
            entry["fused"].setdefault(m.group(2), []).append(name)
    return index


def read_hf_experts(index: Dict[int, dict], layer: int, meta: dict, get) -> Dict[str, torch.Tensor]:
    """The logical ``experts_*`` tensors of ``layer`` read through ``get(name)``, from either
    layout, each expert exactly once.

    Raises:
        ExpertError: an expert missing or present twice (in both layouts, or one part twice),
            an expert index >= E, or a tensor of the wrong shape; the message names layer and
            expert.
    """
    E, f, h = meta["num_experts"], meta["moe_ffn_hidden_size"], meta["hidden_size"]
    block, part_names = HF_EXPERT_NAMES[meta.get("hf_architecture") or "mixtral"]
    entry = index.get(layer, {"per_expert": {}, "fused": {}})
    per, fused = entry["per_expert"], entry["fused"]
    where = f"layer {layer}"
    if per and fused:
        raise ExpertError(f"{where}: experts stored twice, per expert ({block}.experts.*) "
                          f"and fused (mlp.experts.{'/'.join(sorted(fused))}); expert 0 would be "
                          "read twice: keep one layout")
    if fused:
        for kind in ("gate_up_proj", "down_proj"):
            if kind not in fused:
                raise ExpertError(f"{where}: fused experts lack mlp.experts.{kind} (all {E} experts' "
                                  f"{'gate/up' if kind == 'gate_up_proj' else 'down'} weights missing)")
        gate_up = get(fused["gate_up_proj"][0])
        down = get(fused["down_proj"][0])
        if tuple(gate_up.shape) != (E, 2 * f, h) or tuple(down.shape) != (E, h, f):
            raise ExpertError(f"{where}: fused experts have shapes {tuple(gate_up.shape)} / "
                              f"{tuple(down.shape)}, expected ({E}, {2 * f}, {h}) / ({E}, {h}, {f}) "
                              f"for {E} experts (a missing or extra expert)")
        return {"experts_gate": gate_up[:, :f], "experts_up": gate_up[:, f:], "experts_down": down}
    extra = sorted(e for e in per if e >= E)
    if extra:
        raise ExpertError(f"{where}: expert {extra[0]} present but config.json says "
                          f"{E} experts (indices 0..{E - 1})")
    parts = {k: [] for k in HF_EXPERT_PARTS.values()}
    for e in range(E):
        for part, key in part_names.items():
            names = per.get(e, {}).get(part, [])
            if not names:
                raise ExpertError(f"{where}, expert {e}: {block}.experts.{e}.{part}.weight "
                                  "is missing")
            if len(names) > 1:
                raise ExpertError(f"{where}, expert {e}: {part} stored {len(names)} times")
            t = get(names[0])
            want = (h, f) if key == "experts_down" else (f, h)
            if tuple(t.shape) != want:
                raise ExpertError(f"{where}, expert {e}: {names[0]} has shape {tuple(t.shape)}, "
                                  f"expected {want}")
            parts[key].append(t)
    return {k: torch.stack(v) for k, v in parts.items()}


class ExpertGate:
    """Counts what one side (loader or saver) handles: each ``(layer, expert)`` once, parameter
    counts and checksums equal to those the loader recorded (``expert_checksums`` in the layer
    payload). ``finish()`` checks every expert of every layer was seen.

    Raises:
        ExpertError: from :meth:`layer` (duplicate layer, wrong count or shape, checksum
            mismatch) and :meth:`finish` (a layer never seen), naming layer and expert.
    """

    def __init__(self, meta: dict, side: str):
        self.meta, self.side = meta, side
        self.seen: Dict[int, List[str]] = {}
        self.params = 0

    def layer(self, index: int, tensors: Dict[str, torch.Tensor], expected=None) -> List[str]:
        E, f, h = self.meta["num_experts"], self.meta["moe_ffn_hidden_size"], self.meta["hidden_size"]
        if index in self.seen:
            raise ExpertError(f"{self.side}: the experts of layer {index} were handled twice")
        for key, shape in (("experts_gate", (E, f, h)), ("experts_up", (E, f, h)),
                           ("experts_down", (E, h, f)), ("router", (E, h))):
            t = tensors.get(key)
            if t is None or tuple(t.shape) != shape:
                got = "missing" if t is None else f"shape {tuple(t.shape)}"
                raise ExpertError(f"{self.side}: layer {index} {key} is {got}, expected {shape} "
                                  f"({E} experts)")
        sums = expert_checksums(tensors)
        if expected is not None:
            for e, (a, b) in enumerate(zip(sums, expected)):
                if a != b:
                    raise ExpertError(f"{self.side}: layer {index}, expert {e}: its weights changed "
                                      "between reading and writing (checksum mismatch)")
        self.seen[index] = sums
        self.params += E * 3 * f * h
        return sums

    def finish(self) -> int:
        """The number of expert parameters handled; raises when a layer's experts are missing."""
        layers = moe_layer_indices(self.meta)
        n = len(layers)
        missing = [i for i in layers if i not in self.seen]
        if missing:
            raise ExpertError(f"{self.side}: the experts of layer {missing[0]} were never handled "
                              f"({len(missing)} of {n} layers missing)")
        E, f, h = self.meta["num_experts"], self.meta["moe_ffn_hidden_size"], self.meta["hidden_size"]
        if self.params != n * E * 3 * f * h:
            raise ExpertError(f"{self.side}: {self.params} expert parameters handled, expected "
                              f"{n * E * 3 * f * h}")
        return self.params


def to_ours(layer: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Our MoE MLP tensors (keys relative to the layer) from the logical ones."""
    out = {"mlp.router.weight": layer["router"],
           "mlp.experts.weight1": torch.cat([layer["experts_gate"], layer["experts_up"]], 1),
           "mlp.experts.weight2": layer["experts_down"]}
    if "shared_gate" in layer:  # the shared expert: linear_fc1 = [gate; up], the gate [1, h]
        out.update({"mlp.shared_experts.linear_fc1": torch.cat([layer["shared_gate"],
                                                                 layer["shared_up"]], 0),
                    "mlp.shared_experts.linear_fc2": layer["shared_down"]})
        if "shared_expert_gate" in layer:  # Qwen2-MoE's; Llama 4's shared expert has none
            out["mlp.shared_experts.gate_weight"] = layer["shared_expert_gate"]
    return out


def saved_expert_tp(saved: dict) -> int:
    """The expert-tensor-parallel size a checkpoint's recorded ``saved`` args say its shards
    hold (None or absent: TP, Megatron-Core's default, as the training code reads it)."""
    value = saved.get("expert_tensor_parallel_size")
    return int(value if value is not None else saved.get("tensor_model_parallel_size") or 1)


def shard_args(state: dict) -> dict:
    """The recorded ``args`` of a legacy shard, as the converter reads its experts: a file whose
    ``expert_tensor_slice`` record says it holds whole experts (the training code gathers them
    at an expert-TP > 1 other than TP, megatron/checkpointing/legacy_experts.py) reads as
    expert-TP 1, whatever expert-TP its run trained at."""
    saved = state.get("args")
    if isinstance(saved, dict) and saved.get("num_experts") and \
            [int(x) for x in state.get("expert_tensor_slice") or ()] == [0, 1]:
        saved = {**saved, "expert_tensor_parallel_size": 1}
    return saved


def check_saved_expert_tp(saved: dict, where: str = "") -> int:
    """:func:`saved_expert_tp`, refused unless 1 or the tensor-parallel size (the splits the
    training code writes in the legacy format).

    Raises:
        ExpertError: naming the recorded size."""
    etp, tp = saved_expert_tp(saved), int(saved.get("tensor_model_parallel_size") or 1)
    if etp not in (1, tp):
        raise ExpertError(f"{where}--expert-tensor-parallel-size {etp} in the checkpoint's args "
                          f"at --tensor-model-parallel-size {tp}: only expert-TP 1 or TP are read")
    return etp


def split_experts(moe: Dict[str, torch.Tensor], expert_tp: int) -> List[Dict[str, torch.Tensor]]:
    """The ``mlp.experts.weight1/2`` of each expert-tensor-parallel rank 0..expert_tp-1 from
    :func:`to_ours`' whole ones: rank r's ``weight1 [E, 2f/etp, h]`` = ``[gate_r; up_r]`` and
    ``weight2 [E, h, f/etp]`` = ``down[..., f_r]`` (``f_r``: the r-th of etp equal slices of the
    width; the training code's split, megatron/checkpointing/expert_slices.py); copies, so each
    shard saves alone."""
    from megatron.checkpointing.expert_slices import cut

    return [{k: cut(k, moe[k], r, expert_tp) if expert_tp > 1 else moe[k].clone()
             for k in ("mlp.experts.weight1", "mlp.experts.weight2")} for r in range(expert_tp)]


def join_split_experts(parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`split_experts`: the whole ``weight1 [E, 2f, h]`` and ``weight2
    [E, h, f]`` from the shards of expert-tensor-parallel ranks 0..etp-1 (``parts``: their state
    dicts of one layer, keys relative to it)."""
    from megatron.checkpointing.expert_slices import merge

    return {k: merge(k, [p[k] for p in parts]) for k in ("mlp.experts.weight1", "mlp.experts.weight2")}


EXPERT_SUFFIXES = ("mlp.experts.weight1", "mlp.experts.weight2")


def is_expert_key(name: str) -> bool:
    """Whether ``name`` (a shard key) holds the experts, cut over expert-parallel ranks."""
    return name.endswith(EXPERT_SUFFIXES)


def local_experts(model: Dict[str, torch.Tensor], rank: int, ep: int) -> Dict[str, torch.Tensor]:
    """The shard of expert-parallel rank ``rank`` of ``ep`` from a whole-expert shard: rows
    ``rank E/ep .. (rank+1) E/ep - 1`` of every ``weight1 [E, 2f, h]`` / ``weight2 [E, h, f]``
    (cloned: a saved view would drag all experts along), the rest as is."""
    out = {}
    for k, v in model.items():
        if is_expert_key(k):
            local = v.shape[0] // ep
            v = v[rank * local:(rank + 1) * local].clone()
        out[k] = v
    return out


def join_expert_shards(shards: List[Dict[str, torch.Tensor]], where: str = "",
                       own: List[bool] | None = None) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`local_experts`: one whole-expert state from the shards of
    expert-parallel ranks 0..EP-1 (experts concatenated in rank order). ``own[e]`` False: shard
    e is another tensor rank's (only its experts are taken); the other tensors come from the
    first own shard and must be the same in every own shard.

    Raises:
        ExpertError: the shards hold different keys, or a replicated tensor differs between
            expert-parallel ranks (names the tensor and the ranks).
    """
    own = [True] * len(shards) if own is None else own
    base = own.index(True)
    first = shards[base]
    for e, shard in enumerate(shards):
        if set(shard) != set(first):
            odd = sorted(set(shard) ^ set(first))[0]
            raise ExpertError(f"{where}expert-parallel ranks {base} and {e} hold different "
                              f"tensors ({odd})")
        for k, v in shard.items():
            if own[e] and not is_expert_key(k) and not torch.equal(v, first[k]):
                raise ExpertError(f"{where}{k} differs between expert-parallel ranks {base} and "
                                  f"{e} (only the experts are cut over them)")
    return {k: torch.cat([s[k] for s in shards], 0) if is_expert_key(k) else v
            for k, v in first.items()}


def from_ours(parts: List[Dict[str, torch.Tensor]], meta: dict, where: str = "") -> Dict[str, torch.Tensor]:
    """The logical MoE tensors from the per-tensor-rank shards of one layer: the routed experts
    replicated (``meta["expert_tensor_parallel_size"]`` 1 or absent) or split over the tensor
    ranks (expert-TP = TP > 1, :func:`join_split_experts`); the router and shared expert
    replicated.

    Raises:
        ExpertError: a shard lacks the experts, two tensor ranks hold different copies of a
            replicated tensor, or an expert-TP other than 1 and the number of tensor ranks.
    """
    etp = int(meta.get("expert_tensor_parallel_size") or 1)
    if etp not in (1, len(parts)):
        raise ExpertError(f"{where}experts split at --expert-tensor-parallel-size {etp} over "
                          f"{len(parts)} tensor ranks: only 1 or the tensor-parallel size are read")
    names = ("mlp.router.weight", "mlp.experts.weight1", "mlp.experts.weight2")
    shared = meta.get("moe_shared_expert_intermediate_size")
    gated = shared and meta.get("moe_shared_expert_gate")
    if shared:
        names += ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
    if gated:
        names += ("mlp.shared_experts.gate_weight",)
    for r, p in enumerate(parts):
        for name in names:
            if name not in p:
                raise ExpertError(f"{where}tensor rank {r} lacks {name}")
            if r and etp > 1 and name in EXPERT_SUFFIXES:  # slices, joined below
                continue
            if r and not torch.equal(p[name], parts[0][name]):
                raise ExpertError(f"{where}{name} differs between tensor ranks 0 and {r} "
                                  "(experts are replicated over tensor ranks here)")
    f = meta["moe_ffn_hidden_size"]
    experts = join_split_experts(parts) if etp > 1 else parts[0]
    w1 = experts["mlp.experts.weight1"]
    out = {"router": parts[0]["mlp.router.weight"], "experts_gate": w1[:, :f],
           "experts_up": w1[:, f:], "experts_down": experts["mlp.experts.weight2"]}
    if shared:
        fc1 = parts[0]["mlp.shared_experts.linear_fc1"]
        out.update(shared_gate=fc1[:shared], shared_up=fc1[shared:],
                   shared_down=parts[0]["mlp.shared_experts.linear_fc2"])
    if gated:
        out["shared_expert_gate"] = parts[0]["mlp.shared_experts.gate_weight"]
    return out

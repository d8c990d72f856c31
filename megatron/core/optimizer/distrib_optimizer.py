"""The distributed optimizer: fp32 main parameters and Adam moments sharded over data parallelism.

After Megatron-LM's ``DistributedOptimizer`` (ZeRO stage 1 with reduce-scattered gradients, i.e.
ZeRO-2's gradient traffic). The DDP buffers are cut into buckets and every bucket into DP equal
shards (:mod:`megatron.core.distributed.param_and_grad_buffer`); rank r owns the contiguous slice
``shard_range(r)`` of every bucket, padding included, and only for those elements keeps a main
parameter and Adam's two moments:

* fp32 model: the main parameters *are* the parameter buffer's shard views (no copy), so the
  optimizer state is exactly ``8 * Psi_pad / N`` bytes per rank;
* bf16/fp16 model: one flat fp32 main tensor per bucket shard, ``12 * Psi_pad / N`` bytes.

Padding elements carry zero gradients, so their parameters and moments stay zero; they live in the
buffer's padding, never in a real parameter. Weight decay and the grad norm differ per parameter
(no decay on 1-D parameters; tensor-parallel duplicates counted on TP rank 0 only), so a bucket
shard is handed to AdamW as a few *runs*: maximal contiguous slices whose parameters share the
decay group and the norm attributes (the padding joins the last run). Runs are views of the flat
shard; AdamW steps them with its multi-tensor kernels.

One iteration: gradients accumulate locally in the grad buffer; the buckets are reduce-scattered
(during the last backward under ``--overlap-grad-reduce``); ``step()`` clips on the shards (each
element counted once over TP, PP and DP), steps AdamW, writes the main shards into the parameter
buffer and launches the bucket all-gathers (waited on in the next forward's pre-hooks under
``--overlap-param-gather``, else at once).

``--optimizer-cpu-offload`` (Megatron's flag; DeepSpeed's ZeRO-Offload, Ren et al. 2021): the
fp32 main shards, their gradients and the moments live in host memory (pinned on CUDA) and AdamW
steps there with torch's fused CPU kernel; each step copies the reduced gradient shards
device -> host (non-blocking, one synchronisation) and the updated shards host -> device. The
step's flag and norm are reduced on the model's device. Overlapping those copies with the
backward and the next forward on CUDA is not built yet (the copies run in the step).

Checkpoints keep the state per parameter name and element range, padding dropped
(:meth:`DistributedOptimizer.parameter_state`), so a checkpoint saved at one DP size is re-cut at
another, and converts to and from the plain optimizer's layout
(:mod:`~megatron.core.optimizer.distrib_optimizer_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.optimizer.clip_grads import grads_for_norm
from megatron.core.optimizer.distrib_optimizer_checkpoint import (STATE_KEYS, param_names,
                                                                  plain_to_records, read_shards)
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.optimizer.param_groups import get_param_groups
from megatron.core.process_groups import group_size


@dataclass
class Piece:
    """Elements ``[start, end)`` of the flattened parameter ``name`` at ``offset`` in its run."""

    name: str
    start: int
    end: int
    offset: int


@dataclass
class Run:
    """A contiguous slice of one bucket shard stepped as one AdamW parameter.

    ``main`` is what AdamW updates (a view of the parameter buffer for fp32 models, of the bucket
    shard's fp32 main tensor otherwise); ``grad_shard`` the matching view of the grad buffer.
    ``numel_real`` elements at the start belong to parameters, the rest is bucket padding.
    """

    group: int
    main: torch.Tensor
    grad_shard: torch.Tensor
    pieces: List[Piece] = field(default_factory=list)
    numel_real: int = 0
    host_grad: Optional[torch.Tensor] = None  # --optimizer-cpu-offload: where grad_shard lands


def _host_tensor(like: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """An fp32 host tensor shaped as ``like`` (its values when ``copy``), pinned when ``like``
    is on CUDA (so the copies between them can be asynchronous)."""
    out = torch.zeros(like.shape, dtype=torch.float32, pin_memory=like.is_cuda)
    if copy:
        out.copy_(like)
    return out


def _runs_of_shard(bucket, buf, lo: int, hi: int, main: torch.Tensor, names, group_of) -> List[Run]:
    """Cut the shard ``[lo, hi)`` (buffer elements) into runs; ``main`` is its flat main tensor."""
    segments = []  # [key, first element, pieces, end of the last piece]
    for p in bucket.params:  # buffer order
        start, end, _ = buf.param_index_map[p]
        a, b = max(start, lo), min(end, hi)
        if a >= b:
            continue
        key = (group_of[p], bool(getattr(p, "tensor_model_parallel", False)),
               bool(getattr(p, "shared_embedding", False)))
        if not segments or segments[-1][0] != key:
            segments.append([key, a, [], a])
        seg = segments[-1]
        seg[2].append(Piece(names[p], a - start, b - start, a - seg[1]))
        seg[3] = b
    if not segments:  # a shard of padding only
        segments = [[(0, True, False), lo, [], lo]]
    runs = []
    for i, (key, a, pieces, real_end) in enumerate(segments):
        end = segments[i + 1][1] if i + 1 < len(segments) else hi  # the last run takes the padding
        view = main[a - lo:end - lo]
        # What grads_for_norm reads to count each element of the model once.
        view.tensor_model_parallel, view.shared_embedding = key[1], key[2]
        runs.append(Run(key[0], view, bucket.grad_shard[a - lo:end - lo], pieces, real_end - a))
    return runs


class DistributedOptimizer(MixedPrecisionOptimizer):
    """AdamW on this rank's shards of the DDP buffers (see the module docstring).

    Args:
        config: the optimizer config (``lr``, ``weight_decay``, Adam coefficients, ``clip_grad``,
            ``log_num_zeros_in_grad``).
        model_chunks: :class:`~megatron.core.distributed.DistributedDataParallel` chunks built with
            ``use_distributed_optimizer=True``.
        make_adamw: ``(param_groups) -> torch.optim.AdamW`` (the plain optimizer's factory).
        grad_scaler: fp16 loss scaler or None.
        pg_collection: this rank's process groups (the norm's model-parallel group).
        data_parallel_group: the group the main params and moments are sharded over
            (Megatron-Core's ``dp_cp``; ``expt_dp`` for the expert part): the group the chunks'
            buffers of this part reduce-scatter over.
        expert: this optimizer steps the expert buffers (the expert part of a
            :class:`~megatron.core.optimizer.chained_optimizer.ChainedOptimizer`), else the
            dense ones.

    Attributes:
        shards: ``(model_shard, main)`` per bucket shard: the parameter buffer's view and the flat
            fp32 main tensor (the same tensor for fp32 models).
        runs: the AdamW parameters, in buffer order.

    Raises:
        ValueError: if a chunk was not wrapped with ``use_distributed_optimizer=True``, or its
            buffers reduce over another group than ``data_parallel_group``.
    """

    kind = "distributed"

    def __init__(self, config, model_chunks, make_adamw, grad_scaler=None, *, pg_collection,
                 data_parallel_group, expert: bool = False):
        for chunk in model_chunks:
            if not (isinstance(chunk, DistributedDataParallel) and chunk.use_distributed_optimizer):
                raise ValueError("--use-distributed-optimizer needs the model wrapped by "
                                 "DistributedDataParallel(use_distributed_optimizer=True)")
            if any(buf.data_parallel_group is not data_parallel_group
                   for buf in chunk.buffers if buf.is_expert == expert):
                raise ValueError("the distributed optimizer shards over another data-parallel "
                                 "group than the one the model's gradient buffers reduce over: "
                                 "build both from the same ProcessGroupCollection (dp_cp, "
                                 "expt_dp for expert parameters)")
        self.model_chunks = list(model_chunks)
        names = param_names(model_chunks)
        groups = get_param_groups(model_chunks, config.weight_decay, expert)
        group_of = {p: gi for gi, g in enumerate(groups) for p in g["params"]}
        self.offload = bool(config.optimizer_cpu_offload)
        self.shards: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.runs: List[Run] = []
        for chunk in model_chunks:
            for buf in (b for b in chunk.buffers if b.is_expert == expert):
                for bucket in buf.buckets:
                    s, e = bucket.shard_range(bucket.data_parallel_rank)
                    lo, hi = bucket.offset + s, bucket.offset + e
                    model_shard = bucket.param_shard
                    if self.offload:
                        main = _host_tensor(model_shard)
                    else:
                        main = (model_shard if model_shard.dtype == torch.float32
                                else model_shard.float())
                    self.shards.append((model_shard, main))
                    runs = _runs_of_shard(bucket, buf, lo, hi, main, names, group_of)
                    if self.offload:
                        host_grad = _host_tensor(model_shard, copy=False)
                        for r in runs:
                            at = r.main.storage_offset() - main.storage_offset()
                            r.host_grad = host_grad[at:at + r.main.numel()]
                    self.runs += runs
        self.model_device = self.shards[0][0].device if self.shards else torch.device("cpu")
        # Empty groups stay (a rank may own no piece of a group): indices equal on every rank.
        torch_groups = [{**g, "params": [r.main for r in self.runs if r.group == gi]}
                        for gi, g in enumerate(groups)]
        super().__init__(make_adamw(torch_groups), config, grad_scaler,
                         pg_collection=pg_collection, expert=expert)
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = group_size(data_parallel_group)
        self._loaded_from_plain = False

    # The step -----------------------------------------------------------------------------------

    def _data_parallel_group(self):
        """The global norm and the skip flag also combine the shards' partial results over DP."""
        return self.data_parallel_group if self.data_parallel_world_size > 1 else None

    def _main_grads(self) -> List[torch.Tensor]:
        return [r.main.grad for r in self.runs]

    def _copy_model_grads_to_main_grads(self) -> None:
        if self.offload:  # device -> host, then one wait for all the copies
            for r in self.runs:
                r.host_grad.copy_(r.grad_shard, non_blocking=r.host_grad.is_pinned())
                r.main.grad = r.host_grad
            if self.model_device.type == "cuda":
                torch.cuda.current_stream(self.model_device).synchronize()
            return
        for r in self.runs:  # a view for fp32 grad buffers, an fp32 copy for bf16 ones
            r.main.grad = r.grad_shard if r.grad_shard.dtype == torch.float32 else r.grad_shard.float()

    def _copy_main_params_to_model_params(self) -> None:
        for model_shard, main in self.shards:
            if main is not model_shard:  # host -> device under offload, ordered on the stream
                model_shard.copy_(main, non_blocking=main.is_pinned())

    def _collective_device(self):
        return self.model_device if self.offload else None

    def count_zeros(self) -> int:
        """Zero gradient elements of the model (padding excluded), each counted once."""
        counted = {id(g) for g in grads_for_norm(self.get_parameters(), self.pg_collection,
                                                 self.expert)}
        device = self._collective_device() or self.runs[0].main.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for r in self.runs:
            if id(r.main.grad) in counted:
                total += r.numel_real - torch.count_nonzero(r.main.grad[:r.numel_real])
        for group in (self._data_parallel_group(), self.model_parallel_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        return int(total.item())

    def _after_step(self, update_successful: bool) -> None:
        """Drop the aliases of the grad buffer; after an update, launch the parameter
        all-gathers (collective: one all-gather per bucket over the data-parallel group)."""
        self.zero_grad()
        if update_successful:
            for chunk in self.model_chunks:
                chunk.start_param_sync(expert=self.expert)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for r in self.runs:
            r.main.grad = None

    def finish_param_sync(self) -> None:
        """Complete pending parameter all-gathers (before reading weights outside a forward);
        never starts one (ZeRO-3's gather of every unit is the model's finish_param_sync)."""
        for chunk in self.model_chunks:
            chunk.wait_param_sync()

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for model_shard, main in self.shards:
                if main is not model_shard:
                    main.copy_(model_shard)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: Adam moments, plus fp32 main copies."""
        total = 0
        for r in self.runs:
            state = self.optimizer.state.get(r.main, {})
            total += sum(state[k].numel() * state[k].element_size()
                         for k in ("exp_avg", "exp_avg_sq") if k in state)
        for model_shard, main in self.shards:
            if main is not model_shard:
                total += main.numel() * main.element_size()
        return total

    # Checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The part common to all DP ranks: group hyperparameters, step count, grad scaler.

        The sharded part is :meth:`parameter_state` (one file per DP rank)."""
        self.finish_param_sync()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        sd = {"distributed_optimizer": True, "param_groups": groups}
        if self.grad_scaler is not None:
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the common part (see :meth:`state_dict`); a plain optimizer's state dict
        (saved without ``--use-distributed-optimizer``) is converted and loaded whole.

        Raises:
            ValueError: if the parameter groups do not match the model.
        """
        if not state_dict.get("distributed_optimizer"):
            records, step = plain_to_records(state_dict, self.model_chunks,
                                             self.config.weight_decay)
            self._load_records(records, step, "the checkpoint's plain optimizer state")
            self._loaded_from_plain = True
            if self.grad_scaler is not None and "grad_scaler" in state_dict:
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
            return
        if len(state_dict["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError("optimizer checkpoint: parameter groups do not match the model; "
                             "load with --no-load-optim or use the same model configuration")
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def sharded_state_dict(self, shardings):
        """The pieces of this rank's shards as boxes of global tensors (``--ckpt-format
        torch_dist``; :mod:`megatron.core.optimizer.sharded_state`)."""
        from megatron.core.optimizer.sharded_state import distributed_sharded_state
        return distributed_sharded_state(self, shardings)

    def sharded_load_targets(self, shardings, saved_keys: set):
        """The boxes of this rank's shards a load fills, and the ``finish(common)`` installing
        them (any saving layout: DCP reshards)."""
        from megatron.core.optimizer.sharded_state import distributed_load_targets
        return distributed_load_targets(self, shardings, saved_keys)

    def parameter_state(self) -> dict:
        """This rank's shard state, layout-independent (padding dropped): ``{"params": {name:
        {"range": [start, end], "param": fp32 main piece, "exp_avg": ..., "exp_avg_sq": ...}},
        "step": int}``; ``range`` is in elements of the flattened parameter."""
        self.finish_param_sync()
        out: Dict[str, dict] = {}
        step = 0
        for r in self.runs:
            state = self.optimizer.state.get(r.main, {})
            step = int(state["step"]) if "step" in state else step
            for pc in r.pieces:
                n = pc.end - pc.start
                rec = {"range": [pc.start, pc.end],
                       "param": r.main[pc.offset:pc.offset + n].detach().float().clone()}
                for k in ("exp_avg", "exp_avg_sq"):
                    rec[k] = (state[k][pc.offset:pc.offset + n].detach().clone() if k in state
                              else torch.zeros_like(rec["param"]))
                out[pc.name] = rec
        return {"params": out, "step": step}

    def save_parameter_state(self, path: str) -> None:
        """Write :meth:`parameter_state` to ``path`` (``torch.save``)."""
        torch.save(self.parameter_state(), path)

    def load_parameter_state(self, paths: List[str]) -> None:
        """Load the shard state from the files of *all* DP ranks that saved it (any DP size),
        keeping the pieces this rank owns now.

        Raises:
            ValueError: if no file is given (and no plain state was loaded), or the files do not
                cover a piece this rank owns.
        """
        if not paths:
            if self._loaded_from_plain:
                return
            raise ValueError("no distrib_optim_dp_*.pt file in the checkpoint: it was saved without "
                             "--use-distributed-optimizer; load with --no-load-optim")
        pieces, step = read_shards(paths)
        self._load_records(pieces, step, f"optimizer shard files {paths[0]}...")

    @torch.no_grad()
    def _load_records(self, pieces: Dict[str, list], step: int, source: str) -> None:
        """Fill every run from per-parameter records ``{name: [{"range", "param", "exp_avg",
        "exp_avg_sq"}]}``; padding stays zero."""
        fused = self.optimizer.defaults.get("fused", False)
        for r in self.runs:
            values = {k: torch.zeros(r.main.numel(), dtype=torch.float32) for k in STATE_KEYS}
            for pc in r.pieces:
                covered = 0
                for rec in pieces.get(pc.name, []):
                    s, t = rec["range"]
                    lo, hi = max(pc.start, s), min(pc.end, t)
                    if lo < hi:
                        covered += hi - lo
                        at = pc.offset + lo - pc.start
                        for k in STATE_KEYS:
                            values[k][at:at + hi - lo] = rec[k].reshape(-1)[lo - s:hi - s]
                if covered != pc.end - pc.start:
                    raise ValueError(f"{source}: parameter {pc.name} elements [{pc.start}, "
                                     f"{pc.end}) are not all present (a DP rank's file is "
                                     "missing?); load with --no-load-optim")
            r.main.copy_(values["param"])
            device = r.main.device if fused else "cpu"
            self.optimizer.state[r.main] = {
                "step": torch.tensor(float(step), dtype=torch.float32, device=device),
                "exp_avg": values["exp_avg"].to(r.main.device),
                "exp_avg_sq": values["exp_avg_sq"].to(r.main.device)}
        self._copy_main_params_to_model_params()

"""The distributed optimizer: fp32 main parameters and Adam moments sharded over data parallelism.

After Megatron-LM's ``DistributedOptimizer`` (ZeRO stage 1 with reduce-scattered gradients, i.e.
ZeRO-2's gradient traffic). The DDP buffers are cut into buckets and every bucket into DP equal
shards (:mod:`megatron.core.distributed.param_and_grad_buffer`); rank r owns shard r of every
bucket and only for those elements keeps a main parameter and Adam's two moments:

* fp32 model: the main parameters *are* the model parameters' shard views (no copy), so the
  optimizer state is 8 bytes per owned element;
* bf16/fp16 model: fp32 main copies of the shard, 12 bytes per owned element.

One iteration: gradients accumulate locally in the fp32 buffer; the buckets are reduce-scattered
(during the last backward under ``--overlap-grad-reduce``); ``step()`` clips on the shards (each
element counted once over TP, PP and DP), steps AdamW on the owned pieces, writes them into the
parameter buffer and launches the bucket all-gathers (waited on in the next forward's pre-hooks
under ``--overlap-param-gather``, else at once).

A main parameter is one piece ``param.view(-1)[start:end]`` of one model parameter, so the
AdamW groups (weight decay or not) are those of the plain optimizer. Checkpoints keep the state
per parameter name and element range (:meth:`parameter_state`), so a checkpoint saved at one DP
size is re-cut at another (:meth:`load_parameter_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.optimizer.clip_grads import count_zeros_fp32, get_grad_norm_fp32, grads_for_norm
from megatron.core.optimizer.optimizer import (_PARALLEL_ATTRS, MixedPrecisionOptimizer,
                                               _model_parallel_group, get_param_groups)

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class ShardEntry:
    """This rank's piece ``[start, end)`` (flattened elements) of one model parameter."""

    name: str
    param: torch.nn.Parameter
    start: int
    end: int
    model_shard: torch.Tensor  # view of the DDP param buffer
    grad_shard: torch.Tensor   # view of the DDP grad buffer
    main: torch.Tensor         # what AdamW updates (== model_shard for fp32 params)


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _shard_entry(name: str, p: torch.nn.Parameter, chunk) -> Optional[ShardEntry]:
    buf = chunk.param_to_buffer[p]
    start, end, index = buf.param_index_map[p]
    bucket = buf.buckets[index]
    s, e = bucket.shard_range(bucket.data_parallel_rank)
    lo, hi = max(start, bucket.offset + s), min(end, bucket.offset + e)
    if lo >= hi:
        return None
    model_shard, grad_shard = buf.param_data[lo:hi], buf.grad_data[lo:hi]
    main = model_shard if p.dtype == torch.float32 else model_shard.detach().float()
    for attr in _PARALLEL_ATTRS:
        if hasattr(p, attr):
            setattr(main, attr, getattr(p, attr))
    return ShardEntry(name, p, lo - start, hi - start, model_shard, grad_shard, main)


class DistributedOptimizer(MixedPrecisionOptimizer):
    """AdamW on this rank's shards of the DDP buffers (see the module docstring).

    Args:
        config: the optimizer config (``lr``, ``weight_decay``, Adam coefficients, ``clip_grad``,
            ``log_num_zeros_in_grad``).
        model_chunks: :class:`~megatron.core.distributed.DistributedDataParallel` chunks built with
            ``use_distributed_optimizer=True``.
        make_adamw: ``(param_groups) -> torch.optim.AdamW`` (the plain optimizer's factory).
        grad_scaler: fp16 loss scaler or None.

    Raises:
        ValueError: if a chunk was not wrapped with ``use_distributed_optimizer=True``.
    """

    def __init__(self, config, model_chunks, make_adamw, grad_scaler=None):
        for chunk in model_chunks:
            if not getattr(chunk, "use_distributed_optimizer", False):
                raise ValueError("--use-distributed-optimizer needs the model wrapped by "
                                 "DistributedDataParallel(use_distributed_optimizer=True)")
        self.model_chunks = list(model_chunks)
        names = {}
        for ci, chunk in enumerate(model_chunks):
            for n, p in _unwrap(chunk).named_parameters():
                names.setdefault(p, (f"{ci}.{n}", chunk))
        self.entries: List[ShardEntry] = []
        groups = []
        for group in get_param_groups(model_chunks, config.weight_decay):
            pieces = [_shard_entry(names[p][0], p, names[p][1]) for p in group["params"]]
            pieces = [e for e in pieces if e is not None]
            self.entries += pieces
            groups.append({**group, "params": [e.main for e in pieces]})
        super().__init__(make_adamw(groups), config, grad_scaler)
        self.data_parallel_group = model_chunks[0].data_parallel_group
        self.data_parallel_world_size = model_chunks[0].data_parallel_world_size

    # The step -----------------------------------------------------------------------------------

    def _dp_group(self):
        return self.data_parallel_group if self.data_parallel_world_size > 1 else None

    def _main_grads(self) -> List[torch.Tensor]:
        return [e.main.grad for e in self.entries]

    def _copy_model_grads_to_main_grads(self) -> None:
        for e in self.entries:
            e.main.grad = e.grad_shard if e.grad_shard.dtype == torch.float32 else e.grad_shard.float()

    def _copy_main_params_to_model_params(self) -> None:
        for e in self.entries:
            if e.main is not e.model_shard:
                e.model_shard.copy_(e.main)

    def get_grad_norm(self) -> float:
        """Global L2 norm over the shards: partial sums combined over DP, then TP x PP."""
        return get_grad_norm_fp32(grads_for_norm(self.get_parameters()),
                                  model_parallel_group=_model_parallel_group(),
                                  data_parallel_group=self._dp_group())

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), model_parallel_group=_model_parallel_group(),
                                data_parallel_group=self._dp_group())

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """Mixed-precision step on the shards, then launch the parameter all-gathers.

        Collectives: all-reduces of the norm (DP, then TP x PP); one all-gather per bucket.
        """
        update_successful, grad_norm, num_zeros = super().step()
        for e in self.entries:
            e.main.grad = None  # drop the alias of the grad buffer
        if update_successful:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
        return update_successful, grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        for e in self.entries:
            e.main.grad = None

    def finish_param_sync(self) -> None:
        """Complete pending parameter all-gathers (before reading weights outside a forward)."""
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for e in self.entries:
                if e.main is not e.model_shard:
                    e.main.copy_(e.model_shard.float())

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: Adam moments, plus fp32 main copies."""
        total = 0
        for e in self.entries:
            state = self.optimizer.state.get(e.main, {})
            total += sum(state[k].numel() * state[k].element_size()
                         for k in ("exp_avg", "exp_avg_sq") if k in state)
            if e.main is not e.model_shard:
                total += e.main.numel() * e.main.element_size()
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
        """Restore the common part (see :meth:`state_dict`).

        Raises:
            ValueError: for a checkpoint written without ``--use-distributed-optimizer``.
        """
        if not state_dict.get("distributed_optimizer"):
            raise ValueError("the checkpoint's optimizer state was saved without "
                             "--use-distributed-optimizer; load it with --no-load-optim or "
                             "without --use-distributed-optimizer")
        if len(state_dict["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError("optimizer checkpoint: parameter groups do not match the model; "
                             "load with --no-load-optim or use the same model configuration")
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def parameter_state(self) -> dict:
        """This rank's shard state, layout-independent: ``{"params": {name: {"range": [start,
        end], "param": fp32 main piece, "exp_avg": ..., "exp_avg_sq": ...}}, "step": int}``."""
        self.finish_param_sync()
        out: Dict[str, dict] = {}
        step = 0
        for e in self.entries:
            state = self.optimizer.state.get(e.main, {})
            step = int(state["step"]) if "step" in state else step
            rec = {"range": [e.start, e.end], "param": e.main.detach().float().clone()}
            for k in ("exp_avg", "exp_avg_sq"):
                rec[k] = state[k].detach().clone() if k in state else torch.zeros_like(rec["param"])
            out[e.name] = rec
        return {"params": out, "step": step}

    def save_parameter_state(self, path: str) -> None:
        """Write :meth:`parameter_state` to ``path`` (``torch.save``)."""
        torch.save(self.parameter_state(), path)

    @torch.no_grad()
    def load_parameter_state(self, paths: List[str]) -> None:
        """Load the shard state from the files of *all* DP ranks that saved it (any DP size),
        keeping the pieces this rank owns now.

        Raises:
            ValueError: if no file is given or the files do not cover a piece this rank owns.
        """
        if not paths:
            raise ValueError("no distrib_optim_dp_*.pt file in the checkpoint: it was saved without "
                             "--use-distributed-optimizer; load with --no-load-optim")
        pieces: Dict[str, list] = {}
        step = 0
        for path in paths:
            sd = torch.load(path, map_location="cpu", weights_only=True)
            step = max(step, int(sd["step"]))
            for name, rec in sd["params"].items():
                pieces.setdefault(name, []).append(rec)
        fused = self.optimizer.defaults.get("fused", False)
        for e in self.entries:
            values = {k: torch.empty(e.end - e.start, dtype=torch.float32) for k in STATE_KEYS}
            covered = 0
            for rec in pieces.get(e.name, []):
                s, t = rec["range"]
                lo, hi = max(e.start, s), min(e.end, t)
                if lo < hi:
                    covered += hi - lo
                    for k in STATE_KEYS:
                        values[k][lo - e.start:hi - e.start] = rec[k][lo - s:hi - s]
            if covered != e.end - e.start:
                raise ValueError(f"optimizer shard files {paths[0]}...: parameter {e.name} elements "
                                 f"[{e.start}, {e.end}) are not all present (a DP rank's file is "
                                 "missing?); load with --no-load-optim")
            e.main.copy_(values["param"].view_as(e.main))
            device = e.main.device if fused else "cpu"
            self.optimizer.state[e.main] = {
                "step": torch.tensor(float(step), dtype=torch.float32, device=device),
                "exp_avg": values["exp_avg"].to(e.main.device).view_as(e.main),
                "exp_avg_sq": values["exp_avg_sq"].to(e.main.device).view_as(e.main)}
        self._copy_main_params_to_model_params()

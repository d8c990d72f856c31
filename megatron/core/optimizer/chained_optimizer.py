"""A chain of optimizer parts stepped as one optimizer: the dense part and the expert part.

After Megatron-Core's ``ChainedOptimizer``. Dense parameters reduce their gradients over the data
x context group (``dp_cp``) and the expert parameters over the expert-data-parallel group
(``expt_dp``, :mod:`megatron.core.process_groups`), so each kind is stepped by its own part
(a :class:`~megatron.core.optimizer.optimizer.MegatronOptimizer` built with ``expert=True`` for
the experts: a plain one, or a distributed one sharded over ``expt_dp``). The chain runs the one
step of :class:`~megatron.core.optimizer.optimizer.MegatronOptimizer` over all parts:

* the skip flag: each part's (its main grads unscaled with the one shared fp16 scale, its
  inf/NaN found, agreed over its own groups), the maximum then agreed again over every part's
  groups, so every rank skips alike and the one loss scaler is updated once;
* the gradient norm: ``sum |g|^2`` of each part, already summed over the groups that count each
  of its elements once (dense: its shards over ``dp_cp`` under the distributed optimizer, then
  the model group TP x PP; expert: its shards over ``expt_dp``, then ``tp_ep_pp``, expert-TP x
  EP x PP), added: the norm of the whole model, every element counted once;
* clipping by that norm, each part's AdamW step, the parts' parameter all-gathers.

Checkpoints keep the parts apart (``chained_optimizers``: one entry per part, in chain order).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from megatron.core.optimizer.optimizer import MegatronOptimizer


class ChainedOptimizer(MegatronOptimizer):
    """The parts (dense first) stepped as one optimizer (see the module docstring).

    Args:
        parts: the optimizers, each over a disjoint set of parameters, all of one ``kind``
            (plain or distributed), built with the same config and the same ``grad_scaler``.

    Raises:
        ValueError: for no part, parts of different kinds, or different grad scalers.
    """

    def __init__(self, parts: List[MegatronOptimizer]):
        if not parts:
            raise ValueError("a chained optimizer needs at least one part")
        kinds = {part.kind for part in parts}
        if len(kinds) != 1:
            raise ValueError(f"the parts of a chained optimizer are of kinds {sorted(kinds)}: "
                             "build them with the same --use-distributed-optimizer")
        if len({id(part.grad_scaler) for part in parts}) != 1:
            raise ValueError("the parts of a chained optimizer must share one grad scaler")
        self.parts = list(parts)
        self.kind = parts[0].kind
        first = parts[0]
        # No torch optimizer of its own: every use of self.optimizer is overridden below.
        self.optimizer = None
        self.config = first.config
        self.grad_scaler = first.grad_scaler
        self.pg_collection = first.pg_collection
        self.expert = False
        self.model_parallel_group = first.model_parallel_group

    # The parts' parameters and state ----------------------------------------------------------

    def get_parameters(self) -> List[torch.nn.Parameter]:
        return [p for part in self.parts for p in part.get_parameters()]

    @property
    def param_groups(self):
        """Every part's parameter groups, in chain order (the lr scheduler writes them)."""
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self):
        out = {}
        for part in self.parts:
            out.update(part.state)
        return out

    def model_main_pairs(self) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        return [pair for part in self.parts for pair in part.model_main_pairs()]

    # The step's phases over the parts -----------------------------------------------------------

    def _copy_model_grads_to_main_grads(self) -> None:
        for part in self.parts:
            part._copy_model_grads_to_main_grads()

    def _main_grads(self) -> List[torch.Tensor]:
        return [g for part in self.parts for g in part._main_grads()]

    def flag_groups(self) -> List:
        groups = []
        for part in self.parts:
            groups += [g for g in part.flag_groups() if all(g is not h for h in groups)]
        return groups

    def prepare_grads(self, nonfinite_loss=False) -> torch.Tensor:
        """Each part's flag (agreed over its groups), their maximum agreed over every part's
        groups: a flag of one part reaches the ranks of the other."""
        flags = [part.prepare_grads(nonfinite_loss) for part in self.parts]
        found = torch.stack([f.to(flags[0].device) for f in flags]).max()
        if len(self.parts) > 1:
            for group in self.flag_groups():
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX,
                                             group=group)
        return found

    def _grad_norm_power(self) -> torch.Tensor:
        """``sum |g|^2`` of the whole model: the parts' sums, each complete over its groups."""
        powers = [part._grad_norm_power() for part in self.parts]
        return torch.stack([p.to(powers[0].device) for p in powers]).sum()

    def _collective_device(self):
        return self.parts[0]._collective_device()

    def count_zeros(self) -> int:
        return sum(part.count_zeros() for part in self.parts)

    def _fused_step(self) -> bool:
        params = self.get_parameters()
        return all(part._fused_step() for part in self.parts) and \
            len({p.device for p in params}) == 1

    def step_with_ready_grads(self, grad_scale=None, found_inf=None) -> None:
        for part in self.parts:
            part.step_with_ready_grads(grad_scale=grad_scale, found_inf=found_inf)

    def _after_step(self, update_successful: bool) -> None:
        for part in self.parts:
            part._after_step(update_successful)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def reload_model_params(self) -> None:
        for part in self.parts:
            part.reload_model_params()

    def finish_param_sync(self) -> None:
        for part in self.parts:
            part.finish_param_sync()

    # Checkpoints: one entry per part --------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{"chained_optimizers": [part state dict, ...]}`` (Megatron-Core's chained form),
        ``distributed_optimizer`` True for distributed parts (their shards:
        :meth:`parameter_state`)."""
        return {"chained_optimizers": [part.state_dict() for part in self.parts],
                "distributed_optimizer": self.kind == "distributed"}

    def load_state_dict(self, state_dict: dict) -> None:
        """Raises:
            ValueError: for a checkpoint of one optimizer (no expert part) or of another
                number of parts."""
        saved = state_dict.get("chained_optimizers")
        if saved is None or len(saved) != len(self.parts):
            found = "one optimizer" if saved is None else f"{len(saved)} optimizer parts"
            raise ValueError(f"optimizer checkpoint: it holds {found}, this model has "
                             f"{len(self.parts)} (dense and expert parameters); load with "
                             "--no-load-optim or use the same model configuration")
        for part, sd in zip(self.parts, saved):
            part.load_state_dict(sd)

    def parameter_state(self) -> dict:
        """The distributed parts' shard state, merged (parameter names are disjoint)."""
        out = {"params": {}, "step": 0}
        for part in self.parts:
            state = part.parameter_state()
            out["params"].update(state["params"])
            out["step"] = max(out["step"], state["step"])
        return out

    def load_parameter_state(self, paths: List[str]) -> None:
        for part in self.parts:
            part.load_parameter_state(paths)

    def sharded_state_dict(self, shardings):
        """The parts' boxes together; ``common`` holds each part's plain data in order."""
        from megatron.core.optimizer.sharded_state import chain_states
        return chain_states([part.sharded_state_dict(shardings) for part in self.parts])

    def sharded_load_targets(self, shardings, saved_keys: set):
        from megatron.core.optimizer.sharded_state import chain_states
        return chain_states([part.sharded_load_targets(shardings, saved_keys)
                             for part in self.parts])

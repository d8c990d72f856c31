"""Model-parallel RNG: a tracker of named generator states (CPU and CUDA), seeding, and
activation recompute (``checkpoint``) that replays the same random numbers.

Source: Megatron-LM ``megatron/core/tensor_parallel/random.py`` (``CudaRNGStatesTracker``,
``model_parallel_cuda_manual_seed``, ``CheckpointFunction``), generalised from CUDA to CPU: every
state this module saves or swaps covers the CPU generator and, where CUDA is available, the
current CUDA device's generator. Dropout inside tensor-parallel regions runs under
``get_rng_tracker().fork()`` (different per tensor-parallel rank); elsewhere it uses the default
generators (equal across tensor-parallel ranks).
"""

from __future__ import annotations

import contextlib
from typing import Dict

import torch

from megatron.core.process_groups import group_rank, group_size
from megatron.core.tensor_parallel.mappings import all_gather_first_dim

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

# Megatron's offset between the default (data-parallel) seed and the tensor-parallel seed.
_TENSOR_MODEL_PARALLEL_SEED_OFFSET = 2718


def _cuda_tracked() -> bool:
    return torch.cuda.is_available()


def get_device_rng_states() -> Dict[str, torch.Tensor]:
    """The default generators' states: ``{"cpu": ByteTensor, "cuda": ByteTensor (if CUDA)}``."""
    states = {"cpu": torch.get_rng_state()}
    if _cuda_tracked():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_device_rng_states(states: Dict[str, torch.Tensor]) -> None:
    """Restore states from :func:`get_device_rng_states` (a missing or untracked device is left
    alone, so a CPU run can load a CUDA run's checkpoint)."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and _cuda_tracked():
        torch.cuda.set_rng_state(states["cuda"])


def _seeded_states(seed: int) -> Dict[str, torch.Tensor]:
    """Generator states for ``seed``, leaving the current default generators untouched."""
    states = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if _cuda_tracked():
        original = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)  # the current device only, as Megatron's tracker
        states["cuda"] = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(original)
    return states


class RNGStatesTracker:
    """Named generator states that :meth:`fork` swaps in and out (Megatron's
    ``CudaRNGStatesTracker``, for CPU and CUDA).

    Each name holds a state per device type (see :func:`get_device_rng_states`); inside
    ``with tracker.fork(name):`` random ops draw from that state, which advances, and the default
    generators are restored on exit.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget every named state and seed."""
        self.states_: Dict[str, Dict[str, torch.Tensor]] = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """A copy of the named states ``{name: {"cpu": ..., "cuda": ...}}`` (for checkpoints)."""
        return {name: dict(states) for name, states in self.states_.items()}

    def set_states(self, states: Dict[str, Dict[str, torch.Tensor]]) -> None:
        """Replace the named states (from :meth:`get_states`; seeds are not restored)."""
        self.states_ = {name: dict(s) for name, s in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``.

        Raises:
            ValueError: if ``seed`` or ``name`` is already tracked.
        """
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds_.add(seed)
        self.states_[name] = _seeded_states(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the body with the generators set to state ``name``; save its advanced state and
        restore the default generators afterwards (also on exceptions).

        Raises:
            KeyError: if ``name`` is not tracked (call :func:`model_parallel_manual_seed`).
        """
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not in the tracker; call "
                           "model_parallel_manual_seed(seed) first")
        original = get_device_rng_states()
        set_device_rng_states(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_device_rng_states()
            set_device_rng_states(original)


# Megatron's name, kept for readers who know it.
CudaRNGStatesTracker = RNGStatesTracker

_RNG_STATE_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (part of the one accepted global, like the group registry)."""
    return _RNG_STATE_TRACKER


get_cuda_rng_tracker = get_rng_tracker  # Megatron's name


def model_parallel_manual_seed(seed: int, tp_rank: int) -> None:
    """Seed the default generators and the tensor-parallel tracker state, as Megatron's
    ``model_parallel_cuda_manual_seed``, on CPU and CUDA.

    - default generators (CPU and CUDA): ``seed`` (equal across tensor-parallel ranks, used for
      dropout outside tensor-parallel regions);
    - tracker state ``"model-parallel-rng"``: ``seed + 2718 + tensor_model_parallel_rank``
      (different per tensor-parallel rank, used for dropout inside them).

    Megatron's training setup passes ``seed + 100 * pipeline_rank`` here so stages differ.

    Args:
        seed: base seed.
        tp_rank: this process's tensor-parallel rank (0 in a single process).
    """
    tensor_model_parallel_seed = seed + _TENSOR_MODEL_PARALLEL_SEED_OFFSET + tp_rank
    _RNG_STATE_TRACKER.reset()
    torch.manual_seed(seed)
    _RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)


model_parallel_cuda_manual_seed = model_parallel_manual_seed  # Megatron's name


# Activation recompute ---------------------------------------------------------------------------

def _split_into_1d_chunk(tensor: torch.Tensor, group) -> torch.Tensor:
    """This rank's equal chunk of the flattened tensor (zero-padded to a multiple of TP)."""
    world = group_size(group)
    flat = tensor.detach().reshape(-1)
    chunk = -(-flat.numel() // world)
    flat = torch.nn.functional.pad(flat, (0, chunk * world - flat.numel()))
    return flat.narrow(0, group_rank(group) * chunk, chunk).clone()


def _gather_1d_chunks(chunk: torch.Tensor, shape, group) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    return all_gather_first_dim(chunk, group)[:numel].view(shape)


_RECOMPUTE_DEPTH = 0


def is_recomputing() -> bool:
    """True while :class:`CheckpointFunction` re-runs a forward in backward: layers that count
    what they route or log (MoE) record only the original forward, not its replay."""
    return _RECOMPUTE_DEPTH > 0


class CheckpointFunction(torch.autograd.Function):
    """Megatron's activation recompute: forward runs ``run_function`` without keeping its
    activations; backward re-runs it under the generator states of the original forward (CPU,
    CUDA and every tracker state), so dropout masks are identical, then back-propagates.

    With ``distribute_saved_activations`` the first argument is kept only as this rank's 1/TP
    chunk and all-gathered over the tensor-parallel group before recompute (Megatron's
    ``--distribute-saved-activations``; the tensor must be equal across tensor-parallel ranks).
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, group, *args):
        ctx.run_function = run_function
        ctx.group = group
        ctx.distribute = distribute_saved_activations and torch.is_tensor(args[0]) \
            and group_size(group) > 1
        ctx.fwd_rng_states = get_device_rng_states()
        ctx.fwd_tracker_states = get_rng_tracker().get_states()
        with torch.no_grad():
            outputs = run_function(*args)
        tensor_args = list(args)
        if ctx.distribute:
            ctx.input_0_shape = args[0].shape
            ctx.input_0_requires_grad = args[0].requires_grad
            tensor_args[0] = _split_into_1d_chunk(args[0], group)
        ctx.tensor_indices = [i for i, a in enumerate(tensor_args) if torch.is_tensor(a)]
        ctx.non_tensors = {i: a for i, a in enumerate(tensor_args) if not torch.is_tensor(a)}
        ctx.num_args = len(args)
        ctx.save_for_backward(*(tensor_args[i] for i in ctx.tensor_indices))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() is not compatible with .grad(); use .backward()")
        args = [None] * ctx.num_args
        for i, t in zip(ctx.tensor_indices, ctx.saved_tensors):
            args[i] = t
        for i, a in ctx.non_tensors.items():
            args[i] = a
        if ctx.distribute:
            args[0] = _gather_1d_chunks(args[0], ctx.input_0_shape, ctx.group)
            args[0].requires_grad_(ctx.input_0_requires_grad)
        detached = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a
                    for a in args]

        bwd_rng_states = get_device_rng_states()
        bwd_tracker_states = get_rng_tracker().get_states()
        set_device_rng_states(ctx.fwd_rng_states)
        get_rng_tracker().set_states(ctx.fwd_tracker_states)
        global _RECOMPUTE_DEPTH
        _RECOMPUTE_DEPTH += 1
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
        finally:
            _RECOMPUTE_DEPTH -= 1
            set_device_rng_states(bwd_rng_states)
            get_rng_tracker().set_states(bwd_tracker_states)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if torch.is_tensor(a) else None for a in detached)
        return (None, None, None) + grads


def checkpoint(function, distribute_saved_activations: bool, *args, tp_group):
    """Recompute ``function(*args)`` in backward instead of storing its activations
    (Megatron's ``tensor_parallel.checkpoint``).

    Args:
        function: called as ``function(*args)``; returns a tensor or a tuple of tensors.
        distribute_saved_activations: keep only a 1/TP chunk of ``args[0]`` between forward and
            backward (it must be identical on all tensor-parallel ranks).
        *args: positional arguments (tensors or other values).
        tp_group: the tensor-parallel group ``distribute_saved_activations`` splits over (None:
            a world of one; required, keyword-only).

    Returns:
        ``function``'s outputs; gradients reach the tensor arguments and the parameters used by
        ``function`` as without recompute, with identical random numbers (dropout masks).
    """
    group = tp_group if distribute_saved_activations else None
    return CheckpointFunction.apply(function, distribute_saved_activations, group, *args)

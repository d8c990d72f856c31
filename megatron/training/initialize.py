"""Start-up of a training process: torch.distributed, model-parallel groups, device and seeds.

Follows Megatron-LM's ``initialize_megatron`` / ``_initialize_distributed`` / ``_set_random_seed``
(megatron/training/initialize.py), reading the torchrun environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training import launch


def select_device(backend: str | None = None) -> torch.device:
    """The device this process computes on: ``cuda:LOCAL_RANK`` with CUDA (unless the backend is
    gloo; ``cuda:0`` for a process given one GPU of its own, said in the start-up output), else
    the CPU.

    Args:
        backend: the requested ``--distributed-backend`` (None: choose from the hardware).

    Raises:
        ValueError: this rank's GPU does not exist, or the node runs more processes than it has
            GPUs (:func:`megatron.training.launch.check_local_device`).
    """
    if torch.cuda.is_available() and backend != "gloo":
        local_world = os.environ.get("LOCAL_WORLD_SIZE")
        local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        torch.cuda.set_device(launch.check_local_device(
            local_rank, count, int(local_world) if local_world else None))
        if launch.one_gpu_per_task(count) and os.environ.get("RANK", "0") == "0":
            print(f" > device: each process is given one GPU (rank 0: LOCAL_RANK={local_rank}, "
                  f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}, as Slurm's "
                  "--gpus-per-task=1): every rank computes on its cuda:0", flush=True)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize_distributed(backend: str | None = None, timeout_minutes: float = 10.0) -> bool:
    """Initialize the default process group from the torchrun environment, unless it exists.

    A world of one process (plain ``python pretrain_llama.py``) needs no environment: it uses a
    local TCP rendezvous on a free port.

    Args:
        backend: ``nccl``, ``gloo`` or None (nccl with CUDA, else gloo).
        timeout_minutes: collective timeout in minutes, fractions allowed
            (``--distributed-timeout-minutes``; Megatron takes whole minutes).

    Returns:
        True if this call created the process group (the caller then destroys it).

    Raises:
        ValueError: for an unknown backend, nccl without CUDA (a ``UsageError``), or two ranks
            on one GPU.
        RuntimeError: ``MASTER_PORT`` is taken by another process (names it).
    """
    if dist.is_initialized():
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"--distributed-backend {backend!r} is not supported; use nccl or gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        from megatron.usage_error import UsageError  # every rank finds it alike: one line, exit 2
        raise UsageError("--distributed-backend nccl needs CUDA, which this machine does not "
                         "have; use --distributed-backend gloo")
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = timedelta(minutes=timeout_minutes)
    launch.die_with_agent()  # a worker whose torchrun agent died must not train on and save
    if "MASTER_ADDR" in os.environ:
        try:
            store = (_elastic_store(rank, world_size, timeout)
                     if "TORCHELASTIC_RESTART_COUNT" in os.environ else None)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        except RuntimeError as exc:  # torch's DistNetworkError for a port taken by another job
            error = launch.port_in_use_error(exc, os.environ["MASTER_ADDR"],
                                             os.environ.get("MASTER_PORT"))
            if error is None:
                raise
            raise error from None
        if backend == "nccl" and world_size > 1:  # ranks sharing a GPU despite distinct LOCAL_RANKs
            launch.check_unique_device(dist.distributed_c10d._get_default_store(), rank,
                                       launch.gpu_identity(torch.cuda.current_device()))
    elif world_size == 1:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, timeout=timeout)
    else:
        raise RuntimeError(f"WORLD_SIZE={world_size} but MASTER_ADDR is not set; "
                           "launch with torchrun (or set MASTER_ADDR and MASTER_PORT)")
    return True


def _elastic_store(rank: int, world_size: int, timeout: timedelta):
    """The torchrun store, under a prefix of this attempt (``TORCHELASTIC_RESTART_COUNT``).

    After ``torchrun --max-restarts`` restarts the workers, the store can still hold the previous
    attempt's gloo addresses under the same keys, and the new workers then try to connect to dead
    peers ("connectFullMesh failed ... Connection refused"); a per-attempt prefix keeps them apart.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=timeout,
                          multi_tenant=not agent_store)
    return dist.PrefixStore(f"megatron/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_random_seed(seed: int, pg_collection) -> int:
    """Seed Python, NumPy, torch and the model-parallel RNG tracker for this rank.

    Megatron's offset: ``seed + 100 * pipeline rank`` (stages draw different dropout masks). The
    tracker then gives each tensor-parallel rank its own stream for dropout inside
    tensor-parallel regions. Weight initialisation does not use these generators (it is seeded
    per submodule from ``ModelConfig.seed``), so the initial weights do not depend on the layout.

    Args:
        seed: ``--seed``.
        pg_collection: this rank's process groups (its pipeline and tensor-parallel ranks).

    Returns:
        the seed used on this rank.
    """
    from megatron.core.tensor_parallel.random import model_parallel_manual_seed

    seed = seed + 100 * pg_collection.pp.rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_manual_seed(seed, pg_collection.tp.rank)
    return seed


def initialize_megatron(config):
    """Distributed start-up of a run: process group, model-parallel groups, seeds.

    Args:
        config: the run's :class:`~megatron.config.Config` (its ``parallel`` section and
            ``training.seed``).

    Returns:
        ``(device, created_process_group, pg_collection)``; pass the flag to :func:`shutdown`,
        the groups to whatever communicates.
    """
    parallel = config.parallel
    device = select_device(parallel.distributed_backend)
    minutes = parallel.distributed_timeout_minutes
    created = initialize_distributed(parallel.distributed_backend, minutes)
    groups = parallel_state.initialize_model_parallel(
        parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size, timeout=timedelta(minutes=minutes),
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size)
    set_random_seed(config.training.seed, groups)
    return device, created, groups


def shutdown(created_process_group: bool) -> None:
    """Forget the model-parallel groups; destroy the process group if :func:`initialize_megatron`
    created it (a test harness that made its own keeps it)."""
    parallel_state.destroy_model_parallel()
    if created_process_group and dist.is_initialized():
        dist.destroy_process_group()

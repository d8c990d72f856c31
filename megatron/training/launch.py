"""Guards of a launched worker process: its GPU, its port and its parent (issue 13).

- Device: rank ``LOCAL_RANK`` computes on ``cuda:LOCAL_RANK`` (Megatron-LM's mapping), except that
  a process given exactly one GPU by ``CUDA_VISIBLE_DEVICES`` (Slurm's ``--gpus-per-task=1``:
  ``LOCAL_RANK=5``, ``CUDA_VISIBLE_DEVICES=5``) computes on that one, ``cuda:0``. A rank
  whose local rank has no GPU, or a node asked to run more processes than it has GPUs, is
  refused (two ranks on one GPU run out of memory or crawl, and NCCL refuses duplicate GPUs
  only later, rank by rank); after the process group exists, ranks that still share a physical
  GPU (per-rank ``CUDA_VISIBLE_DEVICES``, a launcher's own mapping) are found through the store
  by the GPU's UUID.
- Port: a process that has to open ``MASTER_PORT`` itself and finds it taken (another job on
  the machine) says so, naming ``MASTER_PORT``, instead of torch's bare ``EADDRINUSE``.
- Parent: a worker of ``torchrun`` whose agent dies (SIGKILL, OOM killer) would otherwise train
  on and go on writing checkpoints with nobody to stop it; :func:`die_with_agent` has the kernel
  SIGKILL the worker when the agent goes (``prctl(PR_SET_PDEATHSIG)``, Linux), or polls the
  parent elsewhere. A checkpoint being written at that moment stays in its ``.tmp`` folder and
  is never published.
- Data-loader workers: :mod:`megatron.data.loader_workers` (``guard_loader_worker``,
  ``die_with_parent``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from megatron.data.loader_workers import set_parent_death_signal


def one_gpu_per_task(device_count: int) -> bool:
    """Whether this process was given exactly one GPU of its own: it sees one, and
    ``CUDA_VISIBLE_DEVICES`` names exactly one (as Slurm's ``--gpus-per-task=1`` sets it). A
    single-GPU machine without ``CUDA_VISIBLE_DEVICES`` is not such a case: every process there
    would share the GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (device_count == 1 and visible is not None
            and len([v for v in visible.split(",") if v.strip()]) == 1)


def check_local_device(local_rank: int, device_count: int, local_world_size: int | None) -> int:
    """The CUDA device index of this rank: 0 when the process was given one GPU of its own
    (:func:`one_gpu_per_task`; ranks that still share a physical GPU are found later,
    :func:`check_unique_device`), else ``local_rank``, when that GPU exists for every process of
    the node.

    Args:
        local_rank: ``LOCAL_RANK`` (the rank on this node).
        device_count: GPUs this process sees (``torch.cuda.device_count()``).
        local_world_size: ``LOCAL_WORLD_SIZE`` (processes on this node), None when unknown.

    Raises:
        ValueError: more processes than GPUs on the node, or ``local_rank`` beyond the GPUs;
            the message names the variables and the fix.
    """
    if one_gpu_per_task(device_count):
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{device_count} GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
    if local_world_size is not None and local_world_size > device_count:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world_size} processes on this node but it has "
                         f"{seen}: ranks would share a GPU; launch at most {device_count} "
                         "processes per node (torchrun --nproc-per-node), or pass "
                         "--distributed-backend gloo to run on the CPU")
    if not 0 <= local_rank < device_count:
        raise ValueError(f"LOCAL_RANK={local_rank} but this process sees {seen}: no GPU "
                         f"cuda:{local_rank} for it; launch at most {device_count} processes per "
                         "node, or give every process all of the node's GPUs")
    return local_rank


def check_unique_device(store, rank: int, device_id: str, host: str | None = None) -> None:
    """Refuse two ranks of the job on one physical GPU (``device_id``: its UUID) of one host.

    Each rank adds 1 to a counter named after its host and GPU in the job's store; the second
    rank to arrive finds 2 and names the first. One ``add`` per rank: nothing grows with the
    world size.

    Raises:
        ValueError: naming both ranks, the host and the GPU.
    """
    host = host or socket.gethostname()
    key = f"megatron/device/{host}/{device_id}"
    count = store.add(key, 1)
    store.set(f"{key}/{count}", str(rank))
    if count > 1:
        first = store.get(f"{key}/1").decode()
        raise ValueError(f"rank {rank} and rank {first} both compute on GPU {device_id} of "
                         f"{host}: every rank needs a GPU of its own; check LOCAL_RANK and "
                         "CUDA_VISIBLE_DEVICES of the launch (torchrun gives each process "
                         "cuda:LOCAL_RANK of all the node's GPUs)")


def gpu_identity(index: int) -> str:
    """The UUID of CUDA device ``index`` (the same for every process that sees it, whatever
    ``CUDA_VISIBLE_DEVICES`` numbering it has there)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else f"pci-{torch.cuda.get_device_properties(index).pci_bus_id}"


def port_in_use_error(exc: BaseException, host: str, port) -> RuntimeError | None:
    """A message naming ``MASTER_PORT`` for torch's failure to listen on a taken port, else None."""
    text = str(exc)
    if "EADDRINUSE" not in text and "address already in use" not in text.lower():
        return None
    return RuntimeError(f"MASTER_PORT={port} is already in use on {host} (another job, or an "
                        "earlier run still exiting): choose a free MASTER_PORT, or launch single-"
                        "node jobs with torchrun --standalone, which picks one")


def die_with_agent(poll_seconds: float = 1.0, use_prctl: bool = True) -> str | None:
    """Under ``torchrun`` (``TORCHELASTIC_RUN_ID`` set), end this worker when its agent dies.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so the kernel kills the worker the moment its
    parent exits, whatever the worker is doing (torchrun starts workers from its main thread,
    which lives as long as the agent). Elsewhere: a daemon thread compares ``os.getppid()`` with
    the agent's pid every ``poll_seconds`` and kills the process when they differ. An agent
    that dies while the guard is being set is noticed too.

    Args:
        poll_seconds: the polling period where ``prctl`` is not used.
        use_prctl: False forces the polling thread (tests).

    Returns:
        "prctl", "poll", or None when not under torchrun (nothing installed).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent = os.getppid()
    how = "prctl" if use_prctl and set_parent_death_signal(signal.SIGKILL) else "poll"
    if os.getppid() != parent:  # the agent died while the guard was being set
        _orphaned(parent)
    if how == "poll":
        def watch():
            while os.getppid() == parent:
                time.sleep(poll_seconds)
            _orphaned(parent)

        threading.Thread(target=watch, name="die-with-agent", daemon=True).start()
    return how


def _orphaned(parent: int) -> None:
    print(f"rank {os.environ.get('RANK', '?')}: the torchrun agent (pid {parent}) is gone; "
          "stopping without saving", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

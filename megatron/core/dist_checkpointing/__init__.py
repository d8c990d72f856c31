"""Distributed checkpoints: each rank saves its shards of layout-free global tensors, any layout
loads them (``--ckpt-format torch_dist``; Megatron-Core's ``dist_checkpointing``, built on
``torch.distributed.checkpoint``).

Design (the decisions, and why):

* **Global tensors, not per-rank files.** A checkpoint holds the tensors a single process would
  hold (``model.<key>``, ``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<key>``), each written
  as boxes with global offsets (:mod:`.mapping`). Loading at another TP / PP / virtual-stage / DP
  layout, or with the other optimizer, is only a different set of boxes to read: DCP intersects
  them with the saved ones (:mod:`.storage`). No converter, no gather to one rank.
* **No copies to make a tensor layout-free.** A TP partition is a slice of its global tensor.
  Our fused weights (rows ``[q_r; k_r; v_r]`` and ``[gate_r; up_r]`` on rank r) are not slices of
  one TP-independent tensor; they are saved as separate global tensors ``query``/``key``/
  ``value`` and ``gate``/``up``, each local block a view (Megatron-Core instead orders QKV per
  query group, which needs a local reorder; separate tensors also keep the distributed
  optimizer's pieces few boxes). Layers are numbered globally, so PP stages and virtual stages
  map onto the same keys; the tied embedding's copy on the last stage is the first stage's key,
  written once.
* **Distributed-optimizer state is saved where it lives.** A DP rank owns a contiguous flat range
  of each bucket, covering pieces of parameters (partial rows included). A piece of a 2-D
  parameter is at most three boxes per global tensor (partial first row, whole rows, partial last
  row), all views of the shard (DCP's metadata allows any number of boxes per rank); bucket
  padding is never saved. So a plain optimizer's checkpoint (each tensor whole, replicated over
  DP) and a distributed one describe the same global tensors, and load into each other.
* **Writers chosen explicitly.** Every box held by several ranks (DP copies, TP duplicates such
  as norms, the tied embedding) has exactly one writer: TP duplicates on TP rank 0, the tied copy
  on the first stage, DP copies spread over the DP ranks by bytes (:func:`.mapping.balance_writers`).
  Saving checks that the written boxes of each tensor cover it exactly once.
* **Nothing from a checkpoint is executed.** Boxes are read with ``torch.load(weights_only=True)``,
  DCP's pickled ``.metadata`` by an unpickler that builds its metadata classes only; the rest of
  a checkpoint (iteration, scheduler, RNG, args) is plain data next to it, never pickled classes.
* **Asynchronous saving** (:mod:`.async_writer`): a host copy, then a background thread writes on
  a process group of its own; publishing is the caller's, once every rank has finished.

New parameter or optimizer layouts (ZeRO-3, context parallelism) plug in by producing boxes in
the same global keys: a ``ParamSharding`` per parameter gives the boxes of a whole local tensor or
of a flat range of it (:mod:`megatron.core.optimizer.sharded_state` shows both).
"""

import importlib

from megatron.core.dist_checkpointing.errors import (METADATA_FILE, CheckpointFormatError,
                                                     CheckpointWriteError)
from megatron.core.dist_checkpointing.mapping import (ParamSharding, Region, ShardedTensor,
                                                      balance_writers, balance_writers_by_group)

# :mod:`.storage` imports ``torch.distributed.checkpoint`` (with DTensor and sympy: about a second
# per process), so it is imported on first use of one of its functions, not with the package.
_STORAGE_NAMES = ("check_fits", "check_save_id", "load", "read_metadata", "save", "tensor_shapes")


def __getattr__(name):
    if name in _STORAGE_NAMES or name == "storage":
        storage = importlib.import_module("megatron.core.dist_checkpointing.storage")
        return storage if name == "storage" else getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ParamSharding", "Region", "ShardedTensor", "balance_writers",
           "balance_writers_by_group", "METADATA_FILE", "CheckpointFormatError",
           "CheckpointWriteError", "check_fits", "check_save_id", "load", "read_metadata", "save",
           "tensor_shapes"]

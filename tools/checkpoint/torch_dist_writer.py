"""``convert.py --saver megatron --target-ckpt-format torch_dist``: a ``release`` checkpoint in
our distributed format (:mod:`megatron.checkpointing.torch_dist`), which ``--load`` reshards to
any TP / PP / EP layout.

The converter first writes the TP = PP = EP = 1 legacy shard; this module builds the model of
its recorded ``args`` in this process alone (a world of one: no process group), loads the shard
into it and saves the model's own global boxes (:func:`megatron.model.sharded_state.
model_sharded_tensors`: the names, fused-block splits and expert axis a training run writes)
with ``common.pt`` holding the args. Memory: the whole model once, in the checkpoint's dtype.
"""

from __future__ import annotations

import os
import shutil

from megatron.checkpointing import checkpoint_folder
from megatron.checkpointing import torch_dist
from megatron.core.dist_checkpointing.checkpoint_io import load_torch_file
from megatron.core import dist_checkpointing as dcp
from megatron.core.process_groups import ProcessGroupCollection
from megatron.inference.model_loader import model_config_from_args, moe_config_for_inference
from megatron.model import get_layer_numbers
from megatron.model.llama import LlamaModel
from megatron.model.sharded_state import model_sharded_tensors


def write_release(shard: str, save_dir: str) -> str:
    """Write ``save_dir/release`` in the torch_dist format from the TP = PP = 1 legacy shard file
    ``shard`` (its ``model`` and ``args``), then the tracker; returns the folder.

    Raises:
        RuntimeError / KeyError: the shard does not fit the model its args describe (a bug of
            the converter: the legacy shard was written from the same args).
    """
    state = load_torch_file(shard, what="converted shard", mmap=True)
    saved = state["args"]
    groups = ProcessGroupCollection.world_of_one()
    config = model_config_from_args(saved)
    model = LlamaModel(config, pg_collection=groups, pre_process=True, post_process=True,
                       layer_numbers=get_layer_numbers(config.num_layers, 1, 0),
                       moe_config=moe_config_for_inference(saved))
    model.load_state_dict(state["model"], strict=True)
    boxes = dcp.balance_writers_by_group(model_sharded_tensors([model], groups), 0)
    final = checkpoint_folder.get_checkpoint_dir(save_dir, 0, release=True)
    staging = final + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        save_id = dcp.save(boxes, staging)
        common = torch_dist.common_state(0, None, None, saved, torch_dist.Layout(), None, 0, 0)
        torch_dist._write_common(staging, dict(common, save_id=save_id))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.replace(staging, final)
    tracker = checkpoint_folder.get_checkpoint_tracker_filename(save_dir)
    with open(tracker + ".tmp", "w", encoding="utf-8") as f:
        f.write("release")
    os.replace(tracker + ".tmp", tracker)
    return final

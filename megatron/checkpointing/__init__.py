"""Checkpoints: a light dispatcher over the two formats, which never import each other.

- :mod:`.legacy`: Megatron-LM's legacy layout (``--ckpt-format torch``), loaded at the layout it
  was saved with;
- :mod:`.torch_dist`: the sharded ``torch_dist`` format, loaded at any layout;
- :mod:`.checkpoint_folder`: what both share (tracker file, ``iter_XXXXXXX`` folders, staging and
  publishing, ``--keep-last-checkpoints``, agreeing on errors);
- :mod:`.save_folder`: the ``--save`` folder's lock and the resume policy of ``--load``;
- :mod:`.rng_state`: the RNG states a checkpoint carries;
- :mod:`.foreign`: other systems' checkpoints (Megatron-LM, Megatron-LLaMA) in the legacy layout.

This module picks the format: by ``--ckpt-format`` to save, by the folder's contents to load. A
resume reads the tracker file once (:func:`resume_point`) and passes ``found`` down.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron.checkpointing import legacy, torch_dist
from megatron.checkpointing.checkpoint_folder import (TRACKER_FILENAME, complete_checkpoints,
                                                     find_checkpoint, get_checkpoint_dir,
                                                     get_checkpoint_tracker_filename,
                                                     read_metadata)
from megatron.checkpointing.legacy import (CHECKPOINT_VERSION, checkpoint_name_of,
                                           distrib_optim_filename, get_checkpoint_name,
                                           read_saved_args, saved_layout)
from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError, CheckpointUsageError
from megatron.model import unwrap_model
from megatron.usage_error import UsageError

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "TRACKER_FILENAME", "checkpoint_name_of",
           "distrib_optim_filename", "find_checkpoint", "get_checkpoint_dir", "get_checkpoint_name",
           "get_checkpoint_tracker_filename", "last_complete_hint", "load_checkpoint",
           "looks_complete", "read_metadata", "read_saved_args", "resume_point",
           "save_checkpoint", "saved_layout", "weights_will_be_loaded"]

# ``found`` not read yet: load_checkpoint / weights_will_be_loaded read the tracker themselves.
NOT_READ = object()


def looks_complete(folder: str) -> bool:
    """Whether the checkpoint ``folder`` (either format) is whole: every file present, none left
    half-written."""
    try:
        if torch_dist.is_torch_dist_checkpoint(folder):
            return torch_dist.looks_complete(folder)
    except CheckpointError:  # a metadata.json that is no file: not complete
        return False
    return legacy.looks_complete(folder)


def last_complete_hint(load_dir: str, broken_folder: str) -> str:
    """A sentence naming the newest complete checkpoint under ``load_dir`` other than
    ``broken_folder`` and how to resume from it (rewrite the tracker file)."""
    import os

    others = [d for d in complete_checkpoints(load_dir)
              if os.path.abspath(d) != os.path.abspath(broken_folder) and looks_complete(d)]
    if not others:
        return f" No other complete checkpoint is in {load_dir}."
    last = others[-1]
    number = int(os.path.basename(last)[len("iter_"):])
    return (f" The last complete checkpoint is {last}: to resume from it, write {number} into "
            f"{get_checkpoint_tracker_filename(load_dir)}.")


def resume_point(load_dir: str) -> tuple[int, bool] | None:
    """``(iteration, release)`` named by ``--load``'s tracker file (read once), or None if absent.

    Raises:
        UsageError: the tracker is no regular file or names no iteration: one line naming it,
            the fix and the last complete checkpoint.
    """
    try:
        return find_checkpoint(load_dir)  # the same file on every rank: all raise alike
    except CheckpointError as exc:
        raise UsageError(f"--load ({load_dir}): {exc}; write the iteration of a complete "
                         "checkpoint there (iter_0000100 -> 100), or delete the file to start "
                         f"from scratch.{last_complete_hint(load_dir, '')}") from None


def weights_will_be_loaded(config, found=NOT_READ) -> bool:
    """True when :func:`load_checkpoint` will fill every model parameter (``--load`` names a
    checkpoint: strict loads refuse a missing tensor), so the model need not draw initial
    weights. ``config``: the run's :class:`~megatron.config.CheckpointConfig`; ``found``:
    :func:`resume_point`'s answer when already read."""
    if found is NOT_READ:
        found = find_checkpoint(config.load) if config.load else None
    return bool(config.load) and found is not None


def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, config,
                    pg_collection, *, run_flags: dict, consumed_train_samples: int,
                    consumed_valid_samples: int, protect=(), saver=None):
    """Save a checkpoint of ``iteration`` under ``config.save`` in ``config.ckpt_format``.
    Collective over the world.

    Args:
        config: the run's :class:`~megatron.config.CheckpointConfig`.
        saver: ``torch_dist`` only: the :class:`~.torch_dist.TorchDistSaver` keeping a pending
            ``--async-save``; None: a synchronous one over a checkpoint group made here.

    Returns:
        the published folder, or None for an asynchronous save.

    Raises:
        CheckpointError: on every rank if any rank failed to write (:func:`.legacy.save_checkpoint`,
            :meth:`.torch_dist.TorchDistSaver.save`).
    """
    consumed = dict(consumed_train_samples=consumed_train_samples,
                    consumed_valid_samples=consumed_valid_samples)
    if config.ckpt_format != "torch_dist":
        return legacy.save_checkpoint(iteration, model_chunks, optimizer, opt_param_scheduler,
                                      config, pg_collection, run_flags=run_flags,
                                      protect=protect, **consumed)
    group = None
    if saver is None:
        group = torch_dist.checkpoint_group()
        device = next(unwrap_model(model_chunks[0]).parameters()).device
        saver = torch_dist.TorchDistSaver(config.save, group, device,
                                          keep_last=config.keep_last_checkpoints)
    try:
        return saver.save(iteration, model_chunks, optimizer, opt_param_scheduler, config,
                          torch_dist.Layout.of(pg_collection, optimizer), run_flags=run_flags,
                          protect=protect, **consumed)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def load_checkpoint(model_chunks, optimizer, opt_param_scheduler, config, pg_collection, *,
                    run_flags: dict, group=None, found=NOT_READ) -> dict:
    """:func:`_load_checkpoint`, every :class:`CheckpointError` a usage error: one line by the
    lowest rank that found it (agreed where only some ranks find it, else found by every rank
    alike: rank 0 prints), status 2 on every rank (:mod:`megatron.usage_error`).

    Raises:
        UsageError: the checkpoint cannot be loaded as asked (missing, damaged, refused, saved at
            another layout, a model that does not fit, a resume the flags do not allow).
    """
    try:
        return _load_checkpoint(model_chunks, optimizer, opt_param_scheduler, config,
                                pg_collection, run_flags=run_flags, group=group, found=found)
    except UsageError:
        raise
    except CheckpointError as exc:  # raised on every rank alike (the others were agreed on)
        raise CheckpointUsageError(str(exc)) from None


def _load_checkpoint(model_chunks, optimizer, opt_param_scheduler, config, pg_collection, *,
                     run_flags: dict, group=None, found=NOT_READ) -> dict:
    """Load ``config.load`` into the model (and optimizer, scheduler, RNG unless told otherwise),
    whichever format it has: legacy (at the layout it was saved with) or ``torch_dist`` (at any
    layout; :mod:`megatron.checkpointing.torch_dist`, over the checkpoints' gloo ``group``, made
    here when None).

    ``--finetune`` and ``release`` checkpoints load the weights only and start at iteration 0;
    ``--no-load-optim`` / ``--no-load-rng`` skip those parts. Without optimizer state loaded, the
    optimizer's fp32 main parameters are refreshed from the loaded weights.

    Args:
        config: the run's :class:`~megatron.config.CheckpointConfig` (``load``, ``finetune``,
            ``no_load_optim``, ``no_load_rng``).
        pg_collection: this rank's process groups (which shard it reads; its DP rank's RNG).
        run_flags: the run's plain ``args`` (:func:`megatron.config.checkpoint_args`): another
            system's checkpoint is checked against its model values.
        found: :func:`resume_point` of ``config.load`` when the caller read it already (the
            tracker file is read once per resume), else read here.

    Returns:
        dict with ``iteration``, ``consumed_train_samples``, ``consumed_valid_samples`` (zeros when
        there is nothing to load: a fresh start).

    Raises:
        CheckpointError: ``--finetune`` with no checkpoint; a missing, corrupt or misfitting shard.
    """
    fresh = {"iteration": 0, "consumed_train_samples": 0, "consumed_valid_samples": 0}
    load_dir = config.load
    if found is NOT_READ:
        found = resume_point(load_dir)
    if found is None:
        if config.finetune:
            raise CheckpointError(f"--finetune needs a checkpoint, but --load {load_dir} has no "
                                  f"{TRACKER_FILENAME}")
        if dist.get_rank() == 0:
            print(f" no checkpoint found at --load {load_dir} ({TRACKER_FILENAME} missing); "
                  "starting from scratch", flush=True)
        return fresh
    iteration, release = found
    folder = get_checkpoint_dir(load_dir, iteration, release)

    def explain(message: str) -> str:  # a failure names the checkpoint to fall back on
        return message.rstrip(".") + "." + last_complete_hint(load_dir, folder)

    if torch_dist.is_torch_dist_checkpoint(folder):
        from megatron.checkpointing.foreign import megatron_lm_dist
        if megatron_lm_dist.is_megatron_lm(folder):  # Megatron-LM's own: weights, any layout
            return megatron_lm_dist.load_into(folder, model_chunks, optimizer, config,
                                              pg_collection, run_flags)
        loaded = _load_torch_dist(folder, model_chunks, optimizer, opt_param_scheduler, config,
                                  pg_collection, group, run_flags, explain)
    else:
        loaded = legacy.load_checkpoint(load_dir, iteration, release, model_chunks, optimizer,
                                        opt_param_scheduler, config, pg_collection,
                                        run_flags=run_flags, explain=explain)
    if not (release or config.finetune) and loaded["iteration"] != iteration \
            and _written_here(folder):
        # A folder copied over another's name: resuming would replay or skip data and the
        # learning-rate schedule, silently (every rank read the same record: all raise alike).
        raise CheckpointError(explain(
            f"{folder} holds the checkpoint of iteration {loaded['iteration']} (its files say "
            f"so), not of iteration {iteration} as its name and {TRACKER_FILENAME} do: a folder "
            "copied over another's name? Rename it to match the iteration its files hold, or "
            "restore that iteration's files"))
    return loaded


def _written_here(folder: str) -> bool:
    """Whether the checkpoint ``folder`` was saved by this code (its legacy shards hold plain
    data only; Megatron-LM's pickle its argparse namespace). Megatron-LM's own tools write
    folders whose files record another iteration than their name (its ``mixtral-tiny`` vector:
    ``iter_0000001`` holding iteration 0), and Megatron-LM resumes from the files' value, so
    only ours are held to their name."""
    import torch

    from megatron.checkpointing import foreign

    shard = foreign.first_shard(folder)
    if shard is None:  # torch_dist: Megatron-LM's own returned before the check
        return True
    try:
        return not torch.serialization.get_unsafe_globals_in_checkpoint(shard)
    except Exception:  # noqa: BLE001 - damaged: the load above would have said so
        return True


def _load_torch_dist(folder, model_chunks, optimizer, opt_param_scheduler, config, pg_collection,
                     group, run_flags, explain) -> dict:
    made = group is None
    if made:
        group = torch_dist.checkpoint_group()
    try:
        return torch_dist.load_checkpoint(folder, model_chunks, optimizer, opt_param_scheduler,
                                          config, torch_dist.Layout.of(pg_collection, optimizer),
                                          group, run_flags=run_flags, explain=explain)
    except (torch_dist.CheckpointMismatchError, UsageError):
        raise  # the flags' to fix (no other checkpoint would fit either), or agreed and said
    except CheckpointError as exc:  # raised by every rank alike (DCP's read gathers failures)
        raise CheckpointError(explain(str(exc))) from None
    finally:
        if made:
            dist.destroy_process_group(group)

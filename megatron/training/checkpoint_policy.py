"""The checkpoint policy of a training run: when to save, the asynchronous saves, what
``--keep-last-checkpoints`` keeps, the non-finite rules and the early exits.

Moved out of the training loop (:mod:`megatron.training.train`) unchanged: Megatron-LM's
``save_checkpoint_and_time`` / ``--save-interval`` / ``--exit-interval`` /
``--exit-signal-handler`` / ``--exit-duration-in-mins`` handling in ``train``
(megatron/training/training.py), with this project's ``--max-consecutive-nan-iterations`` rule.
"""

from __future__ import annotations

import os
import time

from megatron import checkpointing
from megatron.checkpointing import torch_dist
from megatron.training.logging import print_rank_0
from megatron.training.resilience import ExitConditions, collective_guard


class NonFiniteTrainingError(RuntimeError):
    """Raised on every rank after ``--max-consecutive-nan-iterations`` non-finite iterations in a
    row (:func:`nonfinite_iteration`); no checkpoint is written on the way out."""


def loss_scale_at_floor(optimizer) -> bool:
    """Whether the fp16 loss scale cannot back off any further: a constant ``--loss-scale``, or
    the dynamic scale at ``--min-loss-scale``. False without a loss scaler (bf16, fp32)."""
    scaler = optimizer.grad_scaler
    if scaler is None:
        return False
    floor = scaler.min_scale
    return floor is None or float(scaler.scale) <= float(floor)


def nonfinite_iteration(skipped: int, optimizer, scale_was_at_floor: bool) -> bool:
    """Whether an iteration was non-finite, the "trouble" that stops saves and, repeated
    ``--max-consecutive-nan-iterations`` times, the run: its step was skipped for an inf/NaN
    loss or gradient (the optimizer's flag, all-reduced: equal on every rank), except an fp16
    overflow the dynamic loss scaler answers by lowering the scale (routine, Megatron's
    "skipped iterations"). An fp16 overflow at a scale that cannot go lower
    (:func:`loss_scale_at_floor`, read before the step) is trouble."""
    if not skipped:
        return False
    return optimizer.grad_scaler is None or scale_was_at_floor


class CheckpointPolicy:
    """Saves, publications and stops of one run, called by the loop once per iteration.

    Args:
        config: the run's :class:`~megatron.config.Config`.
        pg_collection: the run's process groups.
        device: the collective backend's device (exit agreement, async-save finalisation).
        state: the loop's ``TrainState`` (iteration and consumed samples, read at each save).
        model, optimizer, scheduler: what a checkpoint holds.
        run_flags: what every checkpoint of the run records (``checkpoint_args``).
        start_time: ``time.time()`` at the start of the program (``--exit-duration-in-mins``).
        checkpoint_group: the gloo group of ``--ckpt-format torch_dist`` saves, or None.
        resume: ``--load``'s tracker as :func:`megatron.checkpointing.resume_point` read it.

    Raises (from :meth:`stop_after_nan_streak`):
        NonFiniteTrainingError: after ``--max-consecutive-nan-iterations`` non-finite iterations.
    """

    def __init__(self, config, pg_collection, device, state, model, optimizer, scheduler,
                 run_flags: dict, start_time: float, checkpoint_group=None, *,
                 resume=checkpointing.NOT_READ):
        self.config, self.groups, self.state = config, pg_collection, state
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.run_flags = run_flags
        training = config.training
        self.exit = ExitConditions(training.exit_signal_handler, training.exit_duration_in_mins,
                                   start_time, device)
        self.timeout = config.parallel.distributed_timeout_minutes
        self.nan_streak = 0  # consecutive non-finite iterations (nonfinite_iteration)
        self.last_good, self.newest_in_save = _starting_checkpoints(config.checkpoint, resume)
        self.protected = None  # the checkpoint --keep-last-checkpoints keeps (see save())
        self.trouble_at = None  # the latest non-finite iteration
        self.saver = None  # --ckpt-format torch_dist: keeps the pending --async-save
        checkpoint = config.checkpoint
        if checkpoint.save and checkpoint.ckpt_format == "torch_dist":
            self.saver = torch_dist.TorchDistSaver(
                checkpoint.save, checkpoint_group, device, async_save=checkpoint.async_save,
                keep_last=checkpoint.keep_last_checkpoints)

    def after_iteration(self) -> bool:
        """``--save-interval``, then ``--exit-interval``, the signal and the wall-clock budget
        (every rank agrees), each with its save. Returns False when the run must stop now."""
        training, checkpoint, st = self.config.training, self.config.checkpoint, self.state
        saved = False
        if (checkpoint.save and checkpoint.save_interval
                and st.iteration % checkpoint.save_interval == 0):
            self.save("--save-interval")
            saved = True
        if training.exit_interval and st.iteration % training.exit_interval == 0:
            if checkpoint.save and not saved:
                self.save("--exit-interval")
            self.finalize_save(blocking=True)
            print_rank_0(f"exiting program at iteration {st.iteration}")
            return False
        reason = self.exit.check()  # every rank agrees: all stop after the same iteration
        if reason:
            if checkpoint.save and not saved:
                self.save("SIGTERM" if reason == "signal" else "--exit-duration-in-mins")
            self.finalize_save(blocking=True)
            print_rank_0(f"exiting program at iteration {st.iteration} "
                         + ("after receiving SIGTERM" if reason == "signal" else
                            f"after {training.exit_duration_in_mins:g} minutes "
                            "(--exit-duration-in-mins)"))
            return False
        return True

    def at_end(self) -> None:
        """The end of training: save the last iteration unless ``--save-interval`` just did, and
        wait for a pending ``--async-save``."""
        checkpoint, st = self.config.checkpoint, self.state
        if checkpoint.save and st.iteration > 0 and (
                not checkpoint.save_interval or st.iteration % checkpoint.save_interval != 0):
            self.save("the end of training")
        self.finalize_save(blocking=True)

    @property
    def abandoned(self) -> bool:
        """Whether an ``--async-save`` is still being written (its group and lock must stay)."""
        return bool(self.saver is not None and self.saver.pending)

    def stop_after_nan_streak(self, nonfinite: bool) -> None:
        """Count non-finite iterations in a row (equal on every rank); at each one, the newest
        checkpoint in ``--save`` becomes the one ``--keep-last-checkpoints`` keeps; raise after
        ``--max-consecutive-nan-iterations`` of them.

        Raises:
            NonFiniteTrainingError: naming the iterations and the last good checkpoint, left
                intact (nothing is saved on the way out).
        """
        self.nan_streak = self.nan_streak + 1 if nonfinite else 0
        if nonfinite:
            self.protected, self.trouble_at = self.newest_in_save, self.state.iteration
        limit = self.config.training.max_consecutive_nan_iterations
        if not limit or self.nan_streak < limit:
            return
        # A checkpoint handed to the background writer before the streak holds a finite state:
        # published now, it is the last good one the message names.
        self.finalize_save(blocking=True)
        it = self.state.iteration
        message = (f"training stopped at iteration {it}: {self._streak_text()} "
                   f"({self.nan_streak} in a row, --max-consecutive-nan-iterations {limit}), each "
                   f"skipped without an update; {self._last_good_text()}. "
                   f"{self._remedy()}")
        print_rank_0(message)
        raise NonFiniteTrainingError(message)

    def _streak_text(self) -> str:
        it, n = self.state.iteration, self.nan_streak
        span = f"iteration {it}" if n == 1 else f"iterations {it - n + 1} to {it}"
        scaler = self.optimizer.grad_scaler
        if scaler is None:
            return f"{span} had inf/NaN loss or gradients"
        floor = scaler.min_scale
        at = (f"the lowest loss scale (--min-loss-scale {float(floor):g})" if floor is not None
              else f"the constant --loss-scale {float(scaler.scale):g}")
        return f"{span} overflowed in fp16 (inf/NaN loss or gradients) at {at}"

    def _remedy(self) -> str:
        fp16 = self.optimizer.grad_scaler is not None
        return ("Lower --lr, check the data" + (", use --bf16" if fp16 else "")
                + ", or raise --max-consecutive-nan-iterations (0 = never stop).")

    def _last_good_text(self) -> str:
        if self.last_good is None:
            return "no checkpoint of this run was written"
        iteration, folder, root = self.last_good
        return (f"the last good checkpoint, iteration {iteration} in {folder}, is left as it "
                f"was: resume from it with --load {root}")

    def save(self, requested_by: str) -> None:
        """Save this iteration's checkpoint, unless it is non-finite (inside a streak of
        :func:`nonfinite_iteration`): then the save is skipped, saying so, so that the last good
        checkpoint stays the newest one. ``--keep-last-checkpoints`` never deletes the newest
        checkpoint written before the run's latest non-finite iteration (``self.protected``)."""
        st = self.state
        if self.nan_streak:
            print_rank_0(f" not saving the checkpoint of iteration {st.iteration} "
                         f"({requested_by}): {self._streak_text()}; "
                         f"{self._last_good_text()}")
            return
        start = time.perf_counter()
        if self.saver is not None:
            self.finalize_save(blocking=True)  # the pending save first (and its message)
        with collective_guard(f"the checkpoint save of iteration {st.iteration}", self.timeout):
            folder = save_checkpoint(self.config.checkpoint, st, self.model, self.optimizer,
                                     self.scheduler, self.groups, self.run_flags, self.saver,
                                     protect=self._protect())
        if folder is None:
            print_rank_0(f"  checkpoint of iteration {st.iteration:7d} handed to the background "
                         f"writer [ t {time.perf_counter() - start:.2f}s ]")
            return
        self._published(st.iteration, folder)
        print_rank_0(f"  successfully saved checkpoint at iteration {st.iteration:7d} to {folder} "
                     f"[ t {time.perf_counter() - start:.2f}s ]")

    def finalize_save(self, blocking: bool) -> None:
        """``--async-save``: publish the pending checkpoint once every rank has written it (one
        all-reduce per iteration while one is pending; see megatron/checkpointing/torch_dist.py)."""
        if self.saver is None or self.saver.pending is None:
            return
        pending = self.saver.pending
        with collective_guard(f"the background save of iteration {pending.iteration}", self.timeout):
            folder = self.saver.finalize(blocking, protect=self._protect())
        if folder is not None:
            self._published(pending.iteration, folder)
            print_rank_0(f"  successfully saved checkpoint at iteration {pending.iteration:7d} to "
                         f"{folder} in the background [ written in "
                         f"{pending.write.seconds or 0.0:.2f}s, published at iteration "
                         f"{self.state.iteration} ]")

    def _protect(self) -> tuple:
        """What the next publication's ``--keep-last-checkpoints`` must keep: the newest
        checkpoint written before the latest non-finite iteration. An asynchronous save handed
        off before that iteration (its state finite) is published later, keeping this one, and
        then becomes the protected one itself (:meth:`_published`)."""
        return (self.protected,) if self.protected else ()

    def _published(self, iteration: int, folder: str) -> None:
        self.last_good = (iteration, folder, self.config.checkpoint.save)
        self.newest_in_save = folder
        if self.trouble_at is not None and iteration < self.trouble_at:
            # An --async-save handed off before the trouble, published after it: now the newest
            # checkpoint written before the trouble, the one to keep.
            self.protected = folder


def save_checkpoint(config, state, model, optimizer, scheduler, pg_collection,
                    run_flags: dict, saver=None, protect=()):
    """Save ``state.iteration`` in ``config.ckpt_format`` (a
    :class:`~megatron.config.CheckpointConfig`) under ``config.save``: legacy, or torch_dist with
    ``saver`` (made here when None: synchronous). ``protect``: folders ``--keep-last-checkpoints``
    keeps (either format). Returns the published folder, or None for an asynchronous save."""
    return checkpointing.save_checkpoint(state.iteration, model, optimizer, scheduler, config,
                                         pg_collection, run_flags=run_flags, protect=protect,
                                         saver=saver,
                                         consumed_train_samples=state.consumed_train_samples,
                                         consumed_valid_samples=state.consumed_valid_samples)


def _starting_checkpoints(checkpoint, resume=checkpointing.NOT_READ):
    """``(last_good, newest_in_save)`` at the start of a run (a
    :class:`~megatron.config.CheckpointConfig`): the checkpoint ``--load`` names (iteration,
    folder, the folder with its tracker), the run's starting point; and the newest checkpoint
    folder in ``--save``, which ``--keep-last-checkpoints`` could delete. ``resume``: ``--load``'s
    tracker as :func:`megatron.checkpointing.resume_point` read it (also ``--save``'s when the
    same folder), not read again."""
    def named(root):
        try:
            if resume is not checkpointing.NOT_READ and root and root == checkpoint.load:
                found = resume
            else:
                found = checkpointing.find_checkpoint(root) if root else None
        except checkpointing.CheckpointError:
            return None
        if found is None:
            return None
        folder = checkpointing.get_checkpoint_dir(root, *found)
        return ("release" if found[1] else found[0], folder, root) if os.path.isdir(folder) \
            else None

    loaded, in_save = named(checkpoint.load), named(checkpoint.save)
    return loaded, (in_save[1] if in_save is not None else None)

"""The training program: set-up, the training loop, evaluation, checkpoints and logging.

Follows Megatron-LM's ``pretrain`` / ``train`` / ``train_step`` / ``evaluate`` /
``training_log`` (megatron/training/training.py), with the frozen configuration
(:class:`megatron.config.Config`) and the process groups
(:class:`megatron.core.process_groups.ProcessGroupCollection`) passed down explicitly instead of a
global ``get_args()``. The model-specific parts come from the entry script (``pretrain_llama.py``):
a model provider, a forward step and a datasets provider.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron import checkpointing
from megatron.checkpointing import save_folder, torch_dist
from megatron.config import checkpoint_args
from megatron.core.distributed.model_chunk import as_model_chunk
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.model.flops import num_floating_point_operations as model_flops
from megatron.training import builders
from megatron.training.initialize import initialize_megatron, shutdown
from megatron.training.logging import (IterationProgress, TensorBoardLogger,
                                       format_iteration_line, format_validation_block,
                                       memory_report, print_rank_0, print_rank_last)
from megatron.training.compile import compile_transformer_layers
from megatron.training.mfu import model_flops_utilization, resolve_peak_tflops
from megatron.core.num_microbatches_calculator import build_num_microbatches_calculator
from megatron.training.moe_bias import update_expert_biases
from megatron.training.moe_global_counts import count_global_batch, needs_global_counts
from megatron.training.moe_logging import moe_iteration_metrics, reset_moe_metrics
from megatron.training.resilience import ExitConditions, collective_guard
from megatron.training.startup_report import StartupReport
from megatron.training.wandb_writer import open_wandb


@dataclass
class TrainState:
    """What the loop advances; saved in and restored from checkpoints."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    history: dict = field(default_factory=lambda: {
        "iteration": [], "lm loss": [], "grad norm": [], "learning rate": [], "valid": [],
        "global batch size": [], "consumed samples": [], "loss scale": [], "skipped": [],
        "nan": []})


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


def reduce_loss_dicts(loss_dicts: list) -> dict:
    """Megatron-Core's reduction of the per-micro-batch ``{key: (sum, count)}`` dicts into
    ``{key: sum / count}`` (a token-weighted mean over the global batch; floats)."""
    out = {}
    for key in (loss_dicts[0] if loss_dicts else {}):
        num = den = 0.0
        for d in loss_dicts:
            v = d[key]
            if isinstance(v, (tuple, list)):
                num, den = num + float(v[0]), den + float(v[1])
            else:
                num, den = num + float(v), den + 1.0
        out[key] = num / max(den, 1e-30)
    return out


def nonfinite_loss_flag(loss_dicts: list):
    """True (a 0-dim bool tensor on the losses' device, no host read) when a loss sum of the
    per-micro-batch ``{key: (sum, count)}`` dicts is inf/NaN: what makes a value of
    :func:`reduce_loss_dicts` non-finite. False when there is no loss."""
    sums = [v[0] if isinstance(v, (tuple, list)) else v for d in loss_dicts for v in d.values()]
    if not sums:
        return False
    device = next((v.device for v in sums if isinstance(v, torch.Tensor)), torch.device("cpu"))
    values = torch.stack([torch.as_tensor(v, device=device).float().reshape(()) for v in sums])
    return ~torch.isfinite(values).all()


def num_floating_point_operations(config, batch_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward) of a run's configuration:
    :func:`megatron.model.flops.num_floating_point_operations` (Megatron-LM's formula; active
    FLOPs of a mixture-of-experts model)."""
    return model_flops(config.model, batch_size, config.data.seq_length,
                       getattr(config, "moe", None))


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *,
               config, schedule_config, num_microbatches: int, global_batch_size: int,
               pg_collection, before_optimizer_step=None):
    """One iteration: forward/backward over ``num_microbatches`` micro-batches, optimizer step,
    lr step by ``global_batch_size`` samples. ``before_optimizer_step()``, if given, runs between
    the backward and the step (``--async-save`` waits there for its host copy).

    Returns:
        ``(losses {key: float} on the last stage else {}, skipped 0|1, grad_norm, num_zeros)``.
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if needs_global_counts(getattr(config, "moe", None)):  # global_aux_loss: count first
        data_iterator = count_global_batch(
            forward_step_func, data_iterator, model, num_microbatches=num_microbatches,
            seq_length=config.data.seq_length, micro_batch_size=config.training.micro_batch_size,
            schedule_config=schedule_config, pg_collection=pg_collection)
    losses = get_forward_backward_func(pg_collection)(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=config.data.seq_length,
        micro_batch_size=config.training.micro_batch_size, forward_only=False,
        config=schedule_config, pg_collection=pg_collection)
    last_stage = pg_collection.is_pipeline_last_stage()
    # Only the last stage sees the loss: the optimizer folds this flag into its found-inf
    # all-reduce, so an inf/NaN loss skips the step on every rank alike. A device tensor, and the
    # losses are read on the host only after the step: on CUDA nothing waits for the GPU before
    # the optimizer's kernels are queued.
    if before_optimizer_step is not None:
        before_optimizer_step()
    update_successful, grad_norm, num_zeros = optimizer.step(
        nonfinite_loss=nonfinite_loss_flag(losses) if last_stage else False)
    reduced = reduce_loss_dicts(losses) if last_stage else {}
    if update_successful:
        opt_param_scheduler.step(increment=global_batch_size)
    return reduced, 0 if update_successful else 1, grad_norm, num_zeros


def evaluate(forward_step_func, data_iterator, model, *, config, schedule_config,
             pg_collection) -> dict:
    """``--eval-iters`` forward-only iterations on the validation stream (which continues where the
    previous evaluation stopped). Returns ``{key: token-weighted mean}`` on the last stage."""
    for chunk in model:
        # Pending parameter all-gathers of the distributed optimizer: evaluate the latest weights.
        as_model_chunk(chunk).finish_param_sync()
        chunk.eval()
    sums: dict = {}
    training = config.training
    with torch.no_grad():
        for _ in range(training.eval_iters):
            losses = get_forward_backward_func(pg_collection)(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=training.num_microbatches, seq_length=config.data.seq_length,
                micro_batch_size=training.micro_batch_size, forward_only=True,
                config=schedule_config, pg_collection=pg_collection)
            for d in losses:
                for key, v in d.items():
                    num, den = (v if isinstance(v, (tuple, list)) else (v, 1.0))
                    acc = sums.setdefault(key, [0.0, 0.0])
                    acc[0] += float(num)
                    acc[1] += float(den)
    for chunk in model:
        chunk.train()
    return {k: n / max(d, 1e-30) for k, (n, d) in sums.items()}


class _Trainer:
    """The loop's collaborators, so each step of the loop reads as one line."""

    def __init__(self, config, pg_collection, device, forward_step_func, model, optimizer,
                 scheduler, iterators, schedule_config, state: TrainState, start_time: float,
                 checkpoint_group=None, *, resume=checkpointing.NOT_READ):
        self.config, self.groups, self.device = config, pg_collection, device
        # Progress lines within long iterations on rank 0 (counts the training forward steps).
        self.progress = IterationProgress(
            config.training.num_iterations, enabled=pg_collection.rank == 0,
            chunks=pg_collection.virtual_pipeline_model_parallel_size or 1)
        self.forward_step_func = self.progress.wrap(forward_step_func)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_it, self.valid_it, self.test_it = iterators
        self.schedule_config, self.state = schedule_config, state
        self.run_flags = checkpoint_args(config)  # what every checkpoint of the run records
        logging, training = config.logging, config.training
        self.tb = TensorBoardLogger(logging.tensorboard_dir, logging.tensorboard_queue_size,
                                    open_wandb(logging, config.checkpoint, self.run_flags,
                                               pg_collection.rank == pg_collection.world_size - 1))
        self.memory_reported = False
        self.logged_once = False  # the run's first iteration is logged whatever --log-interval
        self.peak_tflops = resolve_peak_tflops(logging.peak_tflops, logging.measure_peak,
                                               config.model.params_dtype, device)
        if self.peak_tflops is not None:
            print_rank_0(f" MFU against a peak of {self.peak_tflops:.3f} TFLOP/s per device "
                         f"({'measured' if logging.measure_peak else '--peak-tflops'})")
        self.microbatches = build_num_microbatches_calculator(
            training.global_batch_size, training.micro_batch_size,
            config.parallel.data_parallel_size, training.rampup_batch_size)
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
        self._reset_window()

    def _reset_window(self):
        self.window = {"time": 0.0, "iters": 0, "losses": {}, "skipped": 0, "nans": 0}

    def run(self) -> bool:
        """Train to the run's last iteration; returns False if ``--exit-interval``, a signal or
        the wall-clock budget stopped it early."""
        training, checkpoint, st = self.config.training, self.config.checkpoint, self.state
        while st.iteration < training.num_iterations:
            self.microbatches.update(st.consumed_train_samples, True)
            batch = self.microbatches.get_current_global_batch_size()
            self.progress.start(st.iteration + 1, self.microbatches.get())
            start = time.perf_counter()
            at_floor = loss_scale_at_floor(self.optimizer)
            if self.config.moe.is_moe:
                reset_moe_metrics(self.model)  # validation forwards are not this iteration's
            with collective_guard(f"the train step of iteration {st.iteration + 1}", self.timeout):
                losses, skipped, grad_norm, _ = train_step(
                    self.forward_step_func, self.train_it, self.model, self.optimizer,
                    self.scheduler, config=self.config, schedule_config=self.schedule_config,
                    num_microbatches=self.microbatches.get(), global_batch_size=batch,
                    pg_collection=self.groups,
                    before_optimizer_step=self.saver.wait_for_staging if self.saver else None)
            elapsed = time.perf_counter() - start
            self.progress.finish(elapsed)
            for key, value in losses.items():  # the forward step's other losses (DPO's rewards)
                if key != "lm loss":
                    self.state.history.setdefault(key, []).append(value)
            if self.config.moe.moe_router_enable_expert_bias:
                update_expert_biases(self.model, self.config.moe, self.config.model.num_layers,
                                     self.groups, self.device)
            if self.config.moe.is_moe:
                moe = moe_iteration_metrics(self.model, self.config.moe,
                                            self.config.model.num_layers, self.groups, self.device)
                if losses:  # the last stage's: logged with the lm loss
                    losses.update(moe)
                for key, value in moe.items():
                    self.state.history.setdefault(key, []).append(value)
            st.iteration += 1
            st.consumed_train_samples += batch
            self.finalize_save(blocking=False)
            self._record(losses, skipped, grad_norm, elapsed, batch)
            self._stop_after_nan_streak(nonfinite_iteration(skipped, self.optimizer, at_floor))
            if (training.eval_interval and st.iteration % training.eval_interval == 0
                    and self.valid_it):
                self.validate(f"iteration {st.iteration}")
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
        if checkpoint.save and st.iteration > 0 and (
                not checkpoint.save_interval or st.iteration % checkpoint.save_interval != 0):
            self.save("the end of training")
        self.finalize_save(blocking=True)
        return True

    def _record(self, losses, skipped, grad_norm, elapsed, batch):
        config, st, w = self.config, self.state, self.window
        grad_norm = None if grad_norm is None else float(grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        # fp16: a skipped step is an overflow (the scaler backs off); otherwise it had inf/NaN.
        nan = (any(not math.isfinite(v) for v in losses.values())
               or bool(skipped and self.optimizer.grad_scaler is None))
        loss_scale = float(self.optimizer.get_loss_scale())
        for key, value in (("global batch size", batch), ("consumed samples",
                           st.consumed_train_samples), ("loss scale", loss_scale),
                           ("skipped", skipped), ("nan", int(nan))):
            st.history[key].append(value)
        st.history["iteration"].append(st.iteration)
        st.history["lm loss"].append(losses.get("lm loss"))
        st.history["grad norm"].append(grad_norm)
        st.history["learning rate"].append(lr)
        w["time"] += elapsed
        w["iters"] += 1
        w["skipped"] += skipped
        w["nans"] += int(nan)
        for k, v in (losses.items() if not skipped else ()):  # Megatron: skipped not averaged
            w["losses"][k] = w["losses"].get(k, 0.0) + v
        self.tb.training(st.iteration, st.consumed_train_samples, learning_rate=lr,
                         batch_size=batch, losses=losses, grad_norm=grad_norm,
                         iteration_time_s=elapsed, loss_scale=loss_scale)
        # Megatron-LM logs every --log-interval iterations only; the first one is logged too, so
        # a long interval does not leave the user without a sign that training runs.
        if st.iteration % config.logging.log_interval != 0 and self.logged_once:
            return
        self.logged_once = True
        per_iter = w["time"] / w["iters"]
        flops = num_floating_point_operations(config, batch)
        world = self.groups.world_size
        mfu = (None if self.peak_tflops is None else model_flops_utilization(
            flops, per_iter, world, self.peak_tflops))
        print_rank_last(format_iteration_line(
            iteration=st.iteration, train_iters=config.training.num_iterations,
            consumed_samples=st.consumed_train_samples, elapsed_ms=per_iter * 1000.0,
            tokens_per_s=batch * config.data.seq_length / per_iter,
            learning_rate=lr, global_batch_size=batch,
            losses={k: v / max(w["iters"] - w["skipped"], 1) for k, v in w["losses"].items()},
            loss_scale=loss_scale,
            grad_norm=grad_norm, skipped=w["skipped"], nans=w["nans"],
            tflops_per_device=flops / (per_iter * 1e12 * world), mfu=mfu,
            device_type=self.device.type))
        if not self.memory_reported:
            if self.groups.dp_cp.rank == 0:
                print(memory_report(f"(after {st.iteration} iterations)", self.device), flush=True)
            self.memory_reported = True
        self._reset_window()

    def _stop_after_nan_streak(self, nonfinite: bool) -> None:
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

    def validate(self, prefix: str, iterator=None, label: str = "validation"):
        training, st = self.config.training, self.state
        with collective_guard(f"the evaluation at {prefix}", self.timeout):
            losses = evaluate(self.forward_step_func, iterator or self.valid_it, self.model,
                              config=self.config, schedule_config=self.schedule_config,
                              pg_collection=self.groups)
        if iterator is None:
            st.consumed_valid_samples += training.eval_iters * training.global_batch_size
            if losses:
                st.history["valid"].append((st.iteration, losses.get("lm loss")))
            self.tb.validation(st.iteration, st.consumed_train_samples, losses)
        print_rank_last(format_validation_block(prefix, losses))
        return losses

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


def save_checkpoint(config, state: TrainState, model, optimizer, scheduler, pg_collection,
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


def _convert_checkpoint(config, state: TrainState, model, optimizer, scheduler, pg_collection,
                        device, group) -> None:
    """``--ckpt-convert-format F --ckpt-convert-save DIR``: save what ``--load`` loaded in format F
    under ``DIR/F`` (Megatron-LM's behaviour), then stop without training."""
    checkpoint = config.checkpoint
    target = save_folder.save_target(checkpoint)  # held since the start (hold_save_folder)
    converted = dataclasses.replace(checkpoint, save=target, async_save=False,
                                    ckpt_format=checkpoint.ckpt_convert_format)
    saver = torch_dist.TorchDistSaver(target, group, device)
    folder = save_checkpoint(converted, state, model, optimizer, scheduler, pg_collection,
                             checkpoint_args(config), saver)
    print_rank_0(f" converted checkpoint {checkpoint.load} (iteration {state.iteration}) to "
                 f"--ckpt-format {checkpoint.ckpt_convert_format} in {folder}; load it with "
                 f"--load {target}")


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


def pretrain(config, *, model_provider, forward_step_func, datasets_provider,
             before_training=None) -> dict:
    """Initialize, build, train and evaluate: Megatron-LM's ``pretrain``.

    Args:
        config: the run's frozen :class:`~megatron.config.Config` (``megatron.config.build_config``
            of the validated flags).
        model_provider: ``(config, pg_collection, device, *, pre_process, post_process,
            vp_stage) -> torch.nn.Module``, one pipeline stage (model chunk) of the model.
        forward_step_func: ``(data_iterator, model) -> (output_tensor, loss_func)``.
        datasets_provider: ``(config, [train, valid, test] samples) -> (train, valid, test)``
            datasets (None where absent).
        before_training: ``(model_chunks, schedule_config, pg_collection)``, called once after
            the weights are loaded and the data iterators built, before the first iteration
            (DPO's reference pass, megatron/training/dpo.py); None: nothing.

    Returns:
        the run's history on this rank: ``iteration``, ``lm loss`` (per iteration, None off the
        last pipeline stage), ``grad norm``, ``learning rate``, ``valid`` ([(iteration, loss)]),
        ``final valid`` (dict or None).
    """
    start_time = time.time()  # --exit-duration-in-mins counts from here
    report = StartupReport()
    with report.phase("initialization"):
        device, created_group, groups = initialize_megatron(config)
    trainer = ckpt_group = lock = None
    timeout = config.parallel.distributed_timeout_minutes
    try:
        # Before the model is built: an unusable --save, or one another job holds, stops here.
        lock = save_folder.hold_save_folder(config, device)
        # --load's tracker, read once here and passed down (initial weights, the load, the
        # checkpoints --keep-last-checkpoints must keep).
        resume = (checkpointing.resume_point(config.checkpoint.load) if config.checkpoint.load
                  else None)
        report.print_layout(groups, config)
        with report.phase("model-and-optimizer-setup"):
            model, optimizer, scheduler = builders.setup_model_and_optimizer(
                config, model_provider, groups, device,
                weights_from_checkpoint=checkpointing.weights_will_be_loaded(config.checkpoint,
                                                                             resume))
        report.print_parameters(model, groups, getattr(config, "moe", None))
        if config.training.compile:
            print_rank_0(f" --compile: {compile_transformer_layers(model)} transformer layers "
                         "compiled per rank (torch.compile)")
        state = TrainState()
        if config.checkpoint.save or config.checkpoint.load:
            ckpt_group = torch_dist.checkpoint_group(timeout)
        if config.checkpoint.load:
            with report.phase("checkpoint-load"), collective_guard("the checkpoint load", timeout):
                loaded = checkpointing.load_checkpoint(model, optimizer, scheduler,
                                                       config.checkpoint, groups,
                                                       run_flags=checkpoint_args(config),
                                                       group=ckpt_group, found=resume)
            state.iteration = loaded["iteration"]
            state.consumed_train_samples = loaded["consumed_train_samples"]
            state.consumed_valid_samples = loaded["consumed_valid_samples"]
        if config.checkpoint.ckpt_convert_format:
            _convert_checkpoint(config, state, model, optimizer, scheduler, groups, device,
                                ckpt_group)
            return state.history
        with report.phase("train/valid/test-data-iterators-setup"):
            iterators = builders.build_data_iterators(config, report.recording(datasets_provider),
                                                      groups, state.consumed_train_samples,
                                                      state.consumed_valid_samples)
        report.print_datasets(groups)
        report.print_timings(groups, device)
        schedule = builders.schedule_config(config, model, groups, optimizer)
        if before_training is not None:
            with collective_guard("the pass before training", timeout):
                before_training(model, schedule, groups)
        trainer = _Trainer(config, groups, device, forward_step_func, model, optimizer, scheduler,
                           iterators, schedule, state, start_time, ckpt_group, resume=resume)
        print_rank_0(f" training from iteration {state.iteration} to "
                     f"{config.training.num_iterations}")
        completed = trainer.run()
        state.history["final valid"] = None
        eval_iters = config.training.eval_iters
        if completed and trainer.valid_it is not None and eval_iters > 0:
            state.history["final valid"] = trainer.validate(
                "the end of training for val data")
        if completed and trainer.test_it is not None and eval_iters > 0:
            trainer.validate("the end of training for test data", trainer.test_it)
        trainer.tb.close()
        save, tensorboard_dir = config.checkpoint.save, config.logging.tensorboard_dir
        if save and dist.get_rank() == 0:
            print(f" checkpoints are in {save}", flush=True)
        if tensorboard_dir:
            print_rank_last(f" TensorBoard events are in {tensorboard_dir} "
                            f"(tensorboard --logdir {tensorboard_dir})")
        return state.history
    finally:
        if trainer is not None:
            trainer.exit.restore()
        abandoned = trainer is not None and trainer.saver is not None and trainer.saver.pending
        if ckpt_group is not None and not abandoned:  # a writer left running keeps its group
            dist.destroy_process_group(ckpt_group)
        if lock is not None and not abandoned:  # a writer left running: the lock stays, and
            lock.release()  # the next job takes it over once this process has ended
        shutdown(created_group)

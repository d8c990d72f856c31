"""The training program: set-up, the training loop, evaluation, checkpoints and logging.

Follows Megatron-LM's ``pretrain`` / ``train`` / ``train_step`` / ``evaluate`` /
``training_log`` (megatron/training/training.py), with the configuration passed down explicitly
instead of a global ``get_args()``. The model-specific parts come from the entry script
(``pretrain_llama.py``): a model provider, a forward step and a datasets provider.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron import checkpointing
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.model.flops import num_floating_point_operations as model_flops
from megatron.training import builders
from megatron.training.initialize import initialize_megatron, shutdown
from megatron.training.logging import (TensorBoardLogger, format_iteration_line,
                                       format_validation_block, memory_report, print_rank_0,
                                       print_rank_last)
from megatron.training.compile import compile_transformer_layers
from megatron.training.mfu import model_flops_utilization, resolve_peak_tflops
from megatron.training.microbatches import build_num_microbatches_calculator
from megatron.training.resilience import ExitConditions, collective_guard


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
    """Raised on every rank after ``--max-consecutive-nan-iterations`` skipped non-finite
    iterations in a row; no checkpoint is written on the way out."""


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


def num_floating_point_operations(args, batch_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward) for the validated ``args``:
    :func:`megatron.model.flops.num_floating_point_operations` (Megatron-LM's formula)."""
    return model_flops(args, batch_size, args.seq_length)


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, args,
               schedule_config, num_microbatches: int, global_batch_size: int, *, pg_collection):
    """One iteration: forward/backward over ``num_microbatches`` micro-batches, optimizer step,
    lr step by ``global_batch_size`` samples.

    Returns:
        ``(losses {key: float} on the last stage else {}, skipped 0|1, grad_norm, num_zeros)``.
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func(pg_collection)(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False, config=schedule_config,
        pg_collection=pg_collection)
    last_stage = pg_collection.is_pipeline_last_stage()
    # Only the last stage sees the loss: the optimizer folds this flag into its found-inf
    # all-reduce, so an inf/NaN loss skips the step on every rank alike. A device tensor, and the
    # losses are read on the host only after the step: on CUDA nothing waits for the GPU before
    # the optimizer's kernels are queued.
    update_successful, grad_norm, num_zeros = optimizer.step(
        nonfinite_loss=nonfinite_loss_flag(losses) if last_stage else False)
    reduced = reduce_loss_dicts(losses) if last_stage else {}
    if update_successful:
        opt_param_scheduler.step(increment=global_batch_size)
    return reduced, 0 if update_successful else 1, grad_norm, num_zeros


def evaluate(forward_step_func, data_iterator, model, args, schedule_config, *,
             pg_collection) -> dict:
    """``--eval-iters`` forward-only iterations on the validation stream (which continues where the
    previous evaluation stopped). Returns ``{key: token-weighted mean}`` on the last stage."""
    for chunk in model:
        # Pending parameter all-gathers of the distributed optimizer: evaluate the latest weights.
        getattr(chunk, "finish_param_sync", lambda: None)()
        chunk.eval()
    sums: dict = {}
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = get_forward_backward_func(pg_collection)(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=builders.num_microbatches(args), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True, config=schedule_config,
                pg_collection=pg_collection)
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

    def __init__(self, args, device, forward_step_func, model, optimizer, scheduler, iterators,
                 schedule_config, state: TrainState, start_time: float):
        self.args, self.device, self.forward_step_func = args, device, forward_step_func
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_it, self.valid_it, self.test_it = iterators
        self.schedule_config, self.state = schedule_config, state
        self.groups = ps.get_process_groups()
        self.tb = TensorBoardLogger(getattr(args, "tensorboard_dir", None),
                                    getattr(args, "tensorboard_queue_size", 1000))
        self.memory_reported = False
        self.peak_tflops = resolve_peak_tflops(args, device)
        if self.peak_tflops is not None:
            print_rank_0(f" MFU against a peak of {self.peak_tflops:.3f} TFLOP/s per device "
                         f"({'measured' if getattr(args, 'measure_peak', False) else '--peak-tflops'})")
        self.microbatches = build_num_microbatches_calculator(args)
        self.exit = ExitConditions(getattr(args, "exit_signal_handler", False),
                                   getattr(args, "exit_duration_in_mins", None),
                                   start_time, device)
        self.timeout = getattr(args, "distributed_timeout_minutes", None)
        self.nan_streak = 0  # consecutive skipped non-finite iterations (bf16/fp32)
        self._reset_window()

    def _reset_window(self):
        self.window = {"time": 0.0, "iters": 0, "losses": {}, "skipped": 0, "nans": 0}

    def run(self) -> bool:
        """Train to ``--train-iters``; returns False if ``--exit-interval`` stopped it early."""
        args, st = self.args, self.state
        train_iters = builders.train_iters(args)
        while st.iteration < train_iters:
            self.microbatches.update(st.consumed_train_samples, True)
            batch = self.microbatches.get_current_global_batch_size()
            start = time.perf_counter()
            with collective_guard(f"the train step of iteration {st.iteration + 1}", self.timeout):
                losses, skipped, grad_norm, _ = train_step(
                    self.forward_step_func, self.train_it, self.model, self.optimizer,
                    self.scheduler, args, self.schedule_config, self.microbatches.get(), batch,
                    pg_collection=self.groups)
            elapsed = time.perf_counter() - start
            st.iteration += 1
            st.consumed_train_samples += batch
            self._record(losses, skipped, grad_norm, elapsed, batch)
            self._stop_after_nan_streak(skipped)
            if args.eval_interval and st.iteration % args.eval_interval == 0 and self.valid_it:
                self.validate(f"iteration {st.iteration}")
            saved = False
            if args.save and args.save_interval and st.iteration % args.save_interval == 0:
                self.save()
                saved = True
            if getattr(args, "exit_interval", None) and st.iteration % args.exit_interval == 0:
                if args.save and not saved:
                    self.save()
                print_rank_0(f"exiting program at iteration {st.iteration}")
                return False
            reason = self.exit.check()  # every rank agrees: all stop after the same iteration
            if reason:
                if args.save and not saved:
                    self.save()
                print_rank_0(f"exiting program at iteration {st.iteration} "
                             + ("after receiving SIGTERM" if reason == "signal" else
                                f"after {args.exit_duration_in_mins:g} minutes "
                                "(--exit-duration-in-mins)"))
                return False
        if args.save and st.iteration > 0 and (not args.save_interval
                                               or st.iteration % args.save_interval != 0):
            self.save()
        return True

    def _record(self, losses, skipped, grad_norm, elapsed, batch):
        args, st, w = self.args, self.state, self.window
        grad_norm = None if grad_norm is None else float(grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        # fp16: a skipped step is an overflow (the scaler backs off); otherwise it had inf/NaN.
        nan = (any(not math.isfinite(v) for v in losses.values())
               or bool(skipped and getattr(self.optimizer, "grad_scaler", None) is None))
        loss_scale = float(getattr(self.optimizer, "get_loss_scale", lambda: 1.0)())
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
        if st.iteration % args.log_interval != 0:
            return
        per_iter = w["time"] / w["iters"]
        flops = num_floating_point_operations(args, batch)
        mfu = (None if self.peak_tflops is None else model_flops_utilization(
            flops, per_iter, dist.get_world_size(), self.peak_tflops))
        print_rank_last(format_iteration_line(
            iteration=st.iteration, train_iters=builders.train_iters(args),
            consumed_samples=st.consumed_train_samples, elapsed_ms=per_iter * 1000.0,
            tokens_per_s=batch * args.seq_length / per_iter,
            learning_rate=lr, global_batch_size=batch,
            losses={k: v / max(w["iters"] - w["skipped"], 1) for k, v in w["losses"].items()},
            loss_scale=loss_scale,
            grad_norm=grad_norm, skipped=w["skipped"], nans=w["nans"],
            tflops_per_device=flops / (per_iter * 1e12 * dist.get_world_size()), mfu=mfu))
        if not self.memory_reported:
            if ps.get_data_parallel_rank() == 0:
                print(memory_report(f"(after {st.iteration} iterations)", self.device), flush=True)
            self.memory_reported = True
        self._reset_window()

    def _stop_after_nan_streak(self, skipped: int) -> None:
        """Count bf16/fp32 iterations skipped for inf/NaN (equal on every rank: the optimizer's
        flag is all-reduced); raise after ``--max-consecutive-nan-iterations`` in a row.

        Raises:
            NonFiniteTrainingError: naming the iteration and the last checkpoint, left intact.
        """
        limit = getattr(self.args, "max_consecutive_nan_iterations", 3)
        nan_step = bool(skipped) and getattr(self.optimizer, "grad_scaler", None) is None
        self.nan_streak = self.nan_streak + 1 if nan_step else 0
        if not limit or self.nan_streak < limit:
            return
        it, save = self.state.iteration, getattr(self.args, "save", None)
        found = checkpointing.find_checkpoint(save) if save else None
        kept = (f"the last checkpoint (iteration {found[0]} in {save}) is left as it was"
                if found else "no checkpoint was written")
        message = (f"training stopped at iteration {it}: iterations {it - self.nan_streak + 1} to "
                   f"{it} had inf/NaN loss or gradients ({self.nan_streak} in a row, "
                   f"--max-consecutive-nan-iterations {limit}); each was skipped without an "
                   f"update; {kept}. Lower --lr, check the data, or resume from the checkpoint.")
        print_rank_0(message)
        raise NonFiniteTrainingError(message)

    def validate(self, prefix: str, iterator=None, label: str = "validation"):
        args, st = self.args, self.state
        with collective_guard(f"the evaluation at {prefix}", self.timeout):
            losses = evaluate(self.forward_step_func, iterator or self.valid_it, self.model, args,
                              self.schedule_config, pg_collection=self.groups)
        if iterator is None:
            st.consumed_valid_samples += args.eval_iters * args.global_batch_size
            if losses:
                st.history["valid"].append((st.iteration, losses.get("lm loss")))
            self.tb.validation(st.iteration, st.consumed_train_samples, losses)
        print_rank_last(format_validation_block(prefix, losses))
        return losses

    def save(self):
        st = self.state
        start = time.perf_counter()
        with collective_guard(f"the checkpoint save of iteration {st.iteration}", self.timeout):
            folder = checkpointing.save_checkpoint(
                st.iteration, self.model, self.optimizer, self.scheduler, self.args,
                consumed_train_samples=st.consumed_train_samples,
                consumed_valid_samples=st.consumed_valid_samples)
        print_rank_0(f"  successfully saved checkpoint at iteration {st.iteration:7d} to {folder} "
                     f"[ t {time.perf_counter() - start:.2f}s ]")


def pretrain(args, *, model_provider, forward_step_func, datasets_provider) -> dict:
    """Initialize, build, train and evaluate; Megatron-LM's ``pretrain`` for validated ``args``.

    Args:
        args: the validated argument namespace (``megatron.arguments``).
        model_provider: ``(args, device, pre_process, post_process) -> torch.nn.Module``, one
            pipeline stage of the model.
        forward_step_func: ``(data_iterator, model) -> (output_tensor, loss_func)``.
        datasets_provider: ``(args, [train, valid, test] samples) -> (train, valid, test)``
            datasets (None where absent).

    Returns:
        the run's history on this rank: ``iteration``, ``lm loss`` (per iteration, None off the
        last pipeline stage), ``grad norm``, ``learning rate``, ``valid`` ([(iteration, loss)]),
        ``final valid`` (dict or None).
    """
    start_time = time.time()  # --exit-duration-in-mins counts from here
    device, created_group = initialize_megatron(args)
    trainer = None
    try:
        model, optimizer, scheduler = builders.setup_model_and_optimizer(args, model_provider, device)
        if getattr(args, "compile", False):
            print_rank_0(f" --compile: {compile_transformer_layers(model)} transformer layers "
                         "compiled per rank (torch.compile)")
        state = TrainState()
        if getattr(args, "load", None):
            with collective_guard("the checkpoint load", getattr(args, "distributed_timeout_minutes", None)):
                loaded = checkpointing.load_checkpoint(model, optimizer, scheduler, args)
            state.iteration = loaded["iteration"]
            state.consumed_train_samples = loaded["consumed_train_samples"]
            state.consumed_valid_samples = loaded["consumed_valid_samples"]
        iterators = builders.build_data_iterators(args, datasets_provider, state.consumed_train_samples,
                                               state.consumed_valid_samples)
        trainer = _Trainer(args, device, forward_step_func, model, optimizer, scheduler, iterators,
                           builders.schedule_config(args, model, optimizer), state, start_time)
        print_rank_0(f" training from iteration {state.iteration} to {builders.train_iters(args)}")
        completed = trainer.run()
        state.history["final valid"] = None
        if completed and trainer.valid_it is not None and args.eval_iters > 0:
            state.history["final valid"] = trainer.validate(
                "the end of training for val data")
        if completed and trainer.test_it is not None and args.eval_iters > 0:
            trainer.validate("the end of training for test data", trainer.test_it)
        trainer.tb.close()
        if args.save and dist.get_rank() == 0:
            print(f" checkpoints are in {args.save}", flush=True)
        if getattr(args, "tensorboard_dir", None):
            print_rank_last(f" TensorBoard events are in {args.tensorboard_dir} "
                            f"(tensorboard --logdir {args.tensorboard_dir})")
        return state.history
    finally:
        if trainer is not None:
            trainer.exit.restore()
        shutdown(created_group)

"""The training logger of a run: Megatron's iteration lines with throughput and MFU, the
history, TensorBoard, W&B and the mixture-of-experts metrics.

Moved out of the training loop (:mod:`megatron.training.train`) unchanged: Megatron-LM's
``training_log`` (megatron/training/training.py).
"""

from __future__ import annotations

import math

from megatron.model.flops import num_floating_point_operations as model_flops
from megatron.training.logging import (TensorBoardLogger, format_iteration_line, memory_report,
                                       print_rank_0, print_rank_last)
from megatron.training.mfu import model_flops_utilization, resolve_peak_tflops
from megatron.training.moe_logging import moe_iteration_metrics, reset_moe_metrics
from megatron.training.wandb_writer import open_wandb


def num_floating_point_operations(config, batch_size: int) -> float:
    """Model FLOPs of one iteration (forward + backward) of a run's configuration:
    :func:`megatron.model.flops.num_floating_point_operations` (Megatron-LM's formula; active
    FLOPs of a mixture-of-experts model)."""
    return model_flops(config.model, batch_size, config.data.seq_length,
                       getattr(config, "moe", None))


class TrainingLogger:
    """What a run reports per iteration and per evaluation.

    Args:
        config: the run's :class:`~megatron.config.Config`.
        pg_collection: the run's process groups (the last rank writes TensorBoard / W&B).
        device: the run's device (the peak TFLOP/s measurement, the memory report).
        run_flags: what the run's checkpoints record (W&B's run config).
    """

    def __init__(self, config, pg_collection, device, run_flags: dict):
        self.config, self.groups, self.device = config, pg_collection, device
        logging = config.logging
        self.tb = TensorBoardLogger(logging.tensorboard_dir, logging.tensorboard_queue_size,
                                    open_wandb(logging, config.checkpoint, run_flags,
                                               pg_collection.rank == pg_collection.world_size - 1))
        self.memory_reported = False
        self.logged_once = False  # the run's first iteration is logged whatever --log-interval
        self.peak_tflops = resolve_peak_tflops(logging.peak_tflops, logging.measure_peak,
                                               config.model.params_dtype, device)
        if self.peak_tflops is not None:
            print_rank_0(f" MFU against a peak of {self.peak_tflops:.3f} TFLOP/s per device "
                         f"({'measured' if logging.measure_peak else '--peak-tflops'})")
        self._reset_window()

    def _reset_window(self):
        self.window = {"time": 0.0, "iters": 0, "losses": {}, "skipped": 0, "nans": 0}

    def before_step(self, model) -> None:
        """Mixture of experts: validation forwards are not this iteration's metrics."""
        if self.config.moe.is_moe:
            reset_moe_metrics(model)

    def moe_metrics(self, model, losses: dict, history: dict) -> None:
        """Mixture of experts: the iteration's router metrics into ``losses`` (the last stage's,
        logged with the lm loss) and ``history``."""
        if self.config.moe.is_moe:
            moe = moe_iteration_metrics(model, self.config.moe,
                                        self.config.model.num_layers, self.groups, self.device)
            if losses:  # the last stage's: logged with the lm loss
                losses.update(moe)
            for key, value in moe.items():
                history.setdefault(key, []).append(value)

    def validation(self, iteration: int, consumed_train_samples: int, losses: dict) -> None:
        self.tb.validation(iteration, consumed_train_samples, losses)

    def close(self) -> None:
        self.tb.close()

    def record(self, state, optimizer, losses, skipped, grad_norm, elapsed, batch):
        """One iteration into the history (``state.history``), TensorBoard / W&B, and every
        ``--log-interval`` iterations (and the first) Megatron's iteration line with MFU."""
        config, st, w = self.config, state, self.window
        grad_norm = None if grad_norm is None else float(grad_norm)
        lr = optimizer.param_groups[0]["lr"]
        # fp16: a skipped step is an overflow (the scaler backs off); otherwise it had inf/NaN.
        nan = (any(not math.isfinite(v) for v in losses.values())
               or bool(skipped and optimizer.grad_scaler is None))
        loss_scale = float(optimizer.get_loss_scale())
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

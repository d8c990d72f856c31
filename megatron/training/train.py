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
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron import checkpointing
from megatron.checkpointing import save_folder, torch_dist
from megatron.config import checkpoint_args
from megatron.core.distributed.model_chunk import as_model_chunk
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.training import builders
from megatron.training.checkpoint_policy import (  # noqa: F401  (the error: re-exported)
    CheckpointPolicy, NonFiniteTrainingError, loss_scale_at_floor, nonfinite_iteration,
    save_checkpoint)
from megatron.training.initialize import initialize_megatron, shutdown
from megatron.training.logging import IterationProgress, format_validation_block, print_rank_0, \
    print_rank_last
from megatron.training.compile import compile_transformer_layers
from megatron.core.num_microbatches_calculator import build_num_microbatches_calculator
from megatron.training.moe_bias import update_expert_biases
from megatron.training.moe_loss_scale import prepare_moe_iteration
from megatron.training.resilience import catch_signal_early, collective_guard, release_signal_early
from megatron.training.startup_report import StartupReport
from megatron.training.training_logger import (  # noqa: F401  (re-exported)
    TrainingLogger, num_floating_point_operations)


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


def reduce_loss_dicts(loss_dicts: list, group=None) -> dict:
    """The per-micro-batch ``{key: (sum, count)}`` dicts of this rank (a bare value counts as
    ``(value, 1)``) summed over the micro-batches and then over ``group`` (the data x
    context-parallel group) in one all-reduce, as Megatron-Core's ``train_step`` does: one
    collective per step, not one per micro-batch.

    Returns:
        ``{key: (sum, count)}``, 0-d float64 tensors on the losses' device (nothing read on the
        host); ``{}`` without losses. Every rank of ``group`` must call it with the same keys
        (the first dict's, in its order). :func:`loss_means` gives the floats.
    """
    if not loss_dicts:
        return {}
    keys = list(loss_dicts[0])
    # float64: the sums over micro-batches and ranks add the fp32 values without rounding them.
    sums = torch.stack([_sum_and_count(d[key]) for d in loss_dicts for key in keys])
    sums = sums.view(len(loss_dicts), len(keys), 2).sum(dim=0)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return {key: (sums[i, 0], sums[i, 1]) for i, key in enumerate(keys)}


def _sum_and_count(value) -> torch.Tensor:
    num, den = (value[0], value[1]) if isinstance(value, (tuple, list)) else (value, 1.0)
    num = torch.as_tensor(num).detach().reshape(()).double()
    return torch.stack([num, torch.as_tensor(den, device=num.device).detach().reshape(()).double()])


def loss_means(reduced: dict) -> dict:
    """``{key: sum / count}`` (floats: a token-weighted mean over the global batch) of
    :func:`reduce_loss_dicts`'s sums."""
    return {key: float(num) / max(float(den), 1e-30) for key, (num, den) in reduced.items()}


def nonfinite_loss_flag(reduced: dict):
    """True (a 0-dim bool tensor on the losses' device, no host read) when a loss sum of
    :func:`reduce_loss_dicts` is inf/NaN: what makes a value of :func:`loss_means` non-finite.
    False when there is no loss."""
    if not reduced:
        return False
    return ~torch.isfinite(torch.stack([num for num, _ in reduced.values()])).all()


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
    # MoE: the router losses' gradient scale of this iteration (its micro-batches, the
    # per-token loss's count), after global_aux_loss's counting pass where it runs
    data_iterator = prepare_moe_iteration(
        forward_step_func, data_iterator, model, moe_config=getattr(config, "moe", None),
        num_microbatches=num_microbatches, seq_length=config.data.seq_length,
        micro_batch_size=config.training.micro_batch_size, schedule_config=schedule_config,
        pg_collection=pg_collection)
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
    reported = reduce_loss_dicts(losses, pg_collection.dp_cp.group) if last_stage else {}
    update_successful, grad_norm, num_zeros = optimizer.step(
        nonfinite_loss=nonfinite_loss_flag(reported) if last_stage else False)
    reduced = loss_means(reported)
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
    losses = []
    training = config.training
    with torch.no_grad():
        for _ in range(training.eval_iters):
            losses += get_forward_backward_func(pg_collection)(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=training.num_microbatches, seq_length=config.data.seq_length,
                micro_batch_size=training.micro_batch_size, forward_only=True,
                config=schedule_config, pg_collection=pg_collection)
    for chunk in model:
        chunk.train()
    # One all-reduce for the whole evaluation (the last stage's data x context-parallel group).
    return loss_means(reduce_loss_dicts(losses, pg_collection.dp_cp.group))


class _Trainer:
    """The training loop: each iteration's step, then its logging (:class:`TrainingLogger`),
    evaluation and checkpoint decisions (:class:`CheckpointPolicy`), so that each reads as one
    line."""

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
        run_flags = checkpoint_args(config)  # what every checkpoint of the run records
        training = config.training
        self.logger = TrainingLogger(config, pg_collection, device, run_flags)
        self.microbatches = build_num_microbatches_calculator(
            training.global_batch_size, training.micro_batch_size,
            config.parallel.data_parallel_size, training.rampup_batch_size)
        self.policy = CheckpointPolicy(config, pg_collection, device, state, model, optimizer,
                                       scheduler, run_flags, start_time, checkpoint_group,
                                       resume=resume)
        self.timeout = config.parallel.distributed_timeout_minutes

    def run(self) -> bool:
        """Train to the run's last iteration; returns False if ``--exit-interval``, a signal or
        the wall-clock budget stopped it early."""
        training, st, policy = self.config.training, self.state, self.policy
        while st.iteration < training.num_iterations:
            self.microbatches.update(st.consumed_train_samples, True)
            batch = self.microbatches.get_current_global_batch_size()
            self.progress.start(st.iteration + 1, self.microbatches.get())
            start = time.perf_counter()
            at_floor = loss_scale_at_floor(self.optimizer)
            self.logger.before_step(self.model)
            with collective_guard(f"the train step of iteration {st.iteration + 1}", self.timeout):
                losses, skipped, grad_norm, _ = train_step(
                    self.forward_step_func, self.train_it, self.model, self.optimizer,
                    self.scheduler, config=self.config, schedule_config=self.schedule_config,
                    num_microbatches=self.microbatches.get(), global_batch_size=batch,
                    pg_collection=self.groups,
                    before_optimizer_step=policy.saver.wait_for_staging if policy.saver else None)
            elapsed = time.perf_counter() - start
            self.progress.finish(elapsed)
            for key, value in losses.items():  # the forward step's other losses (DPO's rewards)
                if key != "lm loss":
                    self.state.history.setdefault(key, []).append(value)
            if self.config.moe.moe_router_enable_expert_bias:
                update_expert_biases(self.model, self.config.moe, self.config.model.num_layers,
                                     self.groups, self.device)
            self.logger.moe_metrics(self.model, losses, self.state.history)
            st.iteration += 1
            st.consumed_train_samples += batch
            policy.finalize_save(blocking=False)
            self.logger.record(st, self.optimizer, losses, skipped, grad_norm, elapsed, batch)
            policy.stop_after_nan_streak(nonfinite_iteration(skipped, self.optimizer, at_floor))
            if (training.eval_interval and st.iteration % training.eval_interval == 0
                    and self.valid_it):
                self.validate(f"iteration {st.iteration}")
            if not policy.after_iteration():
                return False
        policy.at_end()
        return True

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
            self.logger.validation(st.iteration, st.consumed_train_samples, losses)
        print_rank_last(format_validation_block(prefix, losses))
        return losses


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
    catch_signal_early(config.training.exit_signal_handler)
    report = StartupReport()
    try:
        with report.phase("initialization"):
            device, created_group, groups = initialize_megatron(config)
    except BaseException:
        release_signal_early()
        raise
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
                                                      state.consumed_valid_samples,
                                                      state.iteration)
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
        trainer.logger.close()
        save, tensorboard_dir = config.checkpoint.save, config.logging.tensorboard_dir
        if save and dist.get_rank() == 0:
            print(f" checkpoints are in {save}", flush=True)
        if tensorboard_dir:
            print_rank_last(f" TensorBoard events are in {tensorboard_dir} "
                            f"(tensorboard --logdir {tensorboard_dir})")
        return state.history
    finally:
        if trainer is not None:
            trainer.policy.exit.restore()
        release_signal_early()  # a run that ended before its training loop
        abandoned = trainer is not None and trainer.policy.abandoned
        if ckpt_group is not None and not abandoned:  # a writer left running keeps its group
            dist.destroy_process_group(ckpt_group)
        if lock is not None and not abandoned:  # a writer left running: the lock stays, and
            lock.release()  # the next job takes it over once this process has ended
        shutdown(created_group)

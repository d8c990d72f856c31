"""Megatron legacy checkpoint layout: names, round trip, crash safety and clear errors."""

import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from megatron import checkpointing as ckpt
from megatron.checkpointing import legacy
from megatron.arguments import load_args_from_checkpoint
from megatron.config import CheckpointConfig
from megatron.config.saved_args import plain
from megatron.usage_error import UsageError
from tests.helpers.checkpoint import checkpoint_parts
from tests.helpers.dist import run_distributed
from tests.helpers.groups import current_groups


def test_checkpoint_names_follow_megatron():
    name = ckpt.get_checkpoint_name("out", 100, pipeline_parallel=True, tensor_rank=1, pipeline_rank=2)
    assert name == os.path.join("out", "iter_0000100", "mp_rank_01_002", "model_optim_rng.pt")
    name = ckpt.get_checkpoint_name("out", 7, pipeline_parallel=False, tensor_rank=0, pipeline_rank=0)
    assert name == os.path.join("out", "iter_0000007", "mp_rank_00", "model_optim_rng.pt")
    name = ckpt.get_checkpoint_name("out", 0, release=True, pipeline_parallel=False, tensor_rank=3)
    assert name == os.path.join("out", "release", "mp_rank_03", "model_optim_rng.pt")


def _collection(rank, world, tp, pp, cp=1, ep=1, etp=None):
    """Rank ``rank``'s groups of a layout, as ranks only (no communicator)."""
    from megatron.core.process_groups import ParallelGroup, ProcessGroupCollection, layout_groups

    g = layout_groups(world, tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                      expert_tensor_parallel_size=etp)

    def mine(kind):
        ranks = next(r for r in g[kind] if rank in r)
        return ParallelGroup(None, tuple(ranks), ranks.index(rank))

    return ProcessGroupCollection(
        tp=mine("tensor"), pp=mine("pipeline"), dp=mine("data"), cp=mine("context"),
        dp_cp=mine("data_context"), model=mine("model"), embedding=mine("embedding"), rank=rank,
        world_size=world, ep=mine("expert"), expt_tp=mine("expert_tensor"),
        expt_dp=mine("expert_data"), tp_ep=mine("tensor_expert"),
        tp_ep_pp=mine("tensor_expert_pipeline"))


@pytest.mark.parametrize("world, tp, pp, cp, ep, etp, folders", [
    (8, 2, 2, 1, 1, None, 4),    # mp_rank_TT_PPP, written by DP rank 0
    (8, 2, 2, 1, 2, None, 8),    # EP over DP: every rank its own mp_rank_TT_PPP_EEE
    (16, 2, 2, 2, 2, None, 8),   # EP over CP: the two DP ranks of each (TT, PPP, EEE) share it
    (8, 2, 1, 1, 2, 1, 2),       # EP over TP (expert-TP 1), PP=1: mp_rank_TT_EEE, EEE = TT
])
def test_expert_parallel_folders_follow_megatron_and_have_one_writer(world, tp, pp, cp, ep, etp,
                                                                     folders):
    names = {}
    for rank in range(world):
        groups = _collection(rank, world, tp, pp, cp, ep, etp)
        name = os.path.relpath(ckpt.checkpoint_name_of("out", 5, groups), "out")
        parts = os.path.dirname(name).split(os.sep)[1].split("_")[2:]
        want = [f"{groups.tp.rank:02d}"] + ([f"{groups.pp.rank:03d}"] if pp > 1 else []) + (
            [f"{groups.ep.rank:03d}"] if ep > 1 else [])
        assert parts == want, (rank, name)
        names.setdefault(name, []).append(legacy.writes_model_file(groups))
    assert len(names) == folders
    assert all(writers.count(True) == 1 for writers in names.values()), names


def test_tracker_file(tmp_path):
    tracker = tmp_path / ckpt.TRACKER_FILENAME
    tracker.write_text("release")
    assert ckpt.read_metadata(str(tracker)) == (0, True)
    tracker.write_text("42\n")
    assert ckpt.read_metadata(str(tracker)) == (42, False)
    tracker.write_text("latest")
    with pytest.raises(ckpt.CheckpointError, match="iteration number or 'release'"):
        ckpt.read_metadata(str(tracker))


def test_args_are_plain_values():
    args = SimpleNamespace(lr=1e-3, dtype=torch.bfloat16, data_path=("a", "b"), save=None)
    assert {k: plain(v) for k, v in sorted(vars(args).items())} == {
        "data_path": ["a", "b"], "dtype": "torch.bfloat16", "lr": 1e-3, "save": None}


def _round_trip(save_dir):
    model, opt, sched = checkpoint_parts(0)
    sched.num_steps = 5
    config = CheckpointConfig(save=save_dir, load=save_dir, keep_last_checkpoints=1)
    run_flags = {"save": save_dir, "hidden_size": 4}  # what the shards record as args
    ckpt.save_checkpoint(3, model, opt, sched, config, current_groups(), run_flags=run_flags,
                         consumed_train_samples=24, consumed_valid_samples=8)
    ckpt.save_checkpoint(6, model, opt, sched, config, current_groups(), run_flags=run_flags,
                         consumed_train_samples=48, consumed_valid_samples=16)
    after_save = torch.rand(3)
    model2, opt2, sched2 = checkpoint_parts(1)
    loaded = ckpt.load_checkpoint(model2, opt2, sched2, config, current_groups(), run_flags={})
    after_load = torch.rand(3)
    same_weights = all(torch.equal(a, b) for a, b in zip(model[0].state_dict().values(),
                                                         model2[0].state_dict().values()))
    same_opt = torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    return loaded, same_weights, same_opt, sched2.num_steps, torch.equal(after_save, after_load)


def test_save_load_round_trip_two_pipeline_stages(tmp_path):
    out = run_distributed(2, _round_trip, str(tmp_path))
    for loaded, same_weights, same_opt, steps, same_rng in out:
        assert loaded == {"iteration": 6, "consumed_train_samples": 48, "consumed_valid_samples": 16}
        assert same_weights and same_opt and steps == 5 and same_rng
    assert (tmp_path / ckpt.TRACKER_FILENAME).read_text() == "6"
    assert sorted(os.listdir(tmp_path / "iter_0000006")) == ["mp_rank_00_000", "mp_rank_00_001"]
    # --keep-last-checkpoints 1 removed iteration 3 once 6 was complete; no staging folder is left.
    assert sorted(os.listdir(tmp_path)) == ["iter_0000006", ckpt.TRACKER_FILENAME]
    # --use-checkpoint-args takes the model shape from the saved arguments.
    args = SimpleNamespace(load=str(tmp_path), hidden_size=99, num_layers=3)
    assert load_args_from_checkpoint(args) == ["hidden_size"]
    assert args.hidden_size == 4 and args.num_layers == 3
    path = tmp_path / "iter_0000006" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    assert state["args"]["save"] == str(tmp_path) and state["iteration"] == 6


def _failing_save(save_dir):
    model, opt, sched = checkpoint_parts(0)
    config = CheckpointConfig(save=save_dir, load=save_dir, keep_last_checkpoints=1)
    ckpt.save_checkpoint(1, model, opt, sched, config, current_groups(), run_flags={},
                         consumed_train_samples=8, consumed_valid_samples=0)
    if torch.distributed.get_rank() == 1:
        def full_disk(obj, path):
            raise OSError(28, "No space left on device")
        legacy.write_atomic = full_disk
    try:
        ckpt.save_checkpoint(2, model, opt, sched, config, current_groups(), run_flags={},
                             consumed_train_samples=16, consumed_valid_samples=0)
    except ckpt.CheckpointError as exc:
        return str(exc)
    return None


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    errors = run_distributed(2, _failing_save, str(tmp_path))
    assert "No space left on device" in errors[1] and "another rank" in errors[0]
    assert (tmp_path / ckpt.TRACKER_FILENAME).read_text() == "1"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", ckpt.TRACKER_FILENAME]


def _load_error(save_dir, case):
    model, opt, sched = checkpoint_parts(0)
    config = CheckpointConfig(save=save_dir, load=save_dir)
    ckpt.save_checkpoint(4, model, opt, sched, config, current_groups(), run_flags={},
                         consumed_train_samples=8, consumed_valid_samples=0)
    path = ckpt.checkpoint_name_of(save_dir, 4, current_groups())
    if case == "shape":
        model, opt, sched = checkpoint_parts(0, out_features=5)
    elif case == "corrupt":
        with open(path, "r+b") as f:
            f.truncate(100)
    elif case == "pickle":
        class Evil:
            def __reduce__(self):
                return (os.system, ("echo pwned",))
        with open(path, "wb") as f:
            pickle.dump({"model": Evil()}, f)
    elif case == "missing":
        os.remove(path)
    try:
        ckpt.load_checkpoint(model, opt, sched, config, current_groups(), run_flags={})
    except ckpt.CheckpointError as exc:
        return str(exc)
    return None


def _load_errors(root, cases):
    return [_load_error(os.path.join(root, case), case) for case in cases]


LOAD_ERRORS = {
    "shape": r"tensor weight has shape \(3, 4\) in the checkpoint but \(5, 4\) in the model",
    "corrupt": r"cannot read checkpoint shard .*iter_0000004.*model_optim_rng.pt",
    "pickle": r"refused to load checkpoint shard .*model_optim_rng.pt: its pickle asks for "
              r"(posix|nt)\.system.*nothing in it ran",
    "missing": r"model_optim_rng.pt does not exist.*No other complete checkpoint",
}


def test_load_errors_name_file_and_problem(tmp_path):
    import re

    messages = run_distributed(1, _load_errors, str(tmp_path), list(LOAD_ERRORS))[0]
    for (case, expected), message in zip(LOAD_ERRORS.items(), messages):
        assert message is not None and re.search(expected, message), (case, message)
        assert "weights_only" not in message, (case, message)  # never advise the full unpickler


def _fresh_or_finetune(load_dir, finetune):
    model, opt, sched = checkpoint_parts(0)
    config = CheckpointConfig(load=load_dir, finetune=finetune)
    try:
        return ckpt.load_checkpoint(model, opt, sched, config, current_groups(), run_flags={})
    except ckpt.CheckpointError as exc:
        return str(exc)


def test_empty_load_folder_is_fresh_start_but_finetune_error(tmp_path):
    assert run_distributed(1, _fresh_or_finetune, str(tmp_path), False)[0]["iteration"] == 0
    assert "--finetune needs a checkpoint" in run_distributed(1, _fresh_or_finetune, str(tmp_path), True)[0]


def _release(save_dir):
    model, opt, sched = checkpoint_parts(0)
    config = CheckpointConfig(save=save_dir, load=save_dir)
    ckpt.save_checkpoint(9, model, opt, sched, config, current_groups(), run_flags={},
                         consumed_train_samples=8, consumed_valid_samples=0)
    os.rename(os.path.join(save_dir, "iter_0000009"), os.path.join(save_dir, "release"))
    with open(os.path.join(save_dir, ckpt.TRACKER_FILENAME), "w") as f:
        f.write("release")
    model2, opt2, sched2 = checkpoint_parts(1)
    loaded = ckpt.load_checkpoint(model2, opt2, sched2, config, current_groups(), run_flags={})
    return loaded, torch.equal(model[0].weight, model2[0].weight)


def test_release_checkpoint_loads_weights_only(tmp_path):
    loaded, same = run_distributed(1, _release, str(tmp_path))[0]
    assert loaded["iteration"] == 0 and same


# Flipped bytes: a damaged shard is named with the last complete checkpoint, never loaded ---------

def _flipped_byte_load(folder, target):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core import parallel_state as ps
    from tests.helpers.checkpoint import flip_storage_byte
    from tests.helpers.toy import BUCKET, LR, Net, distrib_iteration

    ps.initialize_model_parallel(1, 1)  # DP=2 with the distributed optimizer
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), data_parallel_group=ps.get_data_parallel_group(),
                                  bucket_size=BUCKET, use_distributed_optimizer=True)
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, use_distributed_optimizer=True), [ddp],
                                 pg_collection=current_groups())
    config = CheckpointConfig(save=folder, load=folder)
    for it in (1, 2):
        distrib_iteration(ddp, opt, it, 1)
        ckpt.save_checkpoint(it, [ddp], opt, None, config, current_groups(), run_flags={},
                             consumed_train_samples=16 * it, consumed_valid_samples=0)
    shard = os.path.join(folder, "iter_0000002", "mp_rank_00", target)
    if torch.distributed.get_rank() == 0:
        flip_storage_byte(shard)
    torch.distributed.barrier()
    try:
        ckpt.load_checkpoint([ddp], opt, None, config, current_groups(), run_flags={})
    except ckpt.CheckpointError as exc:
        return str(exc), isinstance(exc, UsageError), getattr(exc, "silent", None)
    return None


@pytest.mark.parametrize("target", ["model_optim_rng.pt", ckpt.distrib_optim_filename(1)])
def test_flipped_byte_is_named_with_the_last_complete_checkpoint(tmp_path, target):
    errors = run_distributed(2, _flipped_byte_load, str(tmp_path), target)
    shard = str(tmp_path / "iter_0000002" / "mp_rank_00" / target)
    hint = (f"The last complete checkpoint is {tmp_path / 'iter_0000001'}: to resume from it, "
            f"write 1 into {tmp_path / ckpt.TRACKER_FILENAME}")
    # both DP ranks read the damaged file (the model shard, or every optimizer shard to re-cut):
    # the lowest, rank 0, says it for the job; rank 1 stops silently (both with a usage error)
    (message, usage, silent), (other, other_usage, other_silent) = errors
    assert shard in message and "fails its CRC-32 check" in message and hint in message, message
    assert usage and not silent and other_usage and other_silent, errors
    assert other == "rank 0 found a usage error (see its line)"


@pytest.mark.parametrize("kind", ["named pipe", "folder", "symbolic link to nothing"])
def test_a_tracker_that_is_no_file_is_named_not_taken_for_no_checkpoint(tmp_path, kind):
    """Before: a tracker that was a pipe, a folder or a broken link counted as absent, and a run
    with ``--load`` on a folder holding iter_0000006 trained from scratch with exit 0. The pipe is
    never opened (reading it would wait for a writer forever)."""
    (tmp_path / "iter_0000006").mkdir()
    tracker = tmp_path / ckpt.TRACKER_FILENAME
    {"named pipe": lambda: os.mkfifo(tracker), "folder": tracker.mkdir,
     "symbolic link to nothing": lambda: tracker.symlink_to(tmp_path / "gone")}[kind]()
    with pytest.raises(ckpt.CheckpointError, match=rf"{tracker} is a {kind}, not a tracker file"):
        ckpt.find_checkpoint(str(tmp_path))

"""Hostile checkpoint folders (issue 31's second pass): files that are no regular file (a named
pipe is never opened: ``open`` would block until a writer comes), a tracker naming no
iteration, a checkpoint that records no tokenizer or no args, a folder holding both formats.
Each must end in one line naming the file and the fix, never a hang or a raw library error."""

import json
import os
import signal

import pytest
import torch

from megatron.checkpointing import CheckpointError, legacy, torch_dist
from megatron.checkpointing.checkpoint_folder import find_checkpoint
from megatron.core.dist_checkpointing.checkpoint_io import UnreadableFileError, load_torch_file
from megatron.usage_error import UsageError

MODEL_ARGS = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, seq_length=16, max_position_embeddings=16,
                  padded_vocab_size=128, tensor_model_parallel_size=1,
                  pipeline_model_parallel_size=1)


@pytest.fixture(autouse=True)
def no_hang():
    """A blocking ``open`` of a pipe fails the test after 20 s instead of hanging the suite, also
    where the code under test catches the interruption and goes on (it once did: the test passed
    after a 20 s wait)."""
    blocked = []

    def hung(*_):
        blocked.append(True)
        raise AssertionError("blocked: a file that is not a regular one was opened")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
    assert not blocked, "blocked for 20 s opening a file that is not a regular one"


def _checkpoint_folder(root, iteration=2, legacy_shard=False):
    os.makedirs(root / f"iter_{iteration:07d}" / ("mp_rank_00" if legacy_shard else ""))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root / f"iter_{iteration:07d}"


def _legacy(root, args):
    folder = _checkpoint_folder(root, legacy_shard=True)
    torch.save({"args": args, "iteration": 2, "checkpoint_version": 3.0},
               folder / "mp_rank_00" / "model_optim_rng.pt")
    return str(root)


def test_a_metadata_json_that_is_a_pipe_is_named_not_opened(tmp_path):
    folder = _checkpoint_folder(tmp_path)
    os.mkfifo(folder / "metadata.json")
    from megatron.checkpointing import looks_complete
    from megatron.inference.model_loader import checkpoint_args

    with pytest.raises(CheckpointError, match=r"metadata.json is no regular file"):
        checkpoint_args(str(tmp_path))
    assert looks_complete(str(folder)) is False


def test_a_legacy_shard_that_is_a_pipe_is_named_not_opened(tmp_path):
    folder = _checkpoint_folder(tmp_path, legacy_shard=True)
    shard = folder / "mp_rank_00" / "model_optim_rng.pt"
    os.mkfifo(shard)
    assert legacy.looks_complete(str(folder)) is False
    with pytest.raises(UnreadableFileError, match=r"model_optim_rng.pt: it is no regular file"):
        load_torch_file(str(shard), what="checkpoint shard")
    from megatron.inference.model_loader import checkpoint_args

    with pytest.raises(CheckpointError, match=r"no regular file"):
        checkpoint_args(str(tmp_path))


def test_a_common_pt_that_is_a_pipe_is_named_not_opened(tmp_path):
    folder = _checkpoint_folder(tmp_path)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                     "format_version": 1}))
    os.mkfifo(folder / "common.pt")
    with pytest.raises(CheckpointError, match=r"common.pt: it is no regular file"):
        torch_dist.read_common(str(folder))


@pytest.mark.parametrize("text", ["-2", "2.0", "9" * 5000, "\u00b2", "0x10"])
def test_a_tracker_naming_no_iteration_is_refused_in_a_short_line(tmp_path, text):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(text)
    with pytest.raises(CheckpointError, match="must hold an iteration number") as e:
        find_checkpoint(str(tmp_path))
    assert len(str(e.value)) < 300


def test_a_tracker_that_is_a_pipe_reaches_the_converter_as_its_own_line(tmp_path):
    from tools.checkpoint.loader_megatron import find_shards

    os.mkfifo(tmp_path / "latest_checkpointed_iteration.txt")
    with pytest.raises(CheckpointError, match="is a named pipe, not a tracker file"):
        find_shards(str(tmp_path))


def test_use_checkpoint_args_names_the_missing_tokenizer_settings(tmp_path):
    """A checkpoint without tokenizer settings: the error says so and names the flags to give,
    instead of validation blaming one tokenizer flag as if the user had forgotten it."""
    from megatron.arguments import load_args_from_checkpoint, parse_args

    load = _legacy(tmp_path, dict(MODEL_ARGS))
    args = parse_args(["--load", load, "--use-checkpoint-args", "--micro-batch-size", "1",
                       "--train-iters", "1", "--lr", "1e-3", "--mock-data"])
    with pytest.raises(UsageError, match=r"records no tokenizer settings; give the tokenizer: "
                                         r"--tokenizer-type"):
        load_args_from_checkpoint(args)
    assert args.num_layers == 2  # the model's sizes were still taken


def test_generation_names_the_missing_tokenizer_settings(tmp_path):
    import argparse

    from megatron.inference.launch import tokenizer_of

    none = argparse.Namespace(load=str(tmp_path), tokenizer_type=None, tokenizer_model=None,
                              tokenizer_name_or_path=None)
    with pytest.raises(UsageError, match=r"records no tokenizer settings.*--tokenizer-type"):
        tokenizer_of(none, dict(MODEL_ARGS))


def test_a_torch_dist_common_pt_without_args_is_named_for_generation(tmp_path, monkeypatch):
    from megatron.inference import model_loader

    folder = _checkpoint_folder(tmp_path)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                     "format_version": 1}))
    monkeypatch.setattr(torch_dist, "read_common", lambda f: {"format_version": 1, "iteration": 2})
    with pytest.raises(CheckpointError, match=r"common.pt records no args"):
        model_loader.checkpoint_args(str(tmp_path))


@pytest.mark.parametrize("torch_dist_files", [["metadata.json", "common.pt", "__0_0.distcp"],
                                              ["common.pt", "__0_0.distcp", ".metadata"]])
def test_a_folder_holding_both_formats_is_refused_naming_both(tmp_path, torch_dist_files):
    """Legacy shards copied beside a torch_dist save (or the reverse, metadata.json lost):
    before, whichever format the folder looked like was loaded and the other silently
    ignored."""
    from megatron.arguments import load_args_from_checkpoint, parse_args
    from megatron.inference.model_loader import checkpoint_args

    load = _legacy(tmp_path, dict(MODEL_ARGS, tokenizer_type="NullTokenizer", vocab_size=127))
    folder = tmp_path / "iter_0000002"
    for name in torch_dist_files:
        (folder / name).write_text(json.dumps({"sharded_backend": "torch_dist",
                                               "format_version": 1}))
    expected = r"holds files of two checkpoint formats: torch_dist \(.*\) and legacy .*mp_rank_00"
    with pytest.raises(CheckpointError, match=expected):
        checkpoint_args(load)
    args = parse_args(["--load", load, "--use-checkpoint-args", "--micro-batch-size", "1",
                       "--train-iters", "1", "--lr", "1e-3", "--mock-data"])
    with pytest.raises(CheckpointError, match=expected):
        load_args_from_checkpoint(args)


def test_generation_names_a_load_that_is_a_file_or_missing(tmp_path):
    from megatron.inference.model_loader import checkpoint_args

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration.txt is a file: give "
                                              r"the checkpoint folder"):
        checkpoint_args(str(tmp_path / "latest_checkpointed_iteration.txt"))
    with pytest.raises(CheckpointError, match=r"nope does not exist: give the checkpoint folder"):
        checkpoint_args(str(tmp_path / "nope"))

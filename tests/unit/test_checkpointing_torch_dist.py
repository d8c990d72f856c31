"""megatron.checkpointing.torch_dist's plain parts: the common file of a checkpoint read and
refused naming it."""

import re

import pytest
import torch

from megatron.checkpointing import torch_dist
from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError


@pytest.mark.parametrize("version", ["1", [1], 1.5, True, {"v": 1}])
def test_a_common_file_whose_format_version_is_no_integer_is_refused_naming_it(tmp_path, version):
    path = tmp_path / torch_dist.COMMON_FILE
    torch.save({"format_version": version, "iteration": 4}, str(path))
    with pytest.raises(CheckpointError, match="^" + re.escape(
            f"{path} has format version {version!r}: not an integer; it is not the common part "
            "of a torch_dist checkpoint this code wrote") + "$"):
        torch_dist.read_common(str(tmp_path))


def test_a_newer_format_version_is_refused_and_the_current_one_read(tmp_path):
    path = tmp_path / torch_dist.COMMON_FILE
    torch.save({"format_version": torch_dist.FORMAT_VERSION + 1}, str(path))
    with pytest.raises(CheckpointError, match=r"has format version 2; this code reads up to 1$"):
        torch_dist.read_common(str(tmp_path))
    torch.save(_common(4), str(path))
    assert torch_dist.read_common(str(tmp_path))["iteration"] == 4


def _common(iteration):
    return torch_dist.common_state(iteration, None, None, {}, torch_dist.Layout(), None, 32, 0)


@pytest.mark.parametrize("drop, named", [
    ("iteration", "iteration (missing)"), ("layout", "layout (missing)"),
    ("consumed_train_samples", "consumed_train_samples (missing)"),
    ("layout.data_parallel_size", "layout.data_parallel_size (missing)"),
    ("rng_state.states", "rng_state (without states)"),
    ("iteration=str", "iteration (a str)"),
])
def test_a_common_file_missing_keys_is_refused_naming_them(tmp_path, drop, named):
    """Issue 31: loading such a file ended in a bare KeyError ('layout')."""
    common = _common(4)
    common["rng_state"] = {"tp": 1, "pp": 1, "dp": 1, "states": [[[{}]]]}
    if drop == "iteration=str":
        common["iteration"] = "4"
    elif "." in drop:
        outer, inner = drop.split(".")
        del common[outer][inner]
    else:
        del common[drop]
    path = tmp_path / torch_dist.COMMON_FILE
    torch.save(common, str(path))
    with pytest.raises(CheckpointError, match="^" + re.escape(
            f"{path} is not the common part of a complete torch_dist checkpoint: {named}; it is "
            "damaged or was not written by this code") + "$"):
        torch_dist.read_common(str(tmp_path))


def test_megatron_lm_s_own_torch_dist_checkpoint_is_named_as_such(tmp_path):
    # Megatron-Core's metadata.json holds the four backend keys only (ours adds format_version);
    # its common.pt pickles the run's argparse.Namespace (refused by weights_only).
    import argparse
    import json

    (tmp_path / torch_dist.METADATA_JSON).write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"args": argparse.Namespace(num_layers=2), "iteration": 4},
               str(tmp_path / torch_dist.COMMON_FILE))
    assert torch_dist.is_torch_dist_checkpoint(str(tmp_path))
    with pytest.raises(torch_dist.CheckpointMismatchError, match="^" + re.escape(
            f"{tmp_path} is a torch_dist checkpoint of Megatron-LM itself (its metadata.json "
            "has no format_version), not one of ours: --load reads its weights at any layout "
            "(megatron.checkpointing.foreign.megatron_lm_dist), tools/checkpoint/convert.py "
            "--loader megatron-lm converts it") + "$"):
        torch_dist.read_common(str(tmp_path))


def test_a_metadata_json_naming_another_backend_version_is_refused_naming_it(tmp_path):
    import json

    (tmp_path / torch_dist.METADATA_JSON).write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 99,
         "common_backend": "torch", "common_backend_version": 1,
         "format_version": torch_dist.FORMAT_VERSION}))
    torch.save({"format_version": torch_dist.FORMAT_VERSION, "iteration": 4},
               str(tmp_path / torch_dist.COMMON_FILE))
    with pytest.raises(CheckpointError, match=re.escape(
            "names {'sharded_backend_version': 99}; this code reads "
            "{'sharded_backend_version': 1}: load it with the version that wrote it")):
        torch_dist.read_common(str(tmp_path))


@pytest.mark.parametrize("content, why", [
    (b"[" * 100000, "RecursionError"),                       # was a 43-line traceback
    (b'{"sharded_backend": "\xff"}', "UnicodeDecodeError"),  # was taken for a legacy checkpoint
])
def test_a_metadata_json_that_is_no_json_is_named(tmp_path, content, why):
    (tmp_path / torch_dist.METADATA_JSON).write_bytes(content)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tmp_path / torch_dist.METADATA_JSON} cannot be read as JSON ({why}")):
        torch_dist.is_torch_dist_checkpoint(str(tmp_path))


@pytest.mark.parametrize("backend", ["\ud800", "zarr", None])
def test_a_metadata_json_naming_another_backend_is_named(tmp_path, backend):
    import json

    (tmp_path / torch_dist.METADATA_JSON).write_text(json.dumps({"sharded_backend": backend}))
    with pytest.raises(CheckpointError, match=re.escape(
            f"names sharded_backend {backend!r}: only torch_dist")):
        torch_dist.is_torch_dist_checkpoint(str(tmp_path))

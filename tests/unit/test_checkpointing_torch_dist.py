"""megatron.checkpointing_torch_dist's plain parts: the common file of a checkpoint read and
refused naming it."""

import re

import pytest
import torch

from megatron import checkpointing_torch_dist as torch_dist
from megatron.checkpoint_io import CheckpointError


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
    torch.save({"format_version": torch_dist.FORMAT_VERSION, "iteration": 4}, str(path))
    assert torch_dist.read_common(str(tmp_path))["iteration"] == 4

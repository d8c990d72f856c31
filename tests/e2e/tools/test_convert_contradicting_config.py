"""A HuggingFace folder whose config.json contradicts its tensors' shapes (issue 31's hostile
pass): the converter must stop with one line naming the tensor and write no checkpoint. Before,
a doubled ``hidden_size`` converted with status 0 into a checkpoint whose recorded sizes its
tensors did not have."""

import contextlib
import io
import json
import os

import pytest

from tests.helpers.convert import make_hf


@pytest.mark.parametrize("field, tensor", [("hidden_size", "model.embed_tokens.weight"),
                                           ("intermediate_size", "mlp.gate_proj.weight"),
                                           ("num_key_value_heads", "self_attn.k_proj.weight")])
def test_a_config_contradicting_the_tensors_is_refused_naming_the_tensor(tmp_path, field, tensor):
    from tools.checkpoint import convert

    hf = str(tmp_path / "hf")
    make_hf(hf)
    path = os.path.join(hf, "config.json")
    config = json.load(open(path))
    config[field] = config[field] * 2
    json.dump(config, open(path, "w"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = convert.command(["--loader", "hf", "--saver", "megatron", "--load-dir", hf,
                                  "--save-dir", str(tmp_path / "out")])
    lines = err.getvalue().strip().splitlines()
    assert status == 2, err.getvalue()
    assert len(lines) == 1 and f"{tensor} has shape" in lines[0], lines
    assert "config.json implies" in lines[0]
    assert not os.path.exists(tmp_path / "out" / "latest_checkpointed_iteration.txt")

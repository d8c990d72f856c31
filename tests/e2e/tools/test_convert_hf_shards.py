"""HF export buffers shards on disk: the shards hold exactly the tensors, no spill file is left
behind, shards respect --max-shard-size, and the buffered tensors are file-backed (not anonymous
memory)."""

import json
import os

import pytest
import torch

from tests.helpers.convert import convert, make_hf
from tools.checkpoint import saver_hf


def test_export_leaves_only_the_model_and_respects_shard_size(tmp_path):
    from safetensors.torch import load_file

    make_hf(str(tmp_path / "src"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "src", "--save-dir",
            tmp_path / "ours", "--target-tensor-parallel-size", 2)
    convert("--loader", "megatron", "--saver", "hf", "--load-dir", tmp_path / "ours",
            "--save-dir", tmp_path / "hf", "--tokenizer-dir", tmp_path / "src",
            "--max-shard-size", "40KB")
    names = sorted(os.listdir(tmp_path / "hf"))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 2
    assert set(names) - set(shards) == {"config.json", "model.safetensors.index.json",
                                        "tokenizer.model", "generation_config.json"}
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    for shard in shards:
        tensors = load_file(str(tmp_path / "hf" / shard))
        payload = sum(t.numel() * t.element_size() for t in tensors.values())
        assert len(tensors) == 1 or payload <= 40_000, shard
        assert all(index["weight_map"][k] == shard for k in tensors)
    original = load_file(str(tmp_path / "src" / "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(original)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
def test_buffered_tensors_are_memory_mapped_copies(tmp_path):
    writer = saver_hf._ShardWriter(str(tmp_path), max_bytes=10**9)
    padded = torch.randn(1000, 4)
    writer.add("a", padded[:7])  # a view: only its own rows may be spilled
    writer.add("b", torch.arange(6.0))
    writer.spill()
    assert not writer.fresh and len(writer.spills) == 1
    assert os.path.getsize(writer.spills[0]) < 7 * 4 * 4 + 6 * 4 + 2000
    assert torch.equal(writer.pending["a"], padded[:7])
    assert torch.equal(writer.pending["b"], torch.arange(6.0))
    # file-backed, not anonymous memory: the bytes lie in a mapping of the spill file
    for name in ("a", "b"):
        assert _mapped_file(writer.pending[name].data_ptr()) == writer.spills[0], name
    writer.finish()
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def _mapped_file(address: int):
    """The file mapped at ``address`` in this process (/proc/self/maps), None if anonymous."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None

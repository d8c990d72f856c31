"""megatron/hf_folder.py: HuggingFace folders that ask to run code are refused naming the file and
the key; index entries may not leave the model folder (the hub cache's blob links may)."""

import json
import os

import pytest

from megatron.hf_folder import refuse_custom_code, weight_map

AUTO_MAP = {"AutoTokenizer": ["evil.EvilTokenizer", None]}


def _folder(path, files):
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_standard_folder_passes(tmp_path):
    refuse_custom_code(_folder(tmp_path / "ok", {
        "config.json": {"model_type": "llama"}, "tokenizer_config.json": {"eos_token": "</s>"},
        "tokenizer.json": {"auto_map": "a tokenizer.json is data, never read as a config"},
        "README.md": "x"}), "--load-dir")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "processor_config.json"])
def test_auto_map_in_any_config_is_refused_naming_file_and_key(tmp_path, name):
    folder = _folder(tmp_path / "m", {"config.json": {"model_type": "llama"}, name: {
        "model_type": "llama", "auto_map": AUTO_MAP}})
    with pytest.raises(ValueError) as err:
        refuse_custom_code(folder, "--tokenizer-name-or-path")
    message = str(err.value)
    assert message.startswith(f"--tokenizer-name-or-path {folder}: {os.path.join(folder, name)} "
                              "asks to run code from the folder (auto_map: ")
    assert "evil.EvilTokenizer" in message and "trust_remote_code=False" in message


@pytest.mark.parametrize("name", ["evil.py", os.path.join("pkg", "modeling.py")])
def test_python_files_are_refused(tmp_path, name):
    folder = _folder(tmp_path / "m", {"config.json": {}, name: "print('ran')"})
    with pytest.raises(ValueError, match=r"the folder ships Python code \(.*" + os.path.basename(name)):
        refuse_custom_code(folder, "--load-dir")


def test_unreadable_config_is_named(tmp_path):
    folder = _folder(tmp_path / "m", {"tokenizer_config.json": "{not json"})
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not readable JSON"):
        refuse_custom_code(folder, "--load-dir")


@pytest.mark.parametrize("name", ["chat_template.jinja",
                                  os.path.join("additional_chat_templates", "tool_use.jinja")])
def test_a_chat_template_that_is_not_utf8_is_named(tmp_path, name):
    """The fourth hostile pass: transformers' "'utf-8' codec can't decode byte 0xff" named
    neither the file nor the folder."""
    folder = _folder(tmp_path / "m", {"tokenizer_config.json": {}})
    os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(b"{{ messages }}\xff")
    with pytest.raises(ValueError, match=rf"^--tokenizer-name-or-path {folder}: "
                                         rf"{os.path.join(folder, name)} is not UTF-8 text"):
        refuse_custom_code(folder, "--tokenizer-name-or-path")


def _index(folder, entry):
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump({"metadata": {}, "weight_map": {"a": "model-1.safetensors", "b": entry}}, f)
    return path


def test_index_entries_inside_the_folder_resolve(tmp_path):
    folder = _folder(tmp_path / "m", {"model-1.safetensors": "", "sub/model-2.safetensors": ""})
    where = weight_map(_index(folder, "sub/model-2.safetensors"), folder)
    assert where == {"a": os.path.join(folder, "model-1.safetensors"),
                     "b": os.path.join(folder, "sub/model-2.safetensors")}


def test_index_entries_leaving_the_folder_are_refused(tmp_path):
    outside = _folder(tmp_path / "elsewhere", {"secret.safetensors": ""})
    folder = _folder(tmp_path / "m", {"model-1.safetensors": ""})
    os.symlink(os.path.join(outside, "secret.safetensors"), os.path.join(folder, "link.safetensors"))
    for entry, why in ((os.path.join(outside, "secret.safetensors"), "a path outside"),
                       ("../elsewhere/secret.safetensors", "a path outside"),
                       ("link.safetensors", "a link resolving outside the model folder, to "
                        + os.path.realpath(os.path.join(outside, "secret.safetensors"))),
                       ("", "not a file name")):
        index = _index(folder, entry)
        with pytest.raises(ValueError) as err:
            weight_map(index, folder)
        assert str(err.value).startswith(f"{index}: weight_map entry 'b': {entry!r} is {why}"), entry


def test_hub_cache_snapshot_links_into_its_blobs_are_allowed(tmp_path):
    repo = tmp_path / "models--org--tiny"
    blobs = _folder(repo / "blobs", {"0123abcd": ""})
    snapshot = _folder(repo / "snapshots" / "rev1", {"model-1.safetensors": ""})
    os.symlink(os.path.join("..", "..", "blobs", "0123abcd"),
               os.path.join(snapshot, "model-2.safetensors"))
    where = weight_map(_index(snapshot, "model-2.safetensors"), snapshot)
    assert os.path.realpath(where["b"]) == os.path.realpath(os.path.join(blobs, "0123abcd"))


def test_index_without_weight_map_is_named(tmp_path):
    folder = _folder(tmp_path / "m", {"model.safetensors.index.json": {"metadata": {}}})
    with pytest.raises(ValueError, match="not a checkpoint index with a weight_map"):
        weight_map(os.path.join(folder, "model.safetensors.index.json"), folder)


# Issue 31: a tokenizer file (or any file the converter reads or copies) linked to a file outside
# the folder was copied into the export / read as the folder's.
def _linked_out(tmp_path, name):
    secret = _folder(tmp_path / "elsewhere", {"secret": "outside content"})
    folder = _folder(tmp_path / "m", {"config.json": {"model_type": "llama"}})
    os.symlink(os.path.join(secret, "secret"), os.path.join(folder, name))
    return folder, os.path.realpath(os.path.join(secret, "secret"))


@pytest.mark.parametrize("name", ["tokenizer.model", "tokenizer.json", "special_tokens_map.json",
                                  "model.safetensors"])
def test_a_file_linked_outside_the_folder_is_refused(tmp_path, name):
    folder, real = _linked_out(tmp_path, name)
    with pytest.raises(ValueError) as err:
        refuse_custom_code(folder, "--load-dir")
    assert str(err.value).startswith(f"--load-dir {folder}: {name} is a link resolving outside "
                                     f"the folder, to {real}; refused"), err.value


def test_links_inside_the_folder_and_into_hub_blobs_pass(tmp_path):
    folder = _folder(tmp_path / "m", {"config.json": {}, "real.model": "x"})
    os.symlink("real.model", os.path.join(folder, "tokenizer.model"))
    refuse_custom_code(folder, "--load-dir")
    repo = tmp_path / "models--org--tiny"
    _folder(repo / "blobs", {"0123abcd": "{}"})
    snapshot = _folder(repo / "snapshots" / "rev1", {})
    os.symlink(os.path.join("..", "..", "blobs", "0123abcd"), os.path.join(snapshot, "config.json"))
    refuse_custom_code(snapshot, "--load-dir")


def test_tokenizer_info_refuses_a_linked_file(tmp_path):
    from tools.checkpoint.tokenizer_files import tokenizer_info

    folder, real = _linked_out(tmp_path, "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer\.json is a link resolving outside the folder"):
        tokenizer_info(folder)


def test_import_and_export_refuse_a_tokenizer_linked_outside(tmp_path):
    """Import (loader_hf) stops before reading anything; export (saver_hf) before writing, and
    the outside file is not copied."""
    import argparse

    from tools.checkpoint import loader_hf, saver_hf

    folder, _ = _linked_out(tmp_path, "tokenizer.model")
    with pytest.raises(ValueError, match=r"--load-dir .*tokenizer\.model is a link resolving"):
        loader_hf.load_checkpoint(argparse.Namespace(load_dir=folder, allow_unknown_hf_fields=False))
    out = tmp_path / "export"
    args = argparse.Namespace(target_tensor_parallel_size=None, target_pipeline_parallel_size=None,
                              tokenizer_dir=folder, save_dir=str(out), target_params_dtype="fp32",
                              max_shard_size=None)
    with pytest.raises(ValueError, match=r"--tokenizer-dir .*tokenizer\.model is a link resolving"):
        saver_hf.save_checkpoint({"true_vocab_size": 8}, iter(()), args)
    assert not (out / "tokenizer.model").exists()


def _lying_safetensors(path, how):
    import struct

    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4), "b": torch.ones(2, 3)}, path)
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    if how == "offsets":
        header["b"]["data_offsets"] = [16, 9999]
    elif how == "shape":
        header["b"]["shape"] = [1000, 1000]
    text = json.dumps(header).encode()
    length = 10 ** 12 if how == "header length" else len(text)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length) + text + raw[8 + n:])


@pytest.mark.parametrize("how", ["offsets", "shape", "header length"])
def test_a_safetensors_header_that_lies_is_named_in_one_line(tmp_path, how):
    """Issue 31: safetensors' own SafetensorError reached the user."""
    from tools.checkpoint.loader_hf import HFWeights

    folder = _folder(tmp_path / "m", {})
    path = os.path.join(folder, "model.safetensors")
    _lying_safetensors(path, how)
    with pytest.raises(ValueError) as err:
        HFWeights(folder).get("model.embed_tokens.weight")
    message = str(err.value)
    assert message.startswith(f"{path} is not a valid safetensors file (") and "\n" not in message
    assert message.endswith("re-download or re-convert it")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_an_index_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO without a writer blocks forever; the index is checked to be a plain file."""
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    with pytest.raises(ValueError, match="not a regular file"):
        weight_map(str(index), str(tmp_path))


def test_a_tensor_named_twice_in_a_safetensors_header_or_an_index_is_refused(tmp_path):
    """The fourth hostile pass: safetensors keeps the last of two equal names silently."""
    import struct

    from megatron.hf_folder import open_safetensors

    path = str(tmp_path / "model.safetensors")
    text = ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            '"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}').encode()
    text = text.ljust((len(text) + 7) // 8 * 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + bytes(8))
    with pytest.raises(ValueError, match=r"model.safetensors names the tensor 'a' twice"):
        open_safetensors(path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "model.safetensors", "a": "other.safetensors"}}')
    with pytest.raises(ValueError, match=r"index.json: 'a' appears twice"):
        weight_map(str(index), str(tmp_path))

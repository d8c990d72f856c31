"""A third hostile pass over the faults of issue 31, by someone who did not write the fixes: new
variants of the classes where the second pass failed (hostile files in the ``--save`` folder,
HuggingFace folders and index files, the export's tokenizer copy). Cases that held are regression
tests; cases that failed are ``xfail(strict=True)`` (drop the marker with the fix). The promise
(docs/reliability.md): one line naming the file and the fix, exit 2 (1 for a runtime fault), no
traceback, nothing lost, no hang, nothing outside the named folders read or copied."""

import glob
import os
import subprocess
import sys

import pytest
import torch

from megatron.checkpointing import checkpoint_folder, save_folder
from megatron.usage_error import UsageError
from tests.e2e.test_hostile_pass2 import _within
from tests.helpers.paths import ROOT

TRACKER = checkpoint_folder.TRACKER_FILENAME


def _release_readers(fifo):
    """Let a thread blocked opening ``fifo`` for reading go on (a writer appears and leaves)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


# --- the --save folder: the tracker's temporary as a link --------------------------------------

@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_tracker_temporary_that_is_a_link_is_refused_at_start(tmp_path, where):
    save = tmp_path / "save"
    save.mkdir()
    target = (tmp_path / "victim.txt") if where == "outside" else (save / "x")
    target.write_text("VICTIM\n")
    os.symlink(target, save / (TRACKER + ".tmp"))
    with pytest.raises(UsageError, match=TRACKER):
        save_folder.check_tracker_files(str(save))


def test_a_tracker_that_is_a_link_to_an_outside_file_is_replaced_and_the_file_kept(tmp_path):
    save = tmp_path / "save"
    (save / "iter_0000002.tmp").mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("VICTIM\n")
    os.symlink(victim, save / TRACKER)
    save_folder.check_tracker_files(str(save))
    checkpoint_folder.publish(str(save), str(save / "iter_0000002.tmp"),
                              str(save / "iter_0000002"), 2, 0)
    assert victim.read_text() == "VICTIM\n"
    assert not os.path.islink(save / TRACKER) and (save / TRACKER).read_text() == "2"


# --- the --save folder: named pipes under the names a save removes ----------------------------

def _publish_over(tmp_path, name):
    save = tmp_path / "save"
    (save / "iter_0000002.tmp").mkdir(parents=True)
    os.mkfifo(save / name)
    how, value = _within(30, checkpoint_folder.publish, str(save), str(save / "iter_0000002.tmp"),
                         str(save / "iter_0000002"), 2, 0)
    _release_readers(str(save / name))
    _release_readers(str(save / (name + ".old")))
    return how, value


@pytest.mark.parametrize("name", ["iter_0000002", "iter_0000002.old", "iter_0000099.tmp"])
def test_a_pipe_under_a_name_the_save_removes_does_not_hang_it(tmp_path, name):
    how, value = _publish_over(tmp_path, name)
    assert how != "hung", f"publish hung on {name}, a named pipe"


def test_a_staging_name_that_is_a_pipe_does_not_hang_the_save(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    os.mkfifo(save / "iter_0000002.tmp")
    how, value = _within(30, checkpoint_folder.prepare_staging, str(save),
                         str(save / "iter_0000002.tmp"))
    _release_readers(str(save / "iter_0000002.tmp"))
    assert how != "hung", "prepare_staging hung on a named pipe"


@pytest.mark.parametrize("kind", ["file", "dangling link", "link to an outside folder"])
def test_a_staging_name_that_is_not_a_folder_is_replaced_inside_the_save_folder(tmp_path, kind):
    """A leftover ``iter_N.tmp`` that is a file or a link is this job's staging name: the save
    replaces it with a real folder inside --save and writes nothing through a planted link."""
    save, outside = tmp_path / "save", tmp_path / "outside"
    save.mkdir()
    outside.mkdir()
    (outside / "kept").write_text("x")
    staging = save / "iter_0000002.tmp"
    if kind == "file":
        staging.write_text("x")
    else:
        os.symlink(outside if kind.endswith("folder") else tmp_path / "nowhere", staging)
    checkpoint_folder.prepare_staging(str(save), str(staging))
    assert staging.is_dir() and not staging.is_symlink()
    assert sorted(os.listdir(outside)) == ["kept"]


def test_a_dangling_link_at_the_saved_iteration_is_named(tmp_path):
    save = tmp_path / "save"
    (save / "iter_0000002.tmp").mkdir(parents=True)
    os.symlink(tmp_path / "nowhere", save / "iter_0000002")
    how, value = _within(30, checkpoint_folder.publish, str(save), str(save / "iter_0000002.tmp"),
                         str(save / "iter_0000002"), 2, 0)
    assert how == "returned" or (how == "raised" and not isinstance(value, OSError)), (how, value)


def test_a_regular_file_at_the_saved_iteration_is_moved_aside(tmp_path):
    save = tmp_path / "save"
    (save / "iter_0000002.tmp" / "mp_rank_00").mkdir(parents=True)
    (save / "iter_0000002").write_text("x")
    checkpoint_folder.publish(str(save), str(save / "iter_0000002.tmp"),
                              str(save / "iter_0000002"), 2, 0)
    assert (save / "iter_0000002" / "mp_rank_00").is_dir() and (save / TRACKER).read_text() == "2"


# --- HuggingFace index files -----------------------------------------------------------------

def test_a_deeply_nested_index_is_refused_in_one_line(tmp_path):
    from megatron.hf_folder import weight_map

    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map":' + "[" * 100000)
    with pytest.raises(ValueError, match="index"):
        weight_map(str(index), str(tmp_path))


def test_an_index_entry_with_a_lone_surrogate_is_named(tmp_path):
    from megatron.hf_folder import weight_map

    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"model.embed_tokens.weight": "\\ud800.safetensors"}}')
    with pytest.raises(ValueError, match="weight_map entry"):
        weight_map(str(index), str(tmp_path))


def test_an_index_of_bytes_that_are_not_utf8_is_named(tmp_path):
    from megatron.hf_folder import weight_map

    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(b'{"weight_map": {"a": "\xff.safetensors"}}')
    with pytest.raises(ValueError, match="not a checkpoint index"):
        weight_map(str(index), str(tmp_path))


# --- the export copies the files of a folder the checkpoint names ------------------------------

def _crafted_export(tmp_path, make_folder):
    from tests.helpers.convert import convert, make_hf

    named = tmp_path / "named"
    named.mkdir()
    make_folder(named)
    make_hf(str(tmp_path / "hf"))
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", tmp_path / "hf",
            "--save-dir", tmp_path / "meg")
    for path in glob.glob(str(tmp_path / "meg" / "**" / "model_optim_rng.pt"), recursive=True):
        state = torch.load(path, weights_only=True)
        state["args"]["tokenizer_model"] = str(named)  # what a crafted checkpoint records
        state["args"]["tokenizer_name_or_path"] = str(named)
        torch.save(state, path)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"),
                          "--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                          "--load-dir", str(tmp_path / "meg"), "--save-dir", str(tmp_path / "export")],
                         capture_output=True, text=True, timeout=900)
    return out


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_export_copies_nothing_from_a_folder_only_the_checkpoint_names(tmp_path, with_tokenizer):
    """Not even a folder holding a tokenizer that loads (someone's private one at a guessable
    path, the fourth hostile pass): the recorded path lies outside --load-dir."""
    def private(folder):
        (folder / "tokenizer_config.json").write_text('{"secret": "PRIVATE"}')
        (folder / "chat_template.jinja").write_text("PRIVATE TEMPLATE")
        if with_tokenizer:  # a SentencePiece model that loads
            import io

            import sentencepiece as spm

            model = io.BytesIO()
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(["the quick brown fox jumps over the lazy dog"] * 50),
                model_writer=model, vocab_size=30, model_type="bpe", minloglevel=2)
            (folder / "tokenizer.model").write_bytes(model.getvalue())

    _crafted_export(tmp_path, private)
    copied = [p for p in glob.glob(str(tmp_path / "export" / "*"))
              if b"PRIVATE" in open(p, "rb").read()]
    assert not copied, f"{copied} copied from a folder named only by the checkpoint"
    assert not (tmp_path / "export" / "tokenizer.model").exists()


def test_export_reads_nothing_of_a_named_folder_whose_tokenizer_links_outside(tmp_path):
    """A folder outside --load-dir that the checkpoint records is not read (its links are not
    followed); the line says which flag copies it."""
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY MATERIAL\n")
    out = _crafted_export(tmp_path, lambda folder: os.symlink(secret, folder / "tokenizer.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"no tokenizer files copied: the checkpoint records {tmp_path / 'named'}, outside " \
           f"--load-dir; pass --tokenizer-dir {tmp_path / 'named'}" in out.stdout, out.stdout[-2000:]
    assert not [p for p in glob.glob(str(tmp_path / "export" / "*"))
                if b"PRIVATE KEY" in open(p, "rb").read()]

"""HuggingFace model and tokenizer folders, read as data only.

A HuggingFace folder can ask its reader to run Python shipped with it: an ``auto_map`` entry in
``config.json`` / ``tokenizer_config.json`` (or another ``*config*.json``) names a class in a
``*.py`` file of the folder, and ``transformers`` then asks on standard input whether to run it
(and runs it on "y"). Nothing here ever runs such code: :func:`refuse_custom_code` refuses the
folder before ``transformers`` is imported, every ``from_pretrained`` passes
``trust_remote_code=False``, and standard input is never read.

A sharded checkpoint's ``model.safetensors.index.json`` (``pytorch_model.bin.index.json``) maps
each tensor to a shard file; :func:`weight_map` refuses entries that leave the folder. Every other
file of the folder (``tokenizer.model``, ``tokenizer.json``, configs, a single weights file) is
read or copied by the converter: :func:`refuse_custom_code` also refuses a symbolic link among them
that resolves outside the folder (an export would otherwise carry that outside file along), and
:func:`file_in_folder` checks one file before it is read.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

# Keys of a HuggingFace config that make transformers import code (``auto_map``: Auto* class ->
# "module.Class" in a file of the folder or of another hub repository).
CUSTOM_CODE_KEYS = ("auto_map",)


def _config_files(folder: str) -> list:
    return sorted(glob.glob(os.path.join(glob.escape(folder), "*config*.json")))


def _python_files(folder: str) -> list:
    """``*.py`` files of ``folder`` and of its direct subfolders (a dynamic module is a file of the
    folder; one level below covers a copied repository's package)."""
    found = []
    for pattern in ("*.py", os.path.join("*", "*.py")):
        found += glob.glob(os.path.join(glob.escape(folder), pattern))
    return sorted(found)


def refuse_custom_code(folder: str, flag: str) -> None:
    """Refuse a HuggingFace folder that asks to run code of its own.

    Args:
        folder: a local model or tokenizer folder.
        flag: the flag that named it (``--tokenizer-name-or-path``, ``--load-dir``), for messages.

    Raises:
        ValueError: a ``*config*.json`` of the folder has an ``auto_map`` entry, is not valid JSON,
            is no regular file (never opened: a named pipe would block), or the folder holds ``*.py`` files, or a file of the folder is a link leaving it
            (:func:`refuse_links_leaving`); the message names the folder, the file and the key.
    """
    fix = ("custom code is never run here (trust_remote_code=False); use a folder with the "
           "standard files only (tokenizer.json or tokenizer.model, config.json without auto_map, "
           "no .py files)")
    for path in _config_files(folder):
        _refuse_special(path, f"{flag} {folder}: ")
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            if isinstance(exc, RecursionError):
                exc = "nested deeper than a JSON parser goes"
            raise ValueError(f"{flag} {folder}: {path} is not readable JSON ({exc})") from None
        for key in CUSTOM_CODE_KEYS:
            if isinstance(config, dict) and key in config:
                raise ValueError(f"{flag} {folder}: {path} asks to run code from the folder "
                                 f"({key}: {json.dumps(config[key])[:200]}); {fix}")
    refuse_links_leaving(folder, flag)
    for path in _template_files(folder):  # transformers' error would name no file
        _refuse_special(path, f"{flag} {folder}: ")
        try:
            with open(path, "rb") as f:
                f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{flag} {folder}: {path} is not UTF-8 text ({exc}); replace the chat "
                             "template with the tokenizer's own") from None
    code = _python_files(folder)
    if code:
        raise ValueError(f"{flag} {folder}: the folder ships Python code ({', '.join(code[:3])}"
                         f"{', ...' if len(code) > 3 else ''}); {fix}")


def _template_files(folder: str) -> list:
    """The chat templates transformers reads as text: ``*.jinja`` in the folder and in its
    ``additional_chat_templates`` subfolder."""
    import glob

    return sorted(glob.glob(os.path.join(glob.escape(folder), "*.jinja"))
                  + glob.glob(os.path.join(glob.escape(folder), "additional_chat_templates", "*.jinja")))


def _refuse_special(path: str, prefix: str = "") -> None:
    """Refuse ``path`` when it exists and is no regular file (a named pipe, a folder, a device:
    opening a pipe for reading waits for a writer forever), looking with ``stat`` only.

    Raises:
        ValueError: ``{prefix}{path} is a named pipe, not a regular file; ...``.
    """
    if os.path.lexists(path) and not os.path.isfile(path):
        from megatron.file_kinds import file_kind

        raise ValueError(f"{prefix}{path} is a {file_kind(path)}, not a regular file; replace it "
                         "with the file it stands for")


def _roots(folder: str) -> list:
    """Real paths shard files may resolve into: the folder, and for a snapshot of the
    HuggingFace hub cache (``models--ORG--NAME/snapshots/REV``, whose files are symlinks to
    ``../../blobs/SHA``) that repository's ``blobs`` folder."""
    real = os.path.realpath(folder)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return roots


def _outside(folder: str, path: str) -> str | None:
    """The real path of ``path`` when it resolves outside ``folder`` (and its hub blobs), else None."""
    real = os.path.realpath(path)
    return None if any(real == r or real.startswith(r + os.sep) for r in _roots(folder)) else real


def _link_error(flag: str, folder: str, path: str, real: str) -> ValueError:
    return ValueError(f"{flag} {folder}: {os.path.basename(path)} is a link resolving outside the "
                      f"folder, to {real}; refused (its content would be read or copied as the "
                      "folder's); copy the file into the folder instead of linking it")


def refuse_links_leaving(folder: str, flag: str) -> None:
    """Refuse a file of ``folder`` (its own entries: what the converter reads or copies) that is a
    symbolic link resolving outside it; links into a hub cache's ``blobs`` are allowed.

    Raises:
        ValueError: naming the flag, the folder, the file and where it leads.
    """
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink():
                real = _outside(folder, entry.path)
                if real is not None:
                    raise _link_error(flag, folder, entry.path, real)


def file_in_folder(folder: str, name: str, flag: str) -> str:
    """``folder/name``, checked not to be a link leaving ``folder`` (it may not exist).

    Raises:
        ValueError: see :func:`refuse_links_leaving`.
    """
    path = os.path.join(folder, name)
    real = _outside(folder, path) if os.path.islink(path) else None
    if real is not None:
        raise _link_error(flag, folder, path, real)
    return path


def open_safetensors(path: str):
    """``safetensors.safe_open(path, framework="pt")``, a header that lies (lengths, offsets,
    shapes that do not fit the file) refused in one line naming the file.

    Raises:
        ValueError: naming the file and safetensors' reason.
    """
    from safetensors import safe_open

    _refuse_special(path)  # safetensors would block on a named pipe, holding the GIL
    try:
        handle = safe_open(path, framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError, from Rust
        raise ValueError(f"{path} is not a valid safetensors file ({exc}): its header does not "
                         "describe its content; re-download or re-convert it") from None
    with open(path, "rb") as f:  # safetensors keeps the last of two equal names: ambiguous
        size = int.from_bytes(f.read(8), "little")
        twice = _first_duplicate_key(f.read(size))
    if twice is not None:
        raise ValueError(f"{path} names the tensor {twice!r} twice in its header, so which "
                         "one is meant is unknown; re-download or re-convert it")
    return handle


def _first_duplicate_key(text) -> Optional[str]:
    """The first key that a JSON object of ``text`` (str or UTF-8 bytes, already known to be
    valid JSON) holds twice, or None."""
    found = []

    def pairs(items):
        names = [k for k, _ in items]
        if not found and len(set(names)) != len(names):
            found.append(next(k for i, k in enumerate(names) if k in names[:i]))
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return found[0] if found else None


def _encodable(name: str) -> bool:
    """Whether ``name`` encodes to a path of this file system (JSON's ``\\ud800`` does not)."""
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        return False
    return True


def weight_map(index_path: str, folder: str) -> dict:
    """``{tensor name: shard path}`` of a ``*.index.json`` of ``folder``.

    Raises:
        ValueError: the index is not a regular file, not valid JSON or has no ``weight_map``, or an entry is not a
            plain file name inside the folder (absolute, ``..``, or a symlink resolving
            outside) or names no regular file (a named pipe); the message names the index file
            and the entry.
    """
    if os.path.exists(index_path) and not os.path.isfile(index_path):  # a FIFO would block open()
        raise ValueError(f"{index_path}: not a regular file (a pipe, device or folder); replace it "
                         "with the checkpoint's index file")
    try:
        with open(index_path, encoding="utf-8") as f:
            text = f.read()
        entries = json.loads(text)["weight_map"]
        items = entries.items()
        twice = _first_duplicate_key(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError, RecursionError) as exc:
        raise ValueError(f"{index_path}: not a checkpoint index with a weight_map "
                         f"({type(exc).__name__}: {exc})") from None
    if twice is not None:
        raise ValueError(f"{index_path}: {twice!r} appears twice in one of its objects, so which "
                         "entry is meant is unknown; fix or replace the index")
    where = {}
    for name, file in items:
        bad = None
        if not isinstance(file, str) or not file:
            bad = "not a file name"
        elif not _encodable(file):
            bad = "not a file name this system can encode (a lone surrogate or similar)"
        elif os.path.isabs(file) or ".." in file.replace("\\", "/").split("/"):
            bad = "a path outside the model folder"
        else:
            real = _outside(folder, os.path.join(folder, file))
            if real is not None:
                bad = f"a link resolving outside the model folder, to {real}"
            else:
                try:
                    _refuse_special(os.path.join(folder, file))
                except ValueError:
                    from megatron.file_kinds import file_kind

                    bad = f"a {file_kind(os.path.join(folder, file))}, not a regular file"
        if bad:
            raise ValueError(f"{index_path}: weight_map entry {name!r}: {file!r} is {bad}; shard "
                             "files must lie in the folder of the index. Fix or replace the index")
        where[name] = os.path.join(folder, file)
    return where

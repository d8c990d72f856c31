"""Read ``torch.save`` files written by other systems without executing anything from them.

Megatron-LM and Megatron-LLaMA pickle Python objects next to the tensors: ``args`` is an
``argparse.Namespace`` (a ``types.SimpleNamespace`` from Megatron-LLaMA's conversion tool)
holding Megatron enums (``megatron.core.enums.ModelType``,
``megatron.core.transformer.enums.AttnBackend``), ``signal.Signals`` and torch dtypes; Megatron-LLaMA's
``rng_state`` holds NumPy's generator state. ``torch.load(weights_only=True)`` refuses all of
them, and ``weights_only=False`` would let the file name any callable.

Here the file's globals are listed first without unpickling
(``torch.serialization.get_unsafe_globals_in_checkpoint``); every one beyond torch's own weights-only
set must be on :data:`ALLOWED` or be an enum of a Megatron ``enums`` module, else the file is
refused naming it and the class. Then the file is read by
:func:`megatron.core.dist_checkpointing.checkpoint_io.load_torch_file` (its zip CRCs checked, then torch's restricted
weights-only unpickler) with exactly those globals resolved to inert objects:

- ``argparse.Namespace`` / ``types.SimpleNamespace``: attribute bags (their real classes: they run
  no code when built);
- each Megatron enum and ``signal.Signals``: a :class:`PeerEnum` stand-in that only records the
  class name and the value (Megatron is never imported);
- NumPy's array and dtype reconstructors: rebuild arrays from bytes.

:func:`to_plain` then turns the result into dicts, numbers and strings.
"""

from __future__ import annotations

import argparse
import re
import types
import zipfile

import torch

from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError, load_torch_file

# Pickled enum classes of Megatron-LM / Megatron-LLaMA modules ``megatron[.core][...].enums``.
_MEGATRON_ENUM = re.compile(r"^megatron(\.[A-Za-z_]\w*)*\.enums\.[A-Za-z_]\w*$")


class PeerEnum:
    """Inert stand-in for an enum member of another system (``ModelType(1)``): keeps the value."""

    qualified_name = "enum"

    def __init__(self, value=None):
        self.value = value

    def __repr__(self) -> str:
        return f"{self.qualified_name}({self.value!r})"

    def __eq__(self, other) -> bool:
        return (isinstance(other, PeerEnum) and other.qualified_name == self.qualified_name
                and other.value == self.value)

    def __hash__(self) -> int:
        return hash((self.qualified_name, self.value))


_STAND_INS: dict = {}


def stand_in(qualified_name: str) -> type:
    """The :class:`PeerEnum` subclass standing for ``qualified_name`` (one class per name, so the
    restricted unpickler can tell them apart)."""
    if qualified_name not in _STAND_INS:
        _STAND_INS[qualified_name] = type(qualified_name.rsplit(".", 1)[-1], (PeerEnum,),
                                          {"qualified_name": qualified_name})
    return _STAND_INS[qualified_name]


def _numpy_globals() -> dict:
    """NumPy's pickled array pieces (``np.random.get_state()``: ``("MT19937", uint32[624], ...)``)
    under both module spellings (NumPy 1 pickles ``numpy.core``, NumPy 2 ``numpy._core``)."""
    import numpy as np

    try:
        multiarray = np._core.multiarray
    except AttributeError:  # NumPy 1
        multiarray = np.core.multiarray
    found = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        found[f"{module}._reconstruct"] = multiarray._reconstruct
        found[f"{module}.scalar"] = multiarray.scalar
    for cls in _numpy_dtype_classes():  # NumPy 2 may name a dtype by its class
        found[f"{cls.__module__}.{cls.__name__}"] = cls
    return found


def _numpy_dtype_classes() -> list:
    """NumPy's dtype classes (``numpy.dtypes.UInt32DType``, ...): a pickled dtype is rebuilt as an
    instance of one, which the restricted unpickler must be allowed to build."""
    import numpy as np

    kinds = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
             np.uint64, np.float16, np.float32, np.float64)
    return [type(np.dtype(t)) for t in kinds]


# Globals read as plain data, beyond torch's weights-only set (tensors, storages, dtypes,
# OrderedDict, _codecs.encode). Megatron enums are matched by module (see _MEGATRON_ENUM).
ALLOWED = ("argparse.Namespace", "types.SimpleNamespace", "signal.Signals")
# Megatron-Core enums outside an ``enums`` module (in a torch_dist checkpoint's common state)
_OTHER_ENUMS = ("megatron.core.rerun_state_machine.RerunMode",
                "megatron.core.rerun_state_machine.RerunState")


def _resolve(name: str):
    if name == "argparse.Namespace":
        return argparse.Namespace
    if name == "types.SimpleNamespace":
        return types.SimpleNamespace
    if name == "signal.Signals" or name in _OTHER_ENUMS or _MEGATRON_ENUM.match(name):
        return stand_in(name)
    return _numpy_globals().get(name)


def allowed_globals(path: str) -> list:
    """``[(object, qualified name)]`` for every non-torch global the file ``path`` references.

    Raises:
        CheckpointError: the file is not a ``torch.save`` zip archive, or references a global
            that is not read as plain data (names the file and the class; nothing is executed).
    """
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a torch.save zip archive (truncated, or another "
                              "format); it was not read")
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # a damaged pickle stream
        raise CheckpointError(f"{path}: its pickle cannot be listed ({type(exc).__name__}: "
                              f"{exc}); the file is damaged. Nothing was executed") from None
    resolved = []
    if any(name.startswith("numpy.") for name in names):
        resolved += _numpy_dtype_classes()
    for name in names:
        obj = _resolve(name)
        if obj is None:
            raise CheckpointError(
                f"{path} pickles the class {name}, which is not read as plain data (only "
                f"tensors, {', '.join(ALLOWED)}, Megatron enums and NumPy arrays are); the file "
                "was refused and nothing in it was executed")
        resolved.append((obj, name))
    return resolved


def load_raw(path: str) -> dict:
    """The contents of the ``torch.save`` file ``path``, read by
    :func:`megatron.core.dist_checkpointing.checkpoint_io.load_torch_file` (CRCs checked, torch's weights-only unpickler)
    with only :func:`allowed_globals` added: namespaces as themselves, enums as
    :class:`PeerEnum`, tensors memory-mapped (paged in when used).

    Raises:
        CheckpointError: refused (see :func:`allowed_globals`), damaged or unreadable, naming the
            file; nothing in it is executed.
    """
    return load_torch_file(path, what="checkpoint shard", mmap=True,
                           extra_globals=allowed_globals(path))


def load_raw_bytes(data: bytes, name: str) -> dict:
    """:func:`load_raw` of a ``torch.save`` archive held in memory (a record inside another
    file; ``name`` says where, in messages). The bytes go through a private temporary file so
    that the same listing, CRC checks and restricted unpickler apply; tensors are read whole.

    Raises:
        CheckpointError: as :func:`load_raw`, naming ``name``.
    """
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            return load_torch_file(path, what=name, extra_globals=allowed_globals(path))
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace(path, name)) from None
    finally:
        os.remove(path)


def to_plain(value):
    """Namespaces -> dicts, :class:`PeerEnum` -> ``"megatron.core.enums.ModelType(1)"``, torch
    dtypes -> ``"torch.float32"``, recursively; tensors, arrays and plain values unchanged."""
    if isinstance(value, (argparse.Namespace, types.SimpleNamespace)):
        return {k: to_plain(v) for k, v in vars(value).items()}
    if isinstance(value, PeerEnum):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, dict):
        return type(value)((k, to_plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_plain(v) for v in value)
    return value


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested state dicts -> one dict with dotted names (Megatron's legacy models nest
    ``language_model`` / ``encoder`` / ``embedding``)."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat

"""Loader ``--loader megatron-llama``: checkpoints of Alibaba's Megatron-LLaMA (training runs and
its conversion tool).

Layout: ``release/`` or ``iter_XXXXXXX/`` with ``mp_rank_TT[_PPP][_dp_DDD]/model_optim_rng.pt``;
``model`` holds ``language_model.embedding.word_embeddings.weight`` (vocabulary partition, first
stage), ``language_model.encoder.layers.N.*`` (N local to the stage) with per-rank ``[Q; K; V]``
and ``[gate; up]`` blocks, ``language_model.encoder.final_layernorm.weight`` and ``lm_head.weight``
(the whole output matrix, replicated on every tensor-parallel rank, last stage). Keys may be
nested dicts or dotted names. ``args`` is a pickled ``argparse.Namespace``: it is read with
``torch.load(weights_only=True)`` whose restricted unpickler is allowed ``argparse.Namespace`` and
nothing else beyond tensors and builtins, so loading never runs code from the file.
"""

from __future__ import annotations

import argparse

import torch

from megatron.checkpointing import CheckpointError
from tools.checkpoint.layout import DTYPES
from tools.checkpoint.loader_megatron import find_shards, meta_from_args, stream_stages

NAMES = {"embedding": "language_model.embedding.word_embeddings.weight",
         "layer": "language_model.encoder.layers.{}.",
         "final_norm": "language_model.encoder.final_layernorm.weight",
         "output_replicated": "lm_head.weight"}


def add_arguments(parser) -> None:
    group = parser.add_argument_group("megatron-llama loader")
    group.add_argument("--true-vocab-size", type=int, default=None,
                       help="vocabulary size without padding (Megatron-LLaMA does not store it)")


def numpy_safe_globals() -> list:
    """The exact NumPy globals a pickled ``np.random.get_state()`` (Megatron-LLaMA's
    ``rng_state["np_rng_state"]``: ``("MT19937", uint32[624], int, int, float)``) and NumPy
    scalars need: the array/scalar reconstructors, ``ndarray``, ``dtype`` and the dtype classes of
    uint32/int64/float64. Both module spellings are listed (NumPy 1 pickles ``numpy.core``,
    NumPy 2 ``numpy._core``). None of them runs code: they rebuild arrays from bytes."""
    import numpy as np

    try:
        multiarray = np._core.multiarray
    except AttributeError:  # NumPy 1
        multiarray = np.core.multiarray
    allowed = [np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar,
               (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
               (multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
               (multiarray.scalar, "numpy.core.multiarray.scalar"),
               (multiarray.scalar, "numpy._core.multiarray.scalar")]
    allowed += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64)]
    return allowed


def safe_load(path: str) -> dict:
    """``torch.load(weights_only=True)`` allowing ``argparse.Namespace`` and the NumPy pieces of
    :func:`numpy_safe_globals` (never a full unpickler, never executes code).

    Raises:
        CheckpointError: the file holds other objects (names the refused global).
    """
    try:
        with torch.serialization.safe_globals([argparse.Namespace] + numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # the unpickler reports refusals as UnpicklingError/RuntimeError
        raise CheckpointError(f"cannot read {path} safely: {type(exc).__name__}: {exc}") from exc


def flatten(tree, prefix: str = "") -> dict:
    """Nested state dicts -> one dict with dotted names."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _args_dict(args) -> dict:
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, dict):
        return args
    raise CheckpointError(f"checkpoint args of type {type(args).__name__} are not understood")


def load_checkpoint(args):
    """``(meta, stream)`` of the Megatron-LLaMA checkpoint under ``args.load_dir``."""
    folder, shards, tp, pp = find_shards(args.load_dir)
    first = safe_load(shards[(0, 0)])
    saved = _args_dict(first.get("args"))
    for name, flag in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if saved.get(name, flag) != flag:
            raise CheckpointError(f"{folder}: args say {name}={saved[name]} but the folder holds "
                                  f"{flag} shards")
    saved = dict(saved)
    # Megatron-LLaMA names: --layernorm-epsilon; untied lm_head always (--causal-lm).
    saved.setdefault("norm_epsilon", saved.get("layernorm_epsilon"))
    saved["untie_embeddings_and_output_weights"] = True
    if not saved.get("group_query_attention"):
        saved["num_query_groups"] = saved["num_attention_heads"]
    model = flatten(first["model"])
    embedding = model[NAMES["embedding"]]
    meta = meta_from_args(saved, embedding.shape[0] * tp, getattr(args, "true_vocab_size", None))
    meta["tokenizer_type"] = saved.get("tokenizer_type")
    meta["tokenizer_model"] = saved.get("tokenizer_model") or saved.get("tokenizer_name_or_path")
    meta["params_dtype"] = {v: k for k, v in DTYPES.items()}[embedding.dtype]
    stages = [[lambda t=t, p=p: flatten(safe_load(shards[(t, p)])["model"]) for t in range(tp)]
              for p in range(pp)]
    return meta, stream_stages(stages, meta, names=NAMES)

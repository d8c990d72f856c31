"""What a folder of HuggingFace / SentencePiece tokenizer files says about the vocabulary: its size
(``len(tokenizer)``, added tokens included, as Megatron-LLaMA's ``PretrainedFromHF`` tokenizer
counts it) and the ids of the BOS / EOS tokens. Only JSON and the SentencePiece model are read;
no tokenizer code is loaded, and no file that is a link leaving the folder
(:func:`megatron.hf_folder.file_in_folder`)."""

from __future__ import annotations

import json
import os

from megatron.hf_folder import file_in_folder

_FLAG = "the tokenizer folder"


def _json(folder: str, name: str) -> dict:
    path = file_in_folder(folder, name, _FLAG)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _special_names(folder: str) -> dict:
    """``{"bos_token": "<s>", ...}`` from ``special_tokens_map.json`` / ``tokenizer_config.json``."""
    names = {}
    for source in (_json(folder, "tokenizer_config.json"), _json(folder, "special_tokens_map.json")):
        for key in ("bos_token", "eos_token"):
            value = source.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                names[key] = value
    return names


def tokenizer_info(folder: str | None) -> dict:
    """``{"vocab_size", "bos_token_id", "eos_token_id"}`` of the tokenizer files in ``folder``
    (``tokenizer.json`` first, else ``tokenizer.model``); None for what they do not say, and an
    empty dict without such files (or with an unreadable ``tokenizer.model``).

    Raises:
        ValueError: a file read is a link leaving ``folder``, naming it."""
    if not folder or not os.path.isdir(folder):
        return {}
    names = _special_names(folder)
    fast = _json(folder, "tokenizer.json")
    if fast:
        vocab = dict((fast.get("model") or {}).get("vocab") or {})
        vocab.update({t["content"]: t["id"] for t in fast.get("added_tokens") or []})
        ids = {f"{k}_id": vocab.get(v) for k, v in names.items()}
        return {"vocab_size": max(vocab.values()) + 1 if vocab else None,
                "bos_token_id": ids.get("bos_token_id"), "eos_token_id": ids.get("eos_token_id")}
    model = file_in_folder(folder, "tokenizer.model", _FLAG)
    if not os.path.isfile(model):
        return {}
    import sentencepiece

    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=model)
    except (RuntimeError, OSError):  # not a SentencePiece model: nothing is known
        return {}
    added = _json(folder, "added_tokens.json")

    def token_id(key, default):
        if key not in names:  # the model's own BOS / EOS (-1: none)
            return default if default >= 0 else None
        name = names[key]
        found = added[name] if name in added else sp.piece_to_id(name)
        return None if found == sp.unk_id() and name != sp.id_to_piece(found) else found

    return {"vocab_size": max([sp.get_piece_size() - 1, *added.values()]) + 1,
            "bos_token_id": token_id("bos_token", sp.bos_id()),
            "eos_token_id": token_id("eos_token", sp.eos_id())}

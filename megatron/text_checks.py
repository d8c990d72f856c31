"""Text that decoded from JSON but is no Unicode text: a ``\\uD800``-style escape of half a
UTF-16 pair decodes to a lone surrogate, which UTF-8 decoding cannot catch and a tokenizer
rejects with a raw library error. Found here so that a reader names where it is."""

from __future__ import annotations

from typing import Any, Optional, Tuple


def lone_surrogate(value: Any, path: str = "") -> Optional[Tuple[str, int]]:
    """``(path, code point)`` of the first string (value or object key) in a decoded JSON value
    holding a lone surrogate, else None. ``path`` is JSON-ish: ``messages[0].content``, or
    ``messages[0].key '\\ud800x'`` for a key; the
    walk is iterative, so any depth the JSON parser took is walked."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        texts = [(where, item)] if isinstance(item, str) else []
        if isinstance(item, dict):
            # A key is named by itself (escaped): the path to it would stop at its object.
            texts += [((f"{where}." if where else "") + f"key {ascii(k)}", k) for k in item]
            stack += [(f"{where}.{k}" if where else str(k), v)
                      for k, v in reversed(list(item.items()))]
        elif isinstance(item, list):
            stack += [(f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item)))]
        for at, text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                return at, ord(text[e.start])
    return None

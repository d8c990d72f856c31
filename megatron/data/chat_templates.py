"""Conversations to token ids and an assistant-only loss mask.

Three pieces, used by ``tools/preprocess_sft_data.py``:

1. :func:`to_messages` reads one JSON object in the OpenAI/HF ``messages`` format
   (``[{"role": "system"|"user"|"assistant", "content": str}, ...]``), ShareGPT
   ``conversations`` (``[{"from": "system"|"human"|"gpt", "value": str}, ...]``) or Alpaca
   (``instruction``, optional ``input``, ``output``) and returns OpenAI messages.
2. A renderer turns messages into the prompt string: the tokenizer's own chat template
   (:class:`HFChatTokenizer`, run only in transformers' sandboxed Jinja through
   ``apply_chat_template``) or one of the built-in formats of :data:`BUILTIN_TEMPLATES`
   (:class:`SentencePieceChatTokenizer`).
3. :func:`assistant_spans` finds what the model must learn by **rendering prefixes**: for every
   assistant message ``i`` the text of ``messages[:i]`` with the generation prompt and the text of
   ``messages[:i + 1]`` are both prefixes of the whole conversation's text, and the characters
   between them are the assistant's turn (its content and its end-of-turn marker, exactly what
   the model has to generate after the prompt). This needs no ``{% generation %}`` markers in
   the template, so every template gets a correct mask; with a template that has them the mask
   equals ``apply_chat_template(..., return_assistant_tokens_mask=True)`` (tested).

Built-in formats (the exact strings; ``{x}`` is a message's content):

- ``llama2``: Meta's Llama-2-chat format, as ``chat_completion`` of ``llama/generation.py`` in
  github.com/meta-llama/llama builds it: ``<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user}
  [/INST] {assistant} </s><s>[INST] {user} [/INST]``. Contents are stripped as there; the system
  prompt goes into the first user turn. ``<s>``/``</s>`` are the model's BOS/EOS ids.
- ``llama3``: Meta's Llama-3 instruct format (llama-models, ``prompt_format.md`` of Llama 3):
  ``<|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{x}<|eot_id|>`` per message,
  the generation prompt ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``. Contents are
  stripped as Meta's reference tokenizer does. ``<|begin_of_text|>`` is written as the
  tokenizer's BOS.
- ``chatml``: OpenAI's ChatML (openai-python ``chatml.md``), as HF's templates write it:
  ``<|im_start|>{role}\\n{x}<|im_end|>\\n`` per message, the generation prompt
  ``<|im_start|>assistant\\n``.

With a SentencePiece model that lacks the markers of ``llama3``/``chatml`` as pieces they are
tokenized as text (several ids); the mask still covers the end-of-turn marker's ids, so the model
learns to write it and generation can stop on that string.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

ROLES = ("system", "user", "assistant")
CONVERSATION_FORMATS = ("messages", "sharegpt", "alpaca")
# ShareGPT speaker names (``from``) in use (FastChat, Vicuna, OpenHermes, SlimOrca) -> OpenAI roles.
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


class ConversationError(ValueError):
    """A conversation cannot be used; the message says why (the caller adds file and line)."""


def detect_format(obj: dict) -> str:
    """The conversation format of one JSON object: ``messages``, ``sharegpt`` or ``alpaca``.

    Raises:
        ConversationError: none of ``messages``, ``conversations``, ``instruction``+``output``.
    """
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    raise ConversationError(f"no conversation found (keys: {', '.join(map(repr, obj))}); expected "
                            "'messages' (OpenAI/HF), 'conversations' (ShareGPT) or "
                            "'instruction'+'output' (Alpaca)")


def _text(value, what: str) -> str:
    if not isinstance(value, str):
        raise ConversationError(f"{what} is a {type(value).__name__}, expected a string")
    return value


def to_messages(obj: dict, fmt: Optional[str] = None, key: Optional[str] = None) -> List[Dict[str, str]]:
    """OpenAI messages ``[{"role", "content"}]`` of one conversation.

    Args:
        obj: the parsed JSON line.
        fmt: one of :data:`CONVERSATION_FORMATS`, or None to detect it (:func:`detect_format`).
        key: read the messages list from this key instead of the format's own (``messages`` or
            ``conversations``); used for preference pairs.

    Raises:
        ConversationError: the object does not hold a valid conversation of that format (an
            unknown role, a content that is not a string, an empty list).
    """
    if not isinstance(obj, dict):
        raise ConversationError(f"expected a JSON object, got {type(obj).__name__}")
    fmt = fmt or detect_format(obj)
    if fmt == "alpaca":
        for k in ("instruction", "output"):
            if k not in obj:
                raise ConversationError(f"Alpaca record without {k!r}")
        prompt = _text(obj["instruction"], "'instruction'")
        extra = _text(obj.get("input") or "", "'input'")
        # Alpaca's own prompt puts the input after the instruction; here both form the user turn.
        user = f"{prompt}\n\n{extra}" if extra else prompt
        return [{"role": "user", "content": user}, {"role": "assistant", "content": _text(obj["output"], "'output'")}]
    key = key or ("messages" if fmt == "messages" else "conversations")
    if fmt not in CONVERSATION_FORMATS:
        raise ConversationError(f"unknown conversation format {fmt!r}; choose {', '.join(CONVERSATION_FORMATS)}")
    if key not in obj:
        raise ConversationError(f"no {key!r} list (keys: {', '.join(map(repr, obj))})")
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        raise ConversationError(f"{key!r} must be a non-empty list of turns")
    messages = []
    for n, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ConversationError(f"{key}[{n}] is a {type(turn).__name__}, expected an object")
        if fmt == "messages":
            role, content = turn.get("role"), turn.get("content")
        else:
            role, content = SHAREGPT_ROLES.get(str(turn.get("from")).lower()), turn.get("value")
            if role is None:
                raise ConversationError(f"{key}[{n}]: unknown speaker 'from': {turn.get('from')!r} "
                                        f"(known: {', '.join(SHAREGPT_ROLES)})")
        if role not in ROLES:
            raise ConversationError(f"{key}[{n}]: role {role!r} is not one of {', '.join(ROLES)}")
        messages.append({"role": role, "content": _text(content, f"{key}[{n}] content")})
    return messages


# --- built-in renderers: messages -> text (special tokens written as their strings) ---------------

def _system_first(messages):
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


def render_llama2(messages: Sequence[dict], add_generation_prompt: bool, bos: str = "<s>",
                  eos: str = "</s>") -> str:
    """Llama-2-chat (Meta's ``chat_completion``); the generation prompt is implied by ``[/INST]``.

    Raises:
        ConversationError: roles do not alternate user, assistant, ... after an optional system.
    """
    system, rest = _system_first(list(messages))
    out = []
    for n, m in enumerate(rest):
        want = "user" if n % 2 == 0 else "assistant"
        if m["role"] != want:
            raise ConversationError(f"llama2 needs user/assistant turns alternating after an optional "
                                    f"system message; message {n} is {m['role']!r}")
        content = m["content"].strip()
        if want == "user":
            if n == 0 and system is not None:
                content = f"<<SYS>>\n{system.strip()}\n<</SYS>>\n\n{content}"
            out.append(f"{bos}[INST] {content} [/INST]")
        else:
            out.append(f" {content} {eos}")
    return "".join(out)


def render_llama3(messages: Sequence[dict], add_generation_prompt: bool, bos: str = "<|begin_of_text|>",
                  eos: str = "") -> str:
    """Llama-3 instruct; ``<|begin_of_text|>`` is ``bos``."""
    out = [bos]
    for m in messages:
        out.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def render_chatml(messages: Sequence[dict], add_generation_prompt: bool, bos: str = "", eos: str = "") -> str:
    """ChatML; no BOS (as OpenAI's and Qwen's templates)."""
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


BUILTIN_TEMPLATES: Dict[str, Callable] = {"llama2": render_llama2, "llama3": render_llama3, "chatml": render_chatml}


def assistant_spans(render: Callable[[Sequence[dict], bool], str], messages: Sequence[dict],
                    first: int = 0) -> Tuple[str, List[Tuple[int, int]]]:
    """The whole conversation's text and the character spans of its assistant turns.

    Span of assistant message ``i`` = ``[len(render(messages[:i], True)), len(render(messages[:i+1], False)))``.
    Only messages from index ``first`` on count (a preference pair's response after its prompt).

    Raises:
        ConversationError: a prefix rendering is not a prefix of the whole text (a template that
            rewrites earlier turns, e.g. drops past reasoning): such a conversation cannot be
            masked by prefixes and is reported instead of guessed.
    """
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first:
            continue
        start_text, end_text = render(messages[:i], True), render(messages[:i + 1], False)
        for what, text in (("prompt", start_text), ("turn", end_text)):
            if not full.startswith(text):
                raise ConversationError(f"the template's rendering of the {what} up to assistant message "
                                        f"{i} is not a prefix of the whole conversation's, so its loss mask "
                                        "cannot be derived by prefixes")
        if len(end_text) < len(start_text):
            raise ConversationError(f"assistant message {i}: the turn renders shorter than its prompt")
        spans.append((len(start_text), len(end_text)))
    return full, spans


def mask_from_offsets(offsets: Sequence[Tuple[int, int]], spans: Sequence[Tuple[int, int]]) -> np.ndarray:
    """uint8 ``[len(offsets)]``: 1 for a token whose first character lies in a span (how
    transformers maps ``{% generation %}`` characters to tokens)."""
    starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for a, b in spans:
        mask |= ((starts >= a) & (starts < b)).astype(np.uint8)
    return mask


RENDER_LIMIT_S = 10.0  # one conversation renders in milliseconds with any real template


class _RenderTooLong(BaseException):
    """Raised by the alarm inside a template's rendering; a BaseException, so that no
    ``except Exception`` of Jinja or transformers takes it for the template's own error."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    """End the block with :class:`_RenderTooLong` after ``seconds`` (SIGALRM, on the main thread
    of a process: the tool's own or a preprocessing worker's; elsewhere no limit is set)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getitimer(signal.ITIMER_REAL)[0] > 0:  # another timer runs: left alone
        yield
        return

    def expire(signum, frame):
        raise _RenderTooLong()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class HFChatTokenizer:
    """Renders with the chat template of a local HuggingFace tokenizer folder.

    The folder is refused first if it asks to run its own code (:mod:`megatron.hf_folder`); the
    template runs only in transformers' sandboxed Jinja (``apply_chat_template``). Tokens are
    those ``apply_chat_template(..., tokenize=True)`` gives (the whole text, no extra special
    tokens), the mask from each token's character offsets.

    Raises:
        FileNotFoundError: not a folder. ValueError: custom code, or no chat template.
    """

    def __init__(self, folder: str, chat_template: Optional[str] = None):
        from megatron.hf_folder import refuse_custom_code

        if not folder or not os.path.isdir(folder):
            raise FileNotFoundError(f"--tokenizer-name-or-path {folder!r}: not a local folder")
        refuse_custom_code(folder, "--tokenizer-name-or-path")
        from transformers import AutoTokenizer

        self.folder = folder
        self.tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        if chat_template is not None:
            self.tok.chat_template = chat_template
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"--tokenizer-name-or-path {folder}: the tokenizer has no chat_template; "
                             f"name a built-in one with --chat-template ({', '.join(BUILTIN_TEMPLATES)})")
        self.vocab_size = len(self.tok)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The template's text of ``messages``.

        Raises:
            ConversationError: the template refused the conversation (its ``raise_exception``,
                any Jinja error).
            ValueError: the template's fault, the same for every conversation: it ran longer
                than :data:`RENDER_LIMIT_S` or rendered text that is not text (a lone surrogate).
        """
        if not messages:  # a conversation opening with the assistant: its prompt is empty
            return ""
        try:
            with _time_limit(RENDER_LIMIT_S):
                text = self.tok.apply_chat_template(list(messages), tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
        except _RenderTooLong:
            raise ValueError(f"--tokenizer-name-or-path {self.folder}: the chat template ran over "
                             f"{RENDER_LIMIT_S:g} s on one conversation (a template that loops "
                             "without end?); fix or replace the template (--chat-template)") from None
        except Exception as e:  # noqa: BLE001 - the template's raise_exception, or any Jinja error
            raise ConversationError(f"the chat template refused it ({type(e).__name__}: {e})") from None
        if not isinstance(text, str):
            raise ValueError(f"--tokenizer-name-or-path {self.folder}: the chat template rendered "
                             f"a {type(text).__name__}, not text")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"--tokenizer-name-or-path {self.folder}: the chat template renders "
                             f"a lone surrogate ({ascii(text[e.start])}), which is no text; fix "
                             "or replace the template (--chat-template)") from None
        return text

    def encode(self, messages: Sequence[dict], first: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """``(int64 ids, uint8 mask)`` of one conversation; the mask covers the assistant messages
        from index ``first`` on. Raises ConversationError."""
        full, spans = assistant_spans(self.render, messages, first)
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        return np.asarray(enc["input_ids"], dtype=np.int64), mask_from_offsets(enc["offset_mapping"], spans)

    def __getstate__(self):
        return {"folder": self.folder, "chat_template": self.tok.chat_template}

    def __setstate__(self, state):
        self.__init__(state["folder"], state["chat_template"])


class SentencePieceChatTokenizer:
    """Renders with a built-in format and tokenizes with a SentencePiece model.

    ``<s>``/``</s>`` in the rendered text become the BOS/EOS ids (never text); see :meth:`encode`.

    Raises:
        ValueError: an unknown template name.
    """

    def __init__(self, model_file: str, template: str):
        import sentencepiece

        if template not in BUILTIN_TEMPLATES:
            raise ValueError(f"--chat-template {template!r}: choose one of {', '.join(BUILTIN_TEMPLATES)}")
        self.model_file, self.template = model_file, template
        self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.specials = {self.sp.id_to_piece(i): i for i in (self.sp.bos_id(), self.sp.eos_id()) if i >= 0}
        self._bos = self.sp.id_to_piece(self.sp.bos_id()) if self.sp.bos_id() >= 0 else ""
        self._eos = self.sp.id_to_piece(self.sp.eos_id())
        self.vocab_size = self.sp.get_piece_size()
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.sp.eos_id()

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return BUILTIN_TEMPLATES[self.template](messages, add_generation_prompt, bos=self._bos, eos=self._eos)

    def _encode_with_offsets(self, text: str, base: int, ids: list, starts: list) -> None:
        """Appends the ids of ``text`` (no special strings in it) and each id's first character
        (SentencePiece gives UTF-8 byte offsets; mapped back to characters), shifted by ``base``."""
        if not text:
            return
        pieces = self.sp.encode(text, return_type="proto").pieces
        ids += [p.id for p in pieces]
        begins = [p.begin for p in pieces]
        if text.isascii():  # bytes are characters
            starts += [base + b for b in begins]
            return
        char_end_bytes = np.cumsum(np.fromiter((len(c.encode("utf-8")) for c in text), np.int64, len(text)))
        starts += (base + np.searchsorted(char_end_bytes, begins, side="right")).tolist()

    def encode(self, messages: Sequence[dict], first: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """``(int64 ids, uint8 mask)`` of one conversation; the mask covers the assistant messages
        from index ``first`` on. Raises ConversationError.

        The text is cut only at the model's BOS/EOS strings (which become those ids); each run of
        text between them is encoded whole, as Meta's Llama tokenizer encodes a dialog, and a
        token belongs to the mask when its first character lies in an assistant span.
        """
        full, spans = assistant_spans(self.render, messages, first)
        ids, starts, pos = [], [], 0
        while pos < len(full):
            hits = [(full.find(s, pos), s) for s in self.specials]
            hits = [(p, s) for p, s in hits if p >= 0]
            cut, special = min(hits) if hits else (len(full), None)
            self._encode_with_offsets(full[pos:cut], pos, ids, starts)
            if special is None:
                break
            ids.append(self.specials[special])
            starts.append(cut)
            pos = cut + len(special)
        return (np.asarray(ids, dtype=np.int64),
                mask_from_offsets([(st, st) for st in starts], spans))

    def __getstate__(self):
        return {"model_file": self.model_file, "template": self.template}

    def __setstate__(self, state):
        self.__init__(state["model_file"], state["template"])


SP_TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
HF_TOKENIZER_TYPES = ("HuggingFaceTokenizer", "PretrainedFromHF")


def build_chat_tokenizer(tokenizer_type: Optional[str], tokenizer_model: Optional[str],
                         tokenizer_name_or_path: Optional[str], chat_template: Optional[str]):
    """The chat tokenizer the flags name (checked before any file is written).

    Raises:
        ValueError: a tokenizer type without a chat path, a SentencePiece model without
            ``--chat-template``, an HF folder with a built-in ``--chat-template``.
        FileNotFoundError: the model file or folder is missing.
    """
    if tokenizer_type in SP_TOKENIZER_TYPES:
        if not tokenizer_model or not os.path.isfile(tokenizer_model):
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_model!r}: SentencePiece .model file not found")
        if chat_template is None:
            raise ValueError(f"--tokenizer-type {tokenizer_type} has no chat template of its own; name one "
                             f"with --chat-template ({', '.join(BUILTIN_TEMPLATES)})")
        return SentencePieceChatTokenizer(tokenizer_model, chat_template)
    if tokenizer_type in HF_TOKENIZER_TYPES:
        if chat_template is not None:
            raise ValueError(f"--chat-template {chat_template}: a HuggingFace tokenizer folder renders with "
                             "its own chat_template (tokenizer_config.json / chat_template.jinja); drop the flag")
        return HFChatTokenizer(tokenizer_name_or_path or tokenizer_model)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r}: conversations need a chat template; use "
                     f"{' or '.join(HF_TOKENIZER_TYPES[:1] + SP_TOKENIZER_TYPES)}")

"""OpenAI's completion and chat-completion requests read into engine parameters, and the error
bodies for what is refused (https://platform.openai.com/docs/api-reference/completions).

Defaults differing from OpenAI's: ``seed`` 0 when absent (so an answer is reproducible),
``top_k`` accepted as an extension (vLLM's; 0 or -1: off). ``temperature`` 0 is arg-max
decoding. Refused with a 400: ``n`` or ``best_of`` other than 1, ``echo``, ``suffix``,
``logit_bias``, non-zero penalties, more than one prompt per request, and a field the endpoint
does not know (OpenAI's "Unrecognized request argument supplied: X", :func:`check_fields`).
Chat fields OpenAI documents for what is not built here (tools, structured output, audio, ...)
are accepted only at the value that asks for nothing (:data:`NOT_BUILT`); a few that change
nothing in the answer are read and ignored (:data:`IGNORED`).

Log-probabilities (:func:`logprobs_asked`): completions' ``logprobs: N`` (0 to
:data:`MAX_COMPLETION_LOGPROBS`, OpenAI's bound) and chat's ``logprobs: true`` with
``top_logprobs: N`` (0 to :data:`~megatron.inference.engine.sampling_params.MAX_TOP_LOGPROBS`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from megatron.inference.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from megatron.text_checks import lone_surrogate

# The built-in chat template: one line per message ``{role}: {content}``, then ``assistant:``
# for the answer; the answer stops at the next ``\nuser:`` line.
CHAT_ROLES = ("system", "user", "assistant")
CHAT_STOP = "\nuser:"


class RequestError(ValueError):
    """A refused request: HTTP ``status`` (4xx) and OpenAI's error fields."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> Dict[str, Any]:
        return error_body(str(self), self.param, self.code, self.status)


def error_body(message: str, param: Optional[str] = None, code: Optional[str] = None,
               status: int = 400) -> Dict[str, Any]:
    """OpenAI's error object ``{"error": {message, type, param, code}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# OpenAI's bound on completions' ``logprobs`` (chat's ``top_logprobs`` goes to 20).
MAX_COMPLETION_LOGPROBS = 5

# The request fields each endpoint reads (OpenAI's, plus ``top_k``, vLLM's extension, and
# ``max_completion_tokens`` on both). Anything else is refused, as OpenAI refuses it.
_COMMON_FIELDS = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                  "seed", "stop", "stream", "stream_options", "n", "logit_bias",
                  "presence_penalty", "frequency_penalty", "logprobs", "user")
COMPLETION_FIELDS = frozenset(_COMMON_FIELDS + ("prompt", "best_of", "echo", "suffix"))

# Fields that change nothing in an answer here, read and ignored (value: the JSON types taken):
# ``user`` / ``safety_identifier`` (an end-user id for abuse monitoring), ``metadata`` (tags for
# stored completions), ``service_tier`` (a processing tier), ``prompt_cache_key`` (a cache
# routing hint), ``parallel_tool_calls`` (meaningful with ``tools`` only), ``model`` (one model
# is served, whatever the name).
IGNORED = {"model": (str,), "user": (str,), "safety_identifier": (str,), "metadata": (dict,),
           "service_tier": (str,), "prompt_cache_key": (str,), "parallel_tool_calls": (bool,)}

# Chat fields for what is not built: accepted at null or at a value that asks for nothing.
NOT_BUILT = {"tools": ([[]], "tool calling"), "tool_choice": (["none"], "tool calling"),
             "functions": ([[]], "function calling"), "function_call": (["none"], "function calling"),
             "response_format": ([{"type": "text"}], "structured output (a response_format other "
                                 "than text)"),
             "modalities": ([["text"]], "output other than text"), "audio": ([], "audio output"),
             "prediction": ([], "predicted outputs"), "reasoning_effort": ([], "reasoning effort"),
             "web_search_options": ([], "web search"), "verbosity": ([], "verbosity"),
             "store": ([False], "storing completions")}
CHAT_FIELDS = frozenset(_COMMON_FIELDS + ("messages", "top_logprobs") + tuple(IGNORED)
                        + tuple(NOT_BUILT))
STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def check_fields(body: Dict[str, Any], chat: bool) -> None:
    """Refuse a field the endpoint does not read (naming it, as OpenAI does), an ignored field of
    the wrong type, a :data:`NOT_BUILT` field asking for something, and a bad ``stream_options``.

    Raises:
        RequestError: 400, ``param`` the field.
    """
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        raise RequestError(f"Unrecognized request argument{s} supplied: {', '.join(unknown)}",
                           unknown[0])
    for name, types in IGNORED.items():
        value = body.get(name)
        if name in known and value is not None and not isinstance(value, types):
            raise RequestError(f"'{name}' must be a {types[0].__name__.replace('str', 'string')}"
                               f" (got {value!r})", name)
    if chat:
        for name, (neutral, what) in NOT_BUILT.items():
            value = body.get(name)
            if value is not None and not any(value == n and type(value) is type(n)
                                             for n in neutral):
                raise RequestError(f"'{name}': {what} is not supported by this server (got "
                                   f"{value!r}); see docs/serving.md", name)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(f"'stream_options' must be an object (got {options!r})",
                               "stream_options")
        extra = sorted(k for k in options if k not in STREAM_OPTIONS)
        if extra:
            raise RequestError(f"Unrecognized request argument supplied: stream_options."
                               f"{extra[0]}", "stream_options")
        if any(v is not None and not isinstance(v, bool) for v in options.values()):
            raise RequestError(f"'stream_options' values must be true or false (got {options!r})",
                               "stream_options")
        if body.get("stream") is not True:
            raise RequestError("'stream_options' is only allowed when 'stream' is true",
                               "stream_options")


def logprobs_asked(body: Dict[str, Any], chat: bool) -> Optional[int]:
    """How many most likely tokens per position the request asks for with the log-probabilities
    of its tokens, or None when it asks for no log-probabilities.

    Completions: ``logprobs`` null, or an integer in [0, :data:`MAX_COMPLETION_LOGPROBS`].
    Chat: ``logprobs`` true or false (null: false), ``top_logprobs`` null or an integer in
    [0, ``MAX_TOP_LOGPROBS``]; a positive ``top_logprobs`` needs ``logprobs: true``.

    Raises:
        RequestError: 400 naming the field.
    """
    if not chat:
        if body.get("logprobs") is None:
            return None
        return _number(body, "logprobs", 0, int, 0, MAX_COMPLETION_LOGPROBS)
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise RequestError(f"'logprobs' must be true or false (got {on!r})", "logprobs")
    top = _number(body, "top_logprobs", 0, int, 0, MAX_TOP_LOGPROBS)
    if top and not on:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return top if on else None


@dataclass(frozen=True)
class Limits:
    """The server's request limits (``tools/serve.py`` flags)."""

    max_prompt_tokens: int
    max_tokens: int
    default_max_tokens: int = 16
    max_stop: int = 4


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def request_body(raw: bytes) -> Dict[str, Any]:
    """The request's JSON object (UTF-8, as RFC 8259 requires of JSON between systems).

    Raises:
        RequestError: bytes that are not UTF-8, not JSON, nested beyond the parser's depth,
            holding NaN/Infinity (Python's extension, not JSON), or not an object.
    """
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    where = lone_surrogate(body)
    if where is not None:
        raise RequestError(f"'{where[0]}' is not Unicode text: a \\u escape in it is a lone "
                           f"surrogate (U+{where[1]:04X}), which no text holds; send UTF-8 text",
                           where[0].split(".")[0].split("[")[0])
    return body


def _number(body, name, default, kind=float, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        value = default
    # NaN compares False against both bounds, so it must be refused by name.
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        bounds = f" in [{low}, {high}]" if high is not None else (f" >= {low}" if low is not None else "")
        raise RequestError(f"'{name}' must be {'an integer' if kind is int else 'a number'}{bounds} "
                           f"(got {value!r})", name)
    return value


def _refuse_unsupported(body: Dict[str, Any]) -> None:
    for name, default in (("n", 1), ("best_of", 1)):
        if body.get(name, default) not in (None, default):
            raise RequestError(f"'{name}' must be 1: one choice per request (got {body[name]!r})", name)
    if body.get("echo"):
        raise RequestError("'echo' is not supported", "echo")
    if body.get("suffix"):
        raise RequestError("'suffix' (insertion) is not supported", "suffix")
    if body.get("logit_bias"):
        raise RequestError("'logit_bias' is not supported", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(f"'{name}' is not supported (0 only)", name)


def sampling_params(body: Dict[str, Any], limits: Limits, extra_stop: Tuple[str, ...] = (),
                    chat: bool = False) -> SamplingParams:
    """The request's :class:`SamplingParams` (``chat``: a chat-completion request); raises
    :class:`RequestError` for an unknown field (:func:`check_fields`) or a bad value."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_fields(body, chat)
    _refuse_unsupported(body)
    top_logprobs = logprobs_asked(body, chat) or 0
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:  # a null newer field must not hide the older one
        max_tokens = body.get("max_tokens")
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", limits.default_max_tokens,
                         int, 1, limits.max_tokens)
    temperature = _number(body, "temperature", 1.0, float, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, float, 0.0, 1.0)
    top_k = _number(body, "top_k", 0, int, -1)
    seed = _number(body, "seed", 0, int, 0, 2 ** 63 - 1)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    if (not isinstance(stop, (list, tuple)) or len(stop) > limits.max_stop
            or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most "
                           f"{limits.max_stop} of them (got {body.get('stop')!r})", "stop")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise RequestError(f"'stream' must be true or false (got {body['stream']!r})", "stream")
    return SamplingParams(max_tokens=max_tokens, greedy=temperature == 0.0,
                          temperature=temperature if temperature > 0 else 1.0,
                          top_k=max(top_k, 0), top_p=top_p if top_p < 1.0 else 0.0, seed=seed,
                          stop=tuple(stop) + tuple(extra_stop), top_logprobs=top_logprobs)


def completion_prompt(body: Dict[str, Any]) -> Union[str, List[int]]:
    """The one prompt of a completion request: a string or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return prompt
    raise RequestError("'prompt' must be one non-empty string or one non-empty list of token ids "
                       "(one prompt per request)", "prompt")


# A message's keys: ``name`` (a participant's name) is read and ignored.
MESSAGE_KEYS = ("role", "content", "name")


def _content_text(content: Any) -> Optional[str]:
    """A message's text: a string, or OpenAI's list of text parts ``[{"type": "text", "text":
    ...}]`` joined; None for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text"
            and isinstance(p["text"], str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def render_chat(messages: Any) -> str:
    """The built-in template: ``{role}: {content}\\n`` per message, then ``assistant:``.

    Raises:
        RequestError: not a non-empty list of messages of a known role with text content, or a
            message key other than :data:`MESSAGE_KEYS` (named, e.g. ``messages[1].tool_calls``).
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    lines = []
    for i, m in enumerate(messages):
        text = _content_text(m.get("content")) if isinstance(m, dict) else None
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or text is None:
            raise RequestError(f"messages[{i}] must be {{'role': one of {list(CHAT_ROLES)}, "
                               "'content': a string or a list of text parts}", "messages")
        unknown = sorted(k for k in m if k not in MESSAGE_KEYS)
        if unknown:
            raise RequestError(f"Unrecognized request argument supplied: messages[{i}]."
                               f"{unknown[0]}", "messages")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise RequestError(f"messages[{i}].name must be a string", "messages")
        lines.append(f"{m['role']}: {text}\n")
    return "".join(lines) + "assistant:"


def held_back(text: str, stops: Tuple[str, ...]) -> int:
    """Characters at the end of ``text`` a stream must not send yet: a prefix of a stop string
    (it may complete into one) or an unfinished UTF-8 sequence (U+FFFD)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    if text.endswith("\ufffd"):
        hold = max(hold, 1)
    return hold


def completion_logprobs(entries, token_text, top: int) -> Dict[str, Any]:
    """OpenAI's completions ``logprobs`` object of generated tokens.

    Args:
        entries: per token ``(id, log-probability, ((id, log-probability), ...))``, the last
            being the ``top`` most likely tokens there.
        token_text: id -> its text.
        top: the request's ``logprobs`` N.

    Returns:
        ``{"tokens", "token_logprobs", "top_logprobs", "text_offset": None}``; ``top_logprobs``
        holds per position a ``{text: log-probability}`` of the N most likely tokens and the
        chosen one (so up to N + 1 entries, as OpenAI's; ids of the same text keep the most
        likely).
    """
    tops = []
    for token, logprob, alternatives in entries:
        d: Dict[str, float] = {}
        for alt, value in alternatives[:top]:
            d.setdefault(token_text(alt), value)
        d.setdefault(token_text(token), logprob)
        tops.append(d)
    return {"tokens": [token_text(t) for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
            "text_offset": None}


def chat_logprobs(entries, token_text, top: int) -> Dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs:
    [{token, logprob, bytes}] (the ``top`` most likely, most likely first)}], "refusal": None}``
    (``entries`` and ``token_text`` as :func:`completion_logprobs`)."""
    def item(token, logprob):
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(item(t, lp), top_logprobs=[item(a, v) for a, v in alts[:top]])
                        for t, lp, alts in entries], "refusal": None}

"""OpenAI's completion and chat-completion requests read into engine parameters, and the error
bodies for what is refused (https://platform.openai.com/docs/api-reference/completions).

Defaults differing from OpenAI's: ``seed`` 0 when absent (so an answer is reproducible),
``top_k`` accepted as an extension (vLLM's; 0 or -1: off). ``temperature`` 0 is arg-max
decoding. Refused with a 400: ``n`` or ``best_of`` other than 1, ``echo``, ``suffix``,
``logit_bias``, non-zero penalties, more than one prompt per request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from megatron.inference.engine.sampling_params import SamplingParams

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


def sampling_params(body: Dict[str, Any], limits: Limits, extra_stop: Tuple[str, ...] = ()
                    ) -> SamplingParams:
    """The request's :class:`SamplingParams`; raises :class:`RequestError` for a bad value."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _refuse_unsupported(body)
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
                          stop=tuple(stop) + tuple(extra_stop))


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


def render_chat(messages: Any) -> str:
    """The built-in template: ``{role}: {content}\\n`` per message, then ``assistant:``."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    lines = []
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or m.get("role") not in CHAT_ROLES
                or not isinstance(m.get("content"), str)):
            raise RequestError(f"messages[{i}] must be {{'role': one of {list(CHAT_ROLES)}, "
                               "'content': a string}", "messages")
        lines.append(f"{m['role']}: {m['content']}\n")
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

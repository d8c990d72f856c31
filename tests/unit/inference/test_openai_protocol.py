"""OpenAI request fields read into SamplingParams, refusals, the chat template and what a stream
holds back, against hand-written expectations."""

import pytest

from megatron.inference.engine import SamplingParams
from megatron.inference.engine.openai_protocol import (CHAT_STOP, Limits, RequestError,
                                                        completion_prompt, held_back,
                                                        render_chat, request_body,
                                                        sampling_params)

LIMITS = Limits(max_prompt_tokens=100, max_tokens=64)


def test_fields_map_onto_sampling_params():
    assert sampling_params({}, LIMITS) == SamplingParams(max_tokens=16, seed=0)
    got = sampling_params({"max_tokens": 5, "temperature": 0, "stop": "x", "seed": 9}, LIMITS)
    assert (got.greedy, got.max_tokens, got.stop, got.seed) == (True, 5, ("x",), 9)
    got = sampling_params({"temperature": 0.7, "top_p": 1.0, "top_k": -1}, LIMITS, (CHAT_STOP,))
    assert (got.greedy, got.temperature, got.top_p, got.top_k, got.stop) == \
        (False, 0.7, 0.0, 0, ("\nuser:",))


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 65}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": -0.1}, "top_p"), ({"seed": 1.5}, "seed"), ({"n": 3}, "n"), ({"echo": True}, "echo"),
    ({"stop": ["a"] * 5}, "stop"), ({"stop": [""]}, "stop"), ({"stream": "yes"}, "stream"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"1": 2}}, "logit_bias"),
])
def test_bad_fields_are_refused_naming_the_field(body, param):
    with pytest.raises(RequestError) as e:
        sampling_params(body, LIMITS)
    assert e.value.param == param and e.value.status == 400
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_prompts_and_chat_template():
    assert completion_prompt({"prompt": "hi"}) == "hi"
    assert completion_prompt({"prompt": ["hi"]}) == "hi"
    assert completion_prompt({"prompt": [1, 2]}) == [1, 2]
    for bad in ({}, {"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": [1, True]}):
        with pytest.raises(RequestError, match="one prompt per request"):
            completion_prompt(bad)
    assert render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == \
        "system: S\nuser: U\nassistant:"
    with pytest.raises(RequestError, match=r"messages\[1\]"):
        render_chat([{"role": "user", "content": "U"}, {"role": "bot", "content": "x"}])


def test_stream_holds_back_a_possible_stop_string_and_unfinished_characters():
    assert held_back("hello wor", ("world",)) == 3
    assert held_back("hello", ("world",)) == 0
    assert held_back("abc\n", ("\nuser:",)) == 1
    assert held_back("ab\ufffd", ()) == 1


@pytest.mark.parametrize("body, param", [
    ({"temperature": float("nan")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"stop": 0}, "stop"), ({"stop": False}, "stop"), ({"stop": ""}, "stop"), ({"stop": {}}, "stop"),
    ({"max_completion_tokens": None, "max_tokens": 999}, "max_tokens"),
])
def test_values_that_used_to_pass_silently_are_refused(body, param):
    """NaN compared False against both bounds and was read as temperature 1 / top_p off; a falsy
    non-list ``stop`` and a null ``max_completion_tokens`` hid the field the user sent."""
    with pytest.raises(RequestError) as e:
        sampling_params(body, LIMITS)
    assert e.value.param == param and e.value.status == 400


def test_null_fields_take_their_defaults():
    assert sampling_params({"stream": None, "stop": None, "n": None}, LIMITS) == \
        SamplingParams(max_tokens=16, seed=0)
    assert sampling_params({"max_completion_tokens": None, "max_tokens": 5}, LIMITS).max_tokens == 5


@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": "\xff"}', "not valid JSON"), (b"[" * 5000 + b"]" * 5000, "not valid JSON"),
    (b'{"prompt": "a", "temperature": NaN}', "not valid JSON"), (b"[1]", "JSON object"),
    (b'{"prompt": "a", "top_p": Infinity}', "not valid JSON"),
])
def test_request_bodies_that_are_not_one_json_object_are_refused(raw, message):
    with pytest.raises(RequestError, match=message) as e:
        request_body(raw)
    assert e.value.status == 400
    assert request_body(b'{"prompt": "a"}') == {"prompt": "a"}

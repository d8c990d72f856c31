"""OpenAI request fields read into SamplingParams, refusals, the chat template and what a stream
holds back, against hand-written expectations."""

import re

import pytest

from megatron.inference.engine import SamplingParams
from megatron.inference.engine.openai_protocol import (CHAT_STOP, Limits, RequestError,
                                                        chat_logprobs, completion_logprobs,
                                                        completion_prompt, held_back,
                                                        logprobs_asked, render_chat,
                                                        request_body, sampling_params)

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


@pytest.mark.parametrize("body, chat, param, message", [
    ({"prompt": "a", "foo": 1}, False, "foo", "Unrecognized request argument supplied: foo"),
    ({"prompt": "a", "temprature": 0.5}, False, "temprature",
     "Unrecognized request argument supplied: temprature"),
    ({"prompt": "a", "zz": 1, "yy": 2}, False, "yy",
     "Unrecognized request arguments supplied: yy, zz"),
    ({"messages": [], "prompt": "a"}, True, "prompt", "Unrecognized request argument supplied: prompt"),
    ({"prompt": "a", "messages": []}, False, "messages",
     "Unrecognized request argument supplied: messages"),
    ({"prompt": "a", "top_logprobs": 2}, False, "top_logprobs", "Unrecognized"),
    ({"prompt": "a", "tools": []}, False, "tools", "Unrecognized"),
    ({"messages": [], "tools": [{"type": "function"}]}, True, "tools", "tool calling"),
    ({"messages": [], "response_format": {"type": "json_object"}}, True, "response_format",
     "structured output"),
    ({"messages": [], "store": True}, True, "store", "storing completions"),
    ({"messages": [], "user": 5}, True, "user", "'user' must be a string"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, False, "stream_options",
     "only allowed when 'stream' is true"),
    ({"prompt": "a", "stream": True, "stream_options": {"x": True}}, False, "stream_options",
     "stream_options.x"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}, False,
     "stream_options", "true or false"),
])
def test_unknown_fields_are_refused_as_openai_does(body, chat, param, message):
    """A misspelt or foreign field used to be ignored silently (temperature 1 instead of the
    0.5 asked for); OpenAI answers 400 with the field named."""
    with pytest.raises(RequestError) as e:
        sampling_params(body, LIMITS, chat=chat)
    assert e.value.status == 400 and e.value.param == param and message in str(e.value)
    assert e.value.body() == {"error": {"message": str(e.value), "type": "invalid_request_error",
                                        "param": param, "code": None}}


def test_documented_fields_are_accepted():
    common = {"model": "m", "max_tokens": 3, "temperature": 0, "top_p": 0.9, "seed": 1,
              "stop": ["x"], "stream": True, "stream_options": {"include_usage": True}, "n": 1,
              "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0, "user": "u",
              "top_k": 5, "max_completion_tokens": None}
    completion = dict(common, prompt="a", best_of=1, echo=False, suffix=None, logprobs=2)
    chat = dict(common, messages=[], logprobs=True, top_logprobs=3, metadata={"k": "v"},
                store=False, service_tier="auto", safety_identifier="s", prompt_cache_key="k",
                parallel_tool_calls=True, tools=[], tool_choice="none", functions=None,
                function_call="none", response_format={"type": "text"}, modalities=["text"],
                audio=None, prediction=None, reasoning_effort=None, web_search_options=None,
                verbosity=None)
    assert sampling_params(completion, LIMITS).top_logprobs == 2
    assert sampling_params(chat, LIMITS, chat=True).top_logprobs == 3


@pytest.mark.parametrize("body, chat, asked", [
    ({}, False, None), ({"logprobs": None}, False, None), ({"logprobs": 0}, False, 0),
    ({"logprobs": 5}, False, 5), ({}, True, None), ({"logprobs": False}, True, None),
    ({"logprobs": True}, True, 0), ({"logprobs": True, "top_logprobs": 20}, True, 20),
    ({"logprobs": False, "top_logprobs": 0}, True, None),
])
def test_logprobs_asked(body, chat, asked):
    assert logprobs_asked(body, chat) == asked


@pytest.mark.parametrize("body, chat, param", [
    ({"logprobs": 6}, False, "logprobs"), ({"logprobs": True}, False, "logprobs"),
    ({"logprobs": -1}, False, "logprobs"), ({"logprobs": 2}, True, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
    ({"top_logprobs": 2}, True, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 1.5}, True, "top_logprobs"),
])
def test_logprobs_beyond_the_bounds_are_refused(body, chat, param):
    with pytest.raises(RequestError) as e:
        logprobs_asked(body, chat)
    assert e.value.param == param and e.value.status == 400


def test_logprobs_objects_have_openais_shapes():
    text = {1: "a", 2: "b", 3: "é", 4: "a"}.__getitem__
    entries = [(1, -0.1, ((1, -0.1), (2, -2.5), (4, -3.0))), (2, -2.0, ((3, -0.5), (2, -2.0), (1, -4.0)))]
    assert completion_logprobs(entries, text, 2) == {
        "tokens": ["a", "b"], "token_logprobs": [-0.1, -2.0],
        "top_logprobs": [{"a": -0.1, "b": -2.5}, {"é": -0.5, "b": -2.0}], "text_offset": None}
    # N = 0: the chosen token only; the chosen one is added when not among the N
    assert completion_logprobs(entries, text, 0)["top_logprobs"] == [{"a": -0.1}, {"b": -2.0}]
    assert completion_logprobs(entries, text, 1)["top_logprobs"] == [{"a": -0.1},
                                                                    {"é": -0.5, "b": -2.0}]
    chat = chat_logprobs(entries, text, 2)
    assert chat["refusal"] is None and len(chat["content"]) == 2
    assert chat["content"][1] == {"token": "b", "logprob": -2.0, "bytes": [98], "top_logprobs": [
        {"token": "é", "logprob": -0.5, "bytes": [195, 169]},
        {"token": "b", "logprob": -2.0, "bytes": [98]}]}


def test_message_keys_and_text_parts():
    """A message key the template does not read was dropped silently (``tool_calls``); text
    parts are OpenAI's other form of content."""
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert render_chat([{"role": "user", "content": parts, "name": "bob"}]) == \
        "user: Hello\nassistant:"
    for bad, words in (({"role": "user", "content": "x", "tool_calls": []},
                        "Unrecognized request argument supplied: messages[0].tool_calls"),
                       ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                        "a list of text parts"),
                       ({"role": "user", "content": []}, "a list of text parts"),
                       ({"role": "user", "content": "x", "name": 3}, "messages[0].name")):
        with pytest.raises(RequestError, match=re.escape(words)) as e:
            render_chat([bad])
        assert e.value.param == "messages"


@pytest.mark.parametrize("raw, where, param", [
    (b'{"prompt": "abc \\ud800 def"}', "'prompt'", "prompt"),
    (b'{"messages": [{"role": "user", "content": "x\\udc80y"}]}', "'messages[0].content'",
     "messages"),
    (b'{"prompt": "a", "stop": ["\\udfff"]}', "'stop[0]'", "stop"),
    # a key (the fourth hostile pass: the line named '', the object holding it)
    (b'{"prompt": "a", "x\\ud800": 1}', "'key 'x\\ud800''", "key 'x\\ud800'"),
    (b'{"messages": [{"role": "user", "content": "x", "\\ud800": 1}]}',
     "'messages[0].key '\\ud800''", "messages"),
])
def test_a_lone_surrogate_is_refused_naming_the_field(raw, where, param):
    """Valid JSON whose \\u escape is a lone surrogate reached SentencePiece: HTTP 500."""
    with pytest.raises(RequestError) as e:
        request_body(raw)
    assert str(e.value).startswith(f"{where} is not Unicode text") and e.value.param == param
    assert request_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}  # a pair

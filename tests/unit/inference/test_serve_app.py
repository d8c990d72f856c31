"""``tools/serve.py``'s HTTP application on a stub serving loop (no model): requests refused
before they reach the engine get OpenAI's 400 error object, never a 500."""

import json
import os
import sys

import pytest

from tests.helpers.paths import ROOT


class _NoEngine:
    """A serving loop that must not be reached by a refused request."""

    def busy(self):
        return False

    def submit(self, *args):
        raise AssertionError("a refused request reached the engine")


@pytest.fixture
def client():
    from fastapi.testclient import TestClient

    from megatron.inference.engine.openai_protocol import Limits
    from megatron.tokenizer.null_tokenizer import NullTokenizer

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import serve
    finally:
        sys.path.pop(0)
    app = serve.build_app(_NoEngine(), NullTokenizer(128), Limits(max_prompt_tokens=15,
                                                                 max_tokens=8), "m", 1 << 20)
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("prompt", ["1\u0000 2", "hello", "\U0001f600", "1 999"])
def test_text_a_null_tokenizer_cannot_take_is_a_400_naming_the_prompt(client, prompt):
    """The fourth hostile pass: a NullTokenizer server (ids as text) answered such prompts with
    HTTP 500 and a ValueError traceback in its log."""
    got = client.post("/v1/completions", content=json.dumps({"prompt": prompt, "max_tokens": 2}))
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith("the prompt cannot be tokenized: NullTokenizer: "), error

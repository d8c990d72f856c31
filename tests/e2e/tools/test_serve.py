"""tools/serve.py on the loopback: OpenAI's client gets greedy answers equal to
``megatron.inference.generate``; 8 concurrent clients x 2 requests each get exactly the answers
(text and log-probabilities) of the same requests run alone, none dropped; streaming equals
the whole answer; bad requests get 4xx JSON and the server keeps serving; TP=2 under torchrun
answers as TP=1."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="tools/serve.py needs the serve extra (fastapi)")
pytest.importorskip("uvicorn", reason="tools/serve.py needs the serve extra (uvicorn)")
openai = pytest.importorskip("openai", reason="the tests use the openai client (test extra)")

from megatron.core import parallel_state as ps  # noqa: E402
from tests.helpers.convert import convert, make_hf  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402

PROMPTS = ["To be, or not", "The quick brown fox jumps over", "ROMEO:", "Once upon a time there"]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


class Server:
    """A tools/serve.py process (or torchrun world) listening on a free loopback port."""

    def __init__(self, load, tokenizer_model, nproc=1, extra=()):
        tool = [os.path.join(ROOT, "tools", "serve.py"), "--load", str(load), "--port", "0",
                "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tokenizer_model,
                "--max-prompt-tokens", "48", "--max-body-bytes", "4096", "--block-size", "8",
                "--max-batch-size", "4", "--prefill-chunk", "16", "--max-tokens-per-step", "32",
                *extra]
        if nproc > 1:
            from megatron.training.initialize import _free_port

            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-port", str(_free_port()), *tool, "--distributed-backend", "gloo"]
        else:
            cmd = [sys.executable, *tool]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=_env(), start_new_session=True)
        deadline = time.time() + 300
        self.port = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise AssertionError(f"server died: {self.proc.stderr.read()[-3000:]}")
            if "serving on http://127.0.0.1:" in line:
                self.port = int(line.strip().rsplit(":", 1)[1])
                break
        assert self.port, "server did not start"
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none",
                                    max_retries=0, timeout=300)

    def rank0(self):
        """The pid of the process that serves HTTP: this one, or torchrun's worker of RANK 0."""
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid and b"RANK=0" in env:
                return int(name)
        return self.proc.pid

    def stop(self):
        # Rank 0 ends its steps and releases the others; torchrun then exits 0 with them.
        os.kill(self.rank0(), signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()

    def raw(self, method, path, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, json.loads(data)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("serve")
    make_hf(str(root / "hf"), vocab=32000)
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "tp1")
    return root, os.path.join(shared_data, "sentencepiece-llama-32k.model")


@pytest.fixture(scope="module")
def server(checkpoint):
    root, tokenizer_model = checkpoint
    s = Server(root / "tp1", tokenizer_model)
    yield s
    assert s.stop() == 0, s.proc.stderr.read()[-3000:]


def _tokenizer(tokenizer_model):
    from megatron.tokenizer import build_tokenizer
    import argparse

    return build_tokenizer(argparse.Namespace(tokenizer_type="Llama2Tokenizer",
                                              tokenizer_model=tokenizer_model,
                                              tokenizer_name_or_path=None, vocab_size=None))


def _generate_rank(load, prompts, new):
    from megatron.inference import generate
    from megatron.inference.model_loader import load_model_for_inference

    groups = ps.initialize_model_parallel(1, 1)
    model, saved = load_model_for_inference(load, groups)
    return [generate(model, [p], new, greedy=True, vocab_size=saved["true_vocab_size"],
                     pg_collection=groups)[0][len(p):] for p in prompts]


def _requests():
    """8 clients x 2 requests: greedy and seeded sampling, stop strings, different lengths."""
    out = []
    for i in range(16):
        kw = {"prompt": PROMPTS[i % 4], "max_tokens": 4 + i % 5, "logprobs": 1}
        if i % 3 == 0:
            kw["temperature"] = 0
        else:
            kw.update(temperature=0.9, top_p=0.95, seed=i)
        if i % 4 == 3:
            kw["top_k"] = 40
        out.append(kw)
    return out


def _ask(client, kw):
    kw = dict(kw)
    extra = {"top_k": kw.pop("top_k")} if "top_k" in kw else None
    r = client.completions.create(model="m", extra_body=extra, **kw)
    c = r.choices[0]
    return c.text, c.finish_reason, c.logprobs.token_logprobs, r.usage.completion_tokens


def test_greedy_completion_equals_generate(checkpoint, server):
    root, tokenizer_model = checkpoint
    tok = _tokenizer(tokenizer_model)
    expected = run_distributed(1, _generate_rank, str(root / "tp1"),
                               [tok.tokenize(p) for p in PROMPTS], 8)[0]
    for prompt, ids in zip(PROMPTS, expected):
        r = server.client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == tok.detokenize(ids)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


def test_concurrent_clients_get_the_answers_of_requests_run_alone(server):
    requests = _requests()
    alone = [_ask(server.client, kw) for kw in requests]  # one at a time: each runs alone
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: [_ask(server.client, requests[2 * i + j]) for j in (0, 1)],
                                 range(8)))
    together = [a for pair in together for a in pair]
    assert together == alone  # text, finish reason, fp32 log-probabilities: bitwise
    assert all(n == kw["max_tokens"] for (_, _, _, n), kw in zip(alone, requests))
    assert len({a[0] for a in alone}) > 8  # seeds and prompts do give different answers


def test_streaming_equals_the_whole_answer_and_chat_uses_the_builtin_template(server):
    kw = dict(model="m", prompt=PROMPTS[1], max_tokens=10, temperature=0.8, seed=3)
    whole = server.client.completions.create(**kw).choices[0].text
    chunks = list(server.client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = server.client.chat.completions.create(model="m", messages=messages, max_tokens=10,
                                                 temperature=0)
    rendered = "system: Be brief.\nuser: Hello\nassistant:"
    plain = server.client.completions.create(model="m", prompt=rendered, max_tokens=10,
                                             temperature=0, stop=["\nuser:"])
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].finish_reason == plain.choices[0].finish_reason
    streamed = server.client.chat.completions.create(model="m", messages=messages, max_tokens=10,
                                                     temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content


def test_stop_string_cuts_the_text(server):
    whole = server.client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=8,
                                             temperature=0).choices[0].text
    stop = whole[3:6]
    r = server.client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=8,
                                         temperature=0, stop=[stop])
    assert r.choices[0].text == whole[:whole.index(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status, words", [
    (b'{"prompt": "hi", ', 400, "not valid JSON"),
    (b'[1, 2]', 400, "JSON object"),
    (json.dumps({"prompt": "word " * 60}).encode(), 400, "at most 48 (--max-prompt-tokens)"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), 400, "'temperature' must be"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "'max_tokens' must be"),
    (json.dumps({"prompt": "hi", "n": 2}).encode(), 400, "'n' must be 1"),
    (json.dumps({"prompt": ["a", "b"]}).encode(), 400, "one prompt per request"),
    (json.dumps({"prompt": [1, 99999]}).encode(), 400, "prompt token ids must be in"),
    (json.dumps({"prompt": "x" * 5000}).encode(), 413, "--max-body-bytes"),
    (json.dumps({"prompt": "hi", "temprature": 0}).encode(), 400,
     "Unrecognized request argument supplied: temprature"),
    (json.dumps({"prompt": "hi", "logprobs": 6}).encode(), 400, "'logprobs' must be an integer in [0, 5]"),
])
def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(server, body, status, words):
    got, answer = server.raw("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert got == status and words in answer["error"]["message"], answer
    ok = server.client.completions.create(model="m", prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_unknown_fields_get_openais_error_object(server):
    """A field the endpoint does not know used to be ignored silently; OpenAI's 400 names it."""
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2, "foo": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "foo": 1})):
        got, answer = server.raw("POST", path, json.dumps(body))
        assert got == 400 and answer == {"error": {
            "message": "Unrecognized request argument supplied: foo",
            "type": "invalid_request_error", "param": "foo", "code": None}}, answer
    got, answer = server.raw("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}))
    assert got == 400 and answer["error"]["param"] == "top_logprobs", answer
    # the fields documented as accepted and ignored are
    ok = server.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        user="someone", metadata={"k": "v"}, store=False, service_tier="auto",
        response_format={"type": "text"}, tools=None)
    assert ok.usage.completion_tokens == 2


def _top_rank(load, prompt, new, n):
    """The oracle: greedy ids, then a plain forward over prompt + ids without cache; per
    position the n largest values of its fp32 log_softmax over the true vocabulary."""
    import torch

    from megatron.inference import generate
    from megatron.inference.forward import forward_logits
    from megatron.inference.model_loader import load_model_for_inference

    groups = ps.initialize_model_parallel(1, 1)
    model, saved = load_model_for_inference(load, groups)
    ids = generate(model, [prompt], new, greedy=True, vocab_size=saved["true_vocab_size"],
                   pg_collection=groups)[0][len(prompt):]
    with torch.no_grad():
        logits = forward_logits(model, torch.tensor([prompt + ids[:-1]]),
                                pg_collection=groups)[0, len(prompt) - 1:]
    logp = torch.log_softmax(logits[:, :saved["true_vocab_size"]].float(), dim=-1)
    return ids, logp.topk(n).values.tolist()


def test_top_logprobs_equal_the_forwards_log_softmax(checkpoint, server):
    """Completions' ``logprobs: N`` and chat's ``top_logprobs: N`` give each position's N most
    likely tokens with the log-probabilities of a plain log_softmax of the forward's logits
    (they were always null); streamed, the same entries arrive."""
    root, tokenizer_model = checkpoint
    tok = _tokenizer(tokenizer_model)
    messages = [{"role": "user", "content": "Hello"}]
    rendered = "user: Hello\nassistant:"
    ids, top = run_distributed(1, _top_rank, str(root / "tp1"), tok.tokenize(rendered), 6, 3)[0]
    chat = server.client.chat.completions.create(model="m", messages=messages, max_tokens=6,
                                                 temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    n = len(content)  # fewer than 6 when the answer stopped at the template's stop string
    assert 1 <= n and [c.token for c in content] == [tok.detokenize([i]) for i in ids[:n]]
    for c, values in zip(content, top):
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(values, abs=2e-5)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
        assert bytes(c.bytes).decode("utf-8") == c.token
    streamed = server.client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    got = [c.model_dump() for k in chunks[:-1] if k.choices[0].logprobs
           for c in k.choices[0].logprobs.content]
    assert got == [c.model_dump() for c in content]

    r = server.client.completions.create(model="m", prompt=rendered, max_tokens=6, temperature=0,
                                         logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 6 and lp.token_logprobs == pytest.approx(
        [values[0] for values in top], abs=2e-5)
    for alternatives, values, token, chosen in zip(lp.top_logprobs, top, lp.tokens,
                                                   lp.token_logprobs):
        # up to N + 1 entries: the N most likely (ids of one text merge) and the chosen one
        assert alternatives[token] == chosen and 1 <= len(alternatives) <= 4
        assert all(min(abs(v - w) for w in values) < 2e-5 for v in alternatives.values())


def test_bad_chat_and_unknown_route(server):
    got, answer = server.raw("POST", "/v1/chat/completions",
                             json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    assert got == 400 and "messages[0]" in answer["error"]["message"]
    got, answer = server.raw("GET", "/v1/nothing")
    assert got == 404 and "no route" in answer["error"]["message"]


def test_bad_flags_and_wrong_world_are_one_line_and_exit_2(checkpoint, tmp_path):
    root, tokenizer_model = checkpoint
    base = [sys.executable, os.path.join(ROOT, "tools", "serve.py"), "--port", "0",
            "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tokenizer_model]
    proc = subprocess.run(base + ["--load", str(root / "tp1"), "--block-size", "0"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "serve.py: error: --block-size must be >= 1 (got 0)", proc.stderr


def test_tensor_parallel_server_under_torchrun_answers_as_tp1(checkpoint, server):
    root, tokenizer_model = checkpoint
    convert("--loader", "hf", "--saver", "megatron", "--load-dir", root / "hf", "--save-dir",
            root / "tp2", "--target-tensor-parallel-size", 2)
    requests = _requests()[:8]
    expected = [_ask(server.client, kw) for kw in requests]
    tp2 = Server(root / "tp2", tokenizer_model, nproc=2)
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda kw: _ask(tp2.client, kw), requests))
    finally:
        assert tp2.stop() == 0, tp2.proc.stderr.read()[-3000:]
    for (text, reason, logprobs, n), (etext, ereason, elogprobs, en) in zip(got, expected):
        assert (text, reason, n) == (etext, ereason, en)
        assert max(abs(a - b) for a, b in zip(logprobs, elogprobs)) < 2e-5


@pytest.mark.parametrize("flag, words", [
    (["--speculative-model", "draft"], "--speculative-model: speculative decoding is not built"),
    (["--num-speculative-tokens", "4"], "--num-speculative-tokens: speculative decoding is not built"),
    (["--enable-prefix-caching"], "--enable-prefix-caching: prefix caching is not built")])
def test_what_is_not_built_is_refused_in_one_line(tmp_path, flag, words):
    import contextlib
    import io

    from tools.serve import command

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = command(["--load", str(tmp_path / "none"), "--port", "0", *flag])
    lines = stderr.getvalue().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith(f"serve.py: error: {words}")

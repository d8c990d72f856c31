"""Serve a checkpoint over OpenAI's HTTP API, at its TP/PP layout, with continuous batching.

For evaluating and trying a checkpoint where it lies, not for production serving
(docs/serving.md). Usage (TP x PP processes; rank 0 serves HTTP, the others follow its steps)::

    torchrun --nproc-per-node 4 tools/serve.py --load ckpt --port 8000
    python tools/serve.py --load ckpt --port 8000 --tokenizer-type Llama2Tokenizer \\
        --tokenizer-model tokenizer.model

then ``POST /v1/completions`` or ``/v1/chat/completions`` (``stream: true`` for server-sent
events) on http://127.0.0.1:8000. Needs the ``serve`` extra (``pip install -e .[serve]``:
FastAPI and uvicorn). Not built: speculative decoding, prefix caching, several choices per
request (``n``), several model replicas (data-parallel size 1).
"""

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint folder (with the tracker file)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: any free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--served-model-name", default=None, help="'model' in answers (default: --load's name)")
    p.add_argument("--tokenizer-type", default=None)
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--tokenizer-name-or-path", default=None,
                   help="HuggingFaceTokenizer folder (default: the checkpoint's)")
    p.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    g = p.add_argument_group("engine")
    g.add_argument("--kv-cache-blocks", type=int, default=None,
                   help="KV-cache blocks (default: --kv-cache-bytes' worth)")
    g.add_argument("--kv-cache-bytes", type=int, default=256 * 2 ** 20,
                   help="KV-cache budget per rank in bytes (default 256 MiB)")
    g.add_argument("--block-size", type=int, default=16, help="positions per KV-cache block")
    g.add_argument("--max-batch-size", type=int, default=32, help="requests running at once")
    g.add_argument("--max-tokens-per-step", type=int, default=512, help="tokens per engine step")
    g.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill piece")
    g.add_argument("--packed", action="store_true",
                   help="one forward per step for all requests (faster; answers then equal a "
                        "request run alone to fp32 rounding, not bitwise)")
    lim = p.add_argument_group("request limits")
    lim.add_argument("--max-prompt-tokens", type=int, default=None,
                     help="longest prompt in tokens (default: the model's context - 1)")
    lim.add_argument("--max-new-tokens-limit", type=int, default=512, help="largest max_tokens")
    lim.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    lim.add_argument("--max-body-bytes", type=int, default=2 ** 20, help="largest request body")
    no = p.add_argument_group("not built (refused: vLLM's flags, named so that asking says so)")
    for flag in NOT_BUILT:
        no.add_argument(flag, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# vLLM's flags for what this server does not do, and the one line that refuses each.
NOT_BUILT = {
    "--speculative-model": "speculative decoding is not built (every token is one forward of the "
                           "model itself)",
    "--num-speculative-tokens": "speculative decoding is not built (every token is one forward "
                                "of the model itself)",
    "--enable-prefix-caching": "prefix caching is not built (no KV-cache blocks are shared "
                               "between requests: each computes its own prompt)",
}


def refuse_not_built(args) -> None:
    """One line for a flag of :data:`NOT_BUILT` (before anything is read)."""
    from megatron.usage_error import UsageError

    for flag, why in NOT_BUILT.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise UsageError(f"{flag}: {why}; see docs/serving.md 'Not built'")


def validate(args, saved: dict) -> None:
    """Refuse bad flags before any process group is made (UsageError naming the flag)."""
    from megatron.usage_error import UsageError

    for name in ("block_size", "max_batch_size", "max_tokens_per_step", "prefill_chunk",
                 "max_new_tokens_limit", "max_waiting", "max_body_bytes", "kv_cache_bytes"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.kv_cache_blocks is not None and args.kv_cache_blocks < 1:
        raise UsageError(f"--kv-cache-blocks must be >= 1 (got {args.kv_cache_blocks})")
    if args.max_tokens_per_step < args.prefill_chunk:
        raise UsageError(f"--max-tokens-per-step ({args.max_tokens_per_step}) must be >= "
                         f"--prefill-chunk ({args.prefill_chunk})")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535] (got {args.port})")
    context = saved.get("max_position_embeddings") or 0
    if args.max_prompt_tokens is not None and not 1 <= args.max_prompt_tokens < context:
        raise UsageError(f"--max-prompt-tokens must be in [1, {context - 1}] (the model's "
                         f"context is {context}; got {args.max_prompt_tokens})")


def kv_blocks(args, model, groups) -> int:
    """``--kv-cache-blocks``, else as many blocks as ``--kv-cache-bytes`` holds on the rank with
    the most layers (the same number on every rank)."""
    from megatron.inference.engine import bytes_per_block

    if args.kv_cache_blocks is not None:
        return args.kv_cache_blocks
    c = model.config
    layers = -(-c.num_layers // groups.pp.size)
    per_block = bytes_per_block(args.block_size, layers, c.num_query_groups // groups.tp.size,
                                c.kv_channels, c.params_dtype.itemsize)
    return max(1, args.kv_cache_bytes // per_block)


def build_app(loop, tokenizer, limits, model_name: str, max_body_bytes: int):
    """The FastAPI application of rank 0 (OpenAI's /v1/completions, /v1/chat/completions,
    /v1/models; /health)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    from megatron.inference.engine.openai_protocol import (CHAT_STOP, RequestError,
                                                            chat_logprobs, completion_logprobs,
                                                            completion_prompt, error_body,
                                                            held_back, logprobs_asked,
                                                            render_chat, request_body,
                                                            sampling_params)

    app = FastAPI(title="megatron-llama-3d", docs_url=None, redoc_url=None)

    def refuse(error: RequestError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def read_body(request: Request):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise RequestError(f"the request body ({size} bytes) exceeds --max-body-bytes "
                               f"({max_body_bytes})", status=413)
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise RequestError(f"the request body exceeds --max-body-bytes ({max_body_bytes})",
                               status=413)
        return request_body(raw)

    def tokens_of(prompt):
        if isinstance(prompt, str):
            try:
                ids = tokenizer.tokenize(prompt)
            except ValueError as exc:  # text this tokenizer cannot take (NullTokenizer: ids only)
                raise RequestError(f"the prompt cannot be tokenized: {exc}", "prompt") from None
        else:
            ids = prompt
        if len(ids) > limits.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(ids)} tokens; this server takes at most "
                               f"{limits.max_prompt_tokens} (--max-prompt-tokens)", "prompt",
                               code="context_length_exceeded")
        if not ids:
            raise RequestError("the prompt is empty after tokenization", "prompt")
        return ids

    async def submit(ids, params):
        """Queue the request; returns its asyncio queue once the engine accepted it."""
        if loop.busy():
            raise RequestError("the server is busy (--max-waiting requests queued); retry later",
                               status=429)
        aio = asyncio.get_running_loop()
        deliveries: asyncio.Queue = asyncio.Queue()
        loop.submit(ids, params, lambda d: aio.call_soon_threadsafe(deliveries.put_nowait, d))
        return deliveries

    async def answer(request: Request, chat: bool):
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            body = await read_body(request)
            if chat:
                params = sampling_params(body, limits, extra_stop=(CHAT_STOP,), chat=True)
                prompt = render_chat(body.get("messages"))
            else:
                params = sampling_params(body, limits)
                prompt = completion_prompt(body)
            top = logprobs_asked(body, chat)  # None: no log-probabilities asked for
            ids = tokens_of(prompt)
            deliveries = await submit(ids, params)
            first = await deliveries.get()
            if first.kind == "error":
                raise RequestError(first.message, "prompt")
        except RequestError as e:
            return refuse(e)
        stream = bool(body.get("stream", False))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        obj = "chat.completion" if chat else "text_completion"

        def logprobs_of(deliveries):
            if top is None:
                return None
            entries = [(d.token, d.logprob, d.top) for d in deliveries]
            return (chat_logprobs if chat else completion_logprobs)(
                entries, lambda t: tokenizer.detokenize([t]), top)

        def choice(text, reason, logprobs=None, delta=False):
            c = {"index": 0, "finish_reason": reason}
            if chat:
                c["delta" if delta else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            c["logprobs"] = logprobs
            return c

        def usage(last):
            return {"prompt_tokens": last.prompt_tokens,
                    "completion_tokens": last.completion_tokens,
                    "total_tokens": last.prompt_tokens + last.completion_tokens}

        async def deliveries_from(first):
            d = first
            while True:
                yield d
                if d.finish_reason is not None:
                    return
                d = await deliveries.get()

        if not stream:
            delivered = [d async for d in deliveries_from(first)]
            last = delivered[-1]
            return JSONResponse({
                "id": rid, "object": obj, "created": created, "model": model_name,
                "choices": [choice(last.text, last.finish_reason, logprobs_of(delivered))],
                "usage": usage(last)})

        eod = loop.engine.eod

        async def events():
            ids_so_far, sent, unsent = [], "", []
            head = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                    "model": model_name}
            async for d in deliveries_from(first):
                unsent.append(d)  # a token whose text is held back goes with the next chunk
                if d.finish_reason is not None:
                    delta, reason = d.text[len(sent):] if d.text.startswith(sent) else "", d.finish_reason
                else:
                    if d.token != eod:
                        ids_so_far.append(d.token)
                    text = tokenizer.detokenize(ids_so_far)
                    end = len(text) - held_back(text, params.stop)
                    if not text.startswith(sent) or end <= len(sent):
                        continue
                    delta, reason, sent = text[len(sent):end], None, text[:end]
                chunk = dict(head, choices=[choice(delta, reason, logprobs_of(unsent), delta=True)])
                unsent = []
                if include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:  # OpenAI's stream_options: a last chunk with the usage, no choice
                yield f"data: {json.dumps(dict(head, choices=[], usage=usage(d)))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "megatron-llama-3d"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return JSONResponse(error_body(f"no route {request.url.path}", code="not_found",
                                       status=404), status_code=404)

    return app


def serve_http(app, host: str, port: int, loop) -> threading.Thread:
    """uvicorn in a thread of rank 0; prints ``serving on http://HOST:PORT`` once it listens and
    stops the engine loop when it ends (a port that cannot be bound ends it at once)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))

    def run():
        try:
            server.run()
        finally:
            loop.stop()

    thread = threading.Thread(target=run, name="http", daemon=True)
    thread.start()
    while thread.is_alive() and not server.started:
        time.sleep(0.05)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()[1]
        print(f"serving on http://{host}:{bound}", flush=True)
    thread.server = server
    return thread


def main(argv=None) -> int:
    from megatron.inference.engine import Engine
    from megatron.inference.engine.openai_protocol import Limits
    from megatron.inference.engine.serving_loop import ServingLoop
    from megatron.inference.launch import eod_of, open_checkpoint
    from megatron.inference.model_loader import checkpoint_args
    from megatron.usage_error import UsageError

    args = parse_args(argv)
    refuse_not_built(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"tools/serve.py needs FastAPI and uvicorn ({e}): pip install -e .[serve]")
    validate(args, checkpoint_args(args.load))
    import torch
    import torch.distributed as dist

    opened = open_checkpoint(args.load, args, distributed_backend=args.distributed_backend,
                             tool="tools/serve.py", exact=True)
    model, groups, tokenizer, device = opened.model, opened.groups, opened.tokenizer, opened.device
    try:
        torch.set_grad_enabled(False)
        engine = Engine(model, groups, num_blocks=kv_blocks(args, model, groups),
                        block_size=args.block_size, max_batch_size=args.max_batch_size,
                        max_tokens_per_step=args.max_tokens_per_step,
                        prefill_chunk=args.prefill_chunk,
                        vocab_size=opened.vocab_size,
                        eod=eod_of(tokenizer), detokenize=tokenizer.detokenize,
                        packed=args.packed, device=device)
        if not engine.is_leader:
            # A stop signal is rank 0's to act on: it ends its steps and releases this rank
            # (torchrun forwards Ctrl-C / SIGTERM to every worker).
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            while engine.follow():
                pass
            return 0
        context = model.config.max_position_embeddings
        limits = Limits(max_prompt_tokens=args.max_prompt_tokens or context - 1,
                        max_tokens=min(args.max_new_tokens_limit, context - 1))
        loop = ServingLoop(engine, tokenizer.detokenize, max_waiting=args.max_waiting)
        name = args.served_model_name or os.path.basename(os.path.normpath(args.load))
        app = build_app(loop, tokenizer, limits, name, args.max_body_bytes)
        http = serve_http(app, args.host, args.port, loop)
        if not http.is_alive():
            loop.engine.shutdown()
            raise UsageError(f"tools/serve.py cannot listen on --host {args.host} --port "
                             f"{args.port} (in use, or not an address of this machine)",
                             reporter=dist.get_rank())
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: (setattr(http.server, "should_exit", True), loop.stop()))
        loop.run()  # returns once the HTTP server stopped (signal) and releases the followers
        http.join(timeout=10)
        return 0
    finally:
        opened.close()


def command(argv=None) -> int:
    """The command line: a wrong flag, checkpoint or tokenizer is one line
    ``serve.py: error: ...`` and status 2."""
    from megatron.core.dist_checkpointing.checkpoint_io import CheckpointError
    from megatron.usage_error import UsageError, run_command

    return run_command("serve.py", main, argv,
                       usage_errors=(UsageError, ValueError, FileNotFoundError, CheckpointError))


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(command)())

"""The scheduling rank's loop between a server's threads and the :class:`Engine`: requests are
submitted from any thread, the loop (the thread that owns the engine's collectives) adds them
between steps and hands each request's tokens to its ``sink``."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from megatron.inference.engine.engine import Engine
from megatron.inference.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Delivery:
    """What a sink receives: ``kind`` ``"error"`` (``message``: the request was refused),
    ``"token"`` (one new token, its log-probability and ``top``, the most likely tokens when the
    request asked for them; on the last, ``finish_reason`` and the final ``text``: cut before a
    stop string, without the end-of-document token)."""

    kind: str
    message: str = ""
    token: int = -1
    logprob: float = 0.0
    finish_reason: Optional[str] = None
    text: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    top: tuple = ()  # ((id, logprob), ...): the request's top_logprobs most likely tokens


class ServingLoop:
    """Runs ``engine`` (scheduling rank) until :meth:`stop`.

    Args:
        detokenize: ids -> text (the final text of each request).
        max_waiting: submissions beyond this many queued requests are refused (429 by a server).
    """

    def __init__(self, engine: Engine, detokenize: Callable[[Sequence[int]], str],
                 max_waiting: int = 64):
        self.engine = engine
        self.detokenize = detokenize
        self.max_waiting = max_waiting
        self._inbox: "queue.Queue" = queue.Queue()
        self._sinks: Dict[int, Callable[[Delivery], None]] = {}
        self._stop = threading.Event()

    def busy(self) -> bool:
        """More requests waiting than ``max_waiting``."""
        return self._inbox.qsize() + len(self.engine.scheduler.waiting) >= self.max_waiting

    def submit(self, prompt: List[int], params: SamplingParams,
               sink: Callable[[Delivery], None]) -> None:
        """Queue a request (any thread); ``sink`` is called from the loop's thread."""
        self._inbox.put((prompt, params, sink))

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Until :meth:`stop`: admit submissions, step, deliver; then release the followers."""
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not engine.has_work())
                if engine.has_work():
                    for event in engine.step():
                        self._deliver(event)
        finally:
            engine.shutdown()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            prompt, params, sink = item
            try:
                rid = self.engine.add_request(prompt, params)
                self._sinks[rid] = sink
            except ValueError as e:
                sink(Delivery("error", message=str(e)))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def _deliver(self, event) -> None:
        request = self.engine.requests[event.rid]
        text = None
        if event.finish_reason is not None:
            text = request.text
            if text is None:
                ids = request.output
                if ids and self.engine.eod is not None and ids[-1] == self.engine.eod:
                    ids = ids[:-1]
                text = self.detokenize(ids)
            # The finished request's state is no longer needed by the engine.
            del self.engine.requests[event.rid]
        sink = self._sinks[event.rid] if event.finish_reason is None else self._sinks.pop(event.rid)
        sink(Delivery("token", token=event.token, logprob=event.logprob,
                      finish_reason=event.finish_reason, text=text,
                      prompt_tokens=len(request.prompt), completion_tokens=len(request.output),
                      top=event.top))

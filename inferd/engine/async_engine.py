"""AsyncEngine: runs the engine's step loop on its own thread and streams each request's per-step outputs to
asyncio callers. The engine is not thread-safe: every add and abort goes through a command queue that the step
thread drains between steps, so an abort takes effect within one step."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine import Engine, RequestOutput
from .request import SamplingParams


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._counter = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="inferd-engine", daemon=True)
        self._thread.start()

    def _next_id(self) -> str:
        with self._lock:
            self._counter += 1
            return f"req-{self._counter}"

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       num_prompt_tokens: int | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs step by step; the last one has finished=True. Bad input raises
        InvalidRequestError here, before anything is queued. Leaving the iteration early aborts the request."""
        if self._stop:
            raise EngineDeadError("the engine is shut down")
        self.engine.validate(prompt_token_ids, params, num_prompt_tokens)
        request_id = request_id or self._next_id()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", request_id, (prompt_token_ids, params, num_prompt_tokens), stream))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None, None))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- the step thread ------------------------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                kind, request_id, args, stream = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                prompt, params, num_prompt = args
                try:
                    self.engine.add_request(prompt, params, request_id, num_prompt)
                    self._streams[request_id] = stream
                except Exception as e:  # validated before, but the engine has the last word
                    stream.put(e)
            elif kind == "abort":
                if self.engine.abort(request_id):
                    self._streams.pop(request_id, None)

    def _loop(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails the requests in it, not the process
                err = EngineDeadError(f"engine step failed: {e!r}")
                for request_id, stream in list(self._streams.items()):
                    self.engine.abort(request_id)
                    stream.put(err)
                self._streams.clear()
                self.engine.take_pending_outputs()  # the abort notices: their streams already got the error
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                stream.put(out)
                if out.finished:
                    del self._streams[out.request_id]

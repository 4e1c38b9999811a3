"""EngineLoop: the worker's step thread, sole owner of its engine (not thread-safe), which it drives through
EngineProtocol (inferd/engine/protocol.py) alone.

Adds, aborts, dropped connections and the stop order arrive as commands on a queue that is drained between steps,
so an abort takes effect within one step. Each step's outputs leave as ONE `outputs` message per connection, every
entry stamped with the epoch its request was dispatched with. Several connections (gateways) share the engine: a
request's id in the engine is its connection's plus the client's own, so two gateways never collide, and a
connection can abort or drop only its own requests. Between steps the loop publishes a stats snapshot (from the
engine's snapshot()) that the heartbeat thread sends without touching the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import ENGINE_MAX_WAITING
from ..engine.errors import InvalidRequestError
from ..engine.outputs import RequestOutput
from ..engine.protocol import EngineProtocol, EngineSnapshot
from .faults import FaultInjector
from .protocol import OUTPUTS, AddRequest, WorkerStats, error_message, output_entry, rejected_message

log = logging.getLogger("inferd.worker")


class Peer(Protocol):
    """A client connection as the loop sees it: send() never raises; closed turns True once it is gone."""
    closed: bool

    def send(self, message: dict[str, Any]) -> None: ...


@dataclass
class _Dispatch:
    peer: Peer
    epoch: int
    client_id: str  # the request id as its client knows it


def engine_id(peer: Peer, request_id: str) -> str:
    """The request's id inside the engine: unique across connections (id(peer) while the connection lives)."""
    return f"{id(peer):x}/{request_id}"


class EngineLoop:
    def __init__(self, engine: EngineProtocol, on_crash: Callable[[BaseException], None] | None = None,
                 faults: FaultInjector | None = None):
        self.engine = engine
        self.on_crash = on_crash  # called from the step thread if the loop itself fails (a bug, not a bad step)
        self.faults = faults  # tests only (INFERD_FAULT): None in normal operation
        self.draining = False  # set (from any thread) when a stop was asked for: new requests are refused
        self._step_seconds_total = 0.0
        # replaced (never mutated) between steps: safe to read from any thread
        self.stats = self._worker_stats(engine.snapshot())
        self.step_started_at: float | None = None  # time.monotonic() of the step in progress, None between steps
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._dispatches: dict[str, _Dispatch] = {}  # request id -> who asked for it, under which epoch
        self._stop_deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="inferd-engine-loop", daemon=True)

    # ---- called from other threads --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def run_here(self) -> None:
        """Runs the loop on the calling thread until it ends (drained after stop(), or crashed: on_crash). The
        worker runs it on its main thread, the one that built the engine (torch's OpenMP pool belongs to it)."""
        self._thread = threading.current_thread()
        self._run()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is threading.current_thread():  # run_here(): it has returned by the time this thread runs
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def add(self, peer: Peer, request: AddRequest) -> None:
        self._put(("add", peer, request))

    def abort(self, peer: Peer, request_id: str) -> None:
        self._put(("abort", peer, request_id))

    def drop(self, peer: Peer) -> None:
        """The connection is gone: abort every request it dispatched, so that their KV blocks are freed."""
        self._put(("drop", peer, None))

    def stop(self, grace_period: float) -> None:
        """Drain: refuse new requests (retryable: the gateway sends them elsewhere), let the running ones finish
        for up to grace_period seconds, then stop the rest with a retryable error (the gateway replays them on
        another worker), and end the thread."""
        self.draining = True
        self._put(("stop", None, grace_period))

    def _put(self, command: tuple) -> None:
        self._commands.put(command)  # SimpleQueue.put is safe even from a signal handler
        self._wake.set()

    def step_seconds(self) -> float:
        """How long the step in progress has been running (0 between steps)."""
        started = self.step_started_at
        return 0.0 if started is None else time.monotonic() - started

    # ---- the step thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            log.exception("the engine loop failed")
            if self.on_crash is not None:
                self.on_crash(e)

    def _loop(self) -> None:
        while True:
            self._drain_commands()
            if self._should_exit():
                self._move_everything()
                self._publish(self.engine.take_pending_outputs())
                return
            if self.engine.has_unfinished_requests():
                started = time.perf_counter()
                outputs = self._step()
                self._publish(outputs, time.perf_counter() - started)
                continue
            self._publish(self.engine.take_pending_outputs())
            self._wake.wait(timeout=self._idle_timeout())
            self._wake.clear()  # a command put after this line sets it again; one put before is drained next

    def _should_exit(self) -> bool:
        if self._stop_deadline is None:
            return False
        return not self.engine.has_unfinished_requests() or time.monotonic() >= self._stop_deadline

    def _idle_timeout(self) -> float | None:
        return None if self._stop_deadline is None else max(0.0, self._stop_deadline - time.monotonic())

    def _step(self) -> list[RequestOutput]:
        self.step_started_at = time.monotonic()
        # outputs from between steps (aborts' final ones), taken here so that a step that fails does not lose them
        pending = self.engine.take_pending_outputs()
        try:
            if self.faults is not None:
                self.faults.before_step(self.engine)
            return pending + self.engine.step()
        except Exception as e:  # a failed step fails the requests in it, not the worker nor the others
            log.exception("engine step failed")
            return pending + self._fail_step(e)
        finally:
            self.step_started_at = None
            self._report_failures()

    def _report_failures(self) -> None:
        """Requests the engine stopped on an error of their own (a grammar it could not use, or one too slow):
        their clients are told (with the error's code, when it has one), the other requests carry on."""
        for request_id, why, code in self.engine.take_failed():
            dispatch = self._dispatches.pop(request_id, None)
            if dispatch is not None:
                dispatch.peer.send(error_message(why, dispatch.client_id, dispatch.epoch, code=code))

    def _fail_step(self, error: Exception) -> list[RequestOutput]:
        """The requests the failed step ran (its schedule's; when it failed before scheduling: the running ones, or
        the waiting ones when none ran) are stopped, their KV blocks freed, their clients told; the other requests
        and other clients' outputs carry on."""
        in_step = set(self.engine.failed_step_request_ids())
        for request_id in in_step:
            self.engine.abort(request_id)
            dispatch = self._dispatches.pop(request_id, None)
            if dispatch is not None:
                dispatch.peer.send(error_message(f"engine step failed: {error!r}", dispatch.client_id,
                                                 dispatch.epoch))
        # their final (abort) outputs are dropped: their streams already got the error; the rest go out
        return [o for o in self.engine.take_pending_outputs() if o.request_id not in in_step]

    def _move_everything(self) -> None:
        """The grace period is over: every request still running is stopped here and reported as retryable, so
        that its client can replay it elsewhere (prompt + the tokens it already got)."""
        for request_id in self.engine.unfinished_request_ids():
            dispatch = self._dispatches.pop(request_id, None)
            self.engine.abort(request_id)
            if dispatch is not None:
                dispatch.peer.send(error_message("the worker shut down before the request finished (grace period "
                                                 "over)", dispatch.client_id, dispatch.epoch, retry=True))

    # ---- commands -------------------------------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                kind, peer, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(peer, arg)
            elif kind == "abort":
                key = engine_id(peer, arg)
                dispatch = self._dispatches.get(key)
                if dispatch is not None and dispatch.peer is peer:
                    self.engine.abort(key)  # its final output (finish_reason "abort") goes out with the next batch
            elif kind == "drop":
                self._drop(peer)
            elif kind == "stop" and self._stop_deadline is None:
                self._stop_deadline = time.monotonic() + arg

    def _add(self, peer: Peer, request: AddRequest) -> None:
        if peer.closed:
            return  # dispatched by a connection that is already gone: nobody would read the tokens
        if self._stop_deadline is not None:
            peer.send(rejected_message(request.request_id, request.epoch, "the worker is shutting down", retry=True))
            return
        # several gateways overfilling one worker (requests whose grammar is compiling wait too)
        if self.engine.num_waiting() >= ENGINE_MAX_WAITING:
            peer.send(rejected_message(request.request_id, request.epoch, f"the worker's queue is full "
                                       f"({ENGINE_MAX_WAITING} requests waiting)", retry=True))
            return
        key = engine_id(peer, request.request_id)
        try:
            self.engine.add_request(request.prompt_token_ids, request.params, key, request.num_prompt_tokens)
        except InvalidRequestError as e:
            peer.send(rejected_message(request.request_id, request.epoch, str(e).replace(key, request.request_id)))
            return
        self._dispatches[key] = _Dispatch(peer, request.epoch, request.request_id)

    def _drop(self, peer: Peer) -> None:
        mine = [rid for rid, d in self._dispatches.items() if d.peer is peer]
        for request_id in mine:
            self.engine.abort(request_id)
            del self._dispatches[request_id]
        if mine:
            log.info("connection dropped: aborted %d request(s)", len(mine))

    # ---- outputs and stats ----------------------------------------------------------------------------------
    def _publish(self, outputs: list[RequestOutput], step_s: float | None = None) -> None:
        """One `outputs` message per connection for this step (with its duration, when a step ran), then a fresh
        stats snapshot."""
        if step_s is not None:
            self._step_seconds_total += step_s
        batches: dict[int, tuple[Peer, list[dict]]] = {}
        for out in outputs:
            dispatch = self._dispatches.get(out.request_id)
            if dispatch is None:
                continue  # its connection was dropped
            if out.finished:
                del self._dispatches[out.request_id]
            entry = output_entry(out, dispatch.epoch)
            entry["request_id"] = dispatch.client_id
            batches.setdefault(id(dispatch.peer), (dispatch.peer, []))[1].append(entry)
        snap = self.engine.snapshot()
        cost = {}
        if step_s is not None:  # what the step read and computed (roofline accounting), for MBU / MFU
            cost = {"bytes": snap.last_bytes, "flops": snap.last_flops, "prefill_tokens": snap.last_prefill_tokens,
                    "decode_tokens": snap.last_decode_tokens}
            if snap.last_draft_tokens:  # speculative decoding: draft tokens verified this step, and accepted
                cost.update(draft_tokens=snap.last_draft_tokens, accepted_tokens=snap.last_accepted_tokens)
        for peer, entries in batches.values():
            peer.send({"type": OUTPUTS, "step": snap.num_steps, "step_s": step_s, "outputs": entries, **cost})
        self.stats = self._worker_stats(snap)

    def _worker_stats(self, snap: EngineSnapshot) -> WorkerStats:
        step_tokens = snap.last_prefill_tokens + snap.last_decode_tokens if snap.busy else 0
        return WorkerStats(running=snap.running, waiting=snap.waiting, kv_blocks_in_use=snap.kv_blocks_in_use,
                           kv_blocks_free=snap.kv_blocks_free, kv_num_blocks=snap.kv_num_blocks,
                           prefix_cache_hits=snap.prefix_cache_hits, prefix_cache_queries=snap.prefix_cache_queries,
                           num_preemptions=snap.num_preemptions, num_steps=snap.num_steps,
                           running_by_tier=list(snap.running_by_tier),
                           preemptions_by_tier=list(snap.preemptions_by_tier),
                           step_seconds_total=self._step_seconds_total, draining=self.draining,
                           step_tokens=step_tokens, lora_adapters=list(snap.lora_adapters),
                           lora_slots_used=snap.lora_slots_used, lora_loads=snap.lora_loads,
                           lora_evictions=snap.lora_evictions)

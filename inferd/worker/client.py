"""WorkerClient: the gateway's end of one worker connection, in asyncio.

Frames are parsed as bytes arrive (an asyncio.Protocol, no reader task), opened (every frame after the handshake is
sealed: inferd/worker/sealing.py; one that does not open kills the connection) and routed: `outputs` entries to the
per-request stream queue of their request, when the epoch matches the dispatch; `heartbeat` stats to latest_stats.
A watchdog declares the worker dead when nothing at all arrived for heartbeat_timeout; a closed connection or a
worker that breaks the protocol is dead at once. Death fails every open stream with WorkerDead.

The handshake, as the client checks it: the first frame is the worker's challenge, in the clear, of our protocol
version; the first sealed frame is its hello (opening it is the worker's proof that it knows the secret), of our
version too. Any other message, in any other order, or a handshake not done within WORKER_HANDSHAKE_TIMEOUT_S, ends
the connection (connect raises WorkerDead) before anything but the `auth` answer was sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from ..config import WORKER_HANDSHAKE_TIMEOUT_S
from ..engine.request import SamplingParams
from .protocol import (
    CHALLENGE,
    CLIENT_ERROR_CODES,
    DEFAULT_HEARTBEAT_TIMEOUT,
    ERROR,
    HEARTBEAT,
    HELLO,
    OUTPUTS,
    PROTOCOL_VERSION,
    REJECTED,
    WORKER_MESSAGE_TYPES,
    FrameDecoder,
    ProtocolError,
    WorkerHello,
    WorkerOutput,
    WorkerStats,
    abort_message,
    add_message,
    auth_message,
    client_proof,
    decode_message,
    encode_body,
    encode_frame,
    frame,
    new_nonce,
    ping_message,
    shutdown_message,
    valid_nonce,
)
from .sealing import Opener, Sealer, channel

UNRESPONSIVE_CLOSE_S = 60.0  # a given-up worker still silent after this long is closed for good


class WorkerClientError(RuntimeError):
    """Base of what a stream can raise."""


class WorkerUnavailable(WorkerClientError):
    """This worker cannot run the request (any more), another one can: it is draining, or its grace period ended
    while the request ran. The replay path sends it elsewhere."""


class WorkerDead(WorkerUnavailable):
    """The worker is gone (closed, killed, silent past the heartbeat timeout, or broke the protocol)."""


class RequestRejected(WorkerClientError):
    """The worker refused the request before running it (the engine's validation message)."""


class RequestFailed(WorkerClientError):
    """The worker admitted the request, then failed it (an engine step raised; or, with a code from
    protocol.CLIENT_ERROR_CODES, the request's own fault: its grammar spent its time budget)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


@dataclass
class _Stream:
    epoch: int
    queue: asyncio.Queue  # WorkerOutput, or an exception that ends the stream


class _FrameProtocol(asyncio.Protocol):
    def __init__(self, client: WorkerClient):
        self.client = client
        self.decoder = FrameDecoder()

    def connection_made(self, transport) -> None:
        self.client._transport = transport  # before any frame: the challenge is answered from data_received

    def data_received(self, data: bytes) -> None:
        self.client._last_seen = self.client._loop.time()  # any byte is a sign of life
        if self.client.unresponsive:
            self.client._recovered()
        try:
            bodies = self.decoder.feed(data)
        except ProtocolError as e:
            self.client._declare_dead(f"the worker broke the protocol: {e}")
            return
        for body in bodies:
            self.client._on_frame(body)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.client._hello.done():
            self.client._declare_dead("the worker closed the connection during the handshake (is --worker-secret "
                                      "the same on both sides?)")
        self.client._declare_dead(f"the connection to the worker was lost{f': {exc}' if exc else ''}")


class WorkerClient:
    def __init__(self, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT, close_on_silence: bool = True,
                 secret: bytes = b""):
        """close_on_silence=False (remote workers, which nobody here can kill): a worker silent past the timeout is
        given up (its streams fail with WorkerDead and are aborted there) but the connection stays open; if it
        speaks again it is usable again, and whatever it still sends for the given-up streams is dropped."""
        self.heartbeat_timeout = heartbeat_timeout
        self.close_on_silence = close_on_silence
        self._secret = secret
        self._nonces: tuple[str, str] | None = None  # (worker's, ours) once the challenge was answered
        self._sealer: Sealer | None = None  # set with the auth message: every frame after it is sealed
        self._opener: Opener | None = None
        self.unresponsive = False  # silent past the timeout, connection kept (close_on_silence=False)
        self.num_given_up = 0  # times this worker was given up for silence
        self.address: tuple[str, int] | None = None
        self.hello: WorkerHello | None = None
        self.latest_stats: WorkerStats | None = None
        self.num_heartbeats = 0
        self.num_output_messages = 0
        self.num_batched_output_messages = 0  # `outputs` messages (engine steps) that carried more than one request
        self.num_stale_outputs = 0  # entries dropped: their request is no longer streamed here, or another epoch
        self.errors: list[str] = []  # protocol errors the worker reported about what we sent
        # called with (step seconds, number of requests) for every `outputs` message of an engine step (metrics)
        # called with (step seconds, number of requests, bytes read, FLOPs) for every `outputs` message of an engine
        # step (metrics: step time, MBU, MFU)
        # (step seconds, outputs, the step's message: its bytes, flops, draft_tokens, accepted_tokens)
        self.on_step: Callable[[float, int, dict], None] | None = None
        self.on_recover: list[Callable[[], None]] = []  # called when a given-up worker speaks again
        self._streams: dict[str, _Stream] = {}
        self._dead: WorkerDead | None = None
        self._loop = asyncio.get_running_loop()
        self._last_seen = self._loop.time()
        self._hello: asyncio.Future[WorkerHello] = self._loop.create_future()
        self._closed: asyncio.Future[WorkerDead] = self._loop.create_future()  # its reason, once dead to us
        self._heartbeat = asyncio.Event()  # set and replaced at every heartbeat
        self._transport: asyncio.Transport | None = None
        self._watchdog: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, host: str, port: int, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                      close_on_silence: bool = True, secret: bytes = b"",
                      handshake_timeout: float = WORKER_HANDSHAKE_TIMEOUT_S) -> WorkerClient:
        """Connects, runs the handshake (secret: shared with the worker) and reads the worker's hello; raises
        WorkerDead when connecting takes over heartbeat_timeout, the worker is silent that long, the handshake is not
        done within handshake_timeout (however its bytes trickle in), or the worker breaks the handshake or fails
        authentication. Nothing but the `auth` answer is sent before the hello opened."""
        client = cls(heartbeat_timeout, close_on_silence, secret)
        client.address = (host, port)
        try:
            client._transport, _ = await asyncio.wait_for(
                client._loop.create_connection(lambda: _FrameProtocol(client), host, port), heartbeat_timeout)
        except (OSError, TimeoutError) as e:
            raise WorkerDead(f"cannot connect to the worker at {host}:{port}: {e!r}") from e
        client._last_seen = client._loop.time()
        client._watchdog = asyncio.create_task(client._watch())
        try:  # the watchdog ends a silent handshake sooner; death sets WorkerDead on the hello
            await asyncio.wait_for(asyncio.shield(client._hello), handshake_timeout)
        except TimeoutError:
            if not client._hello.done():
                client._declare_dead(f"the worker did not finish the handshake within {handshake_timeout:g} s")
            await client._hello
        return client

    # ---- requests -------------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       num_prompt_tokens: int | None = None, epoch: int = 0) -> AsyncGenerator[WorkerOutput, None]:
        """Yields the request's outputs step by step; the last has finished=True. Raises RequestRejected,
        RequestFailed or WorkerDead. Leaving the iteration early (break + aclose, or cancellation) aborts it."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already streaming from this worker")
        try:
            body = encode_body(add_message(request_id, epoch, prompt_token_ids, params, num_prompt_tokens))
        except (ValueError, ProtocolError) as e:  # NaN/inf parameters (not JSON), a prompt over the frame limit
            raise RequestRejected(f"the request cannot be sent to the worker: {e}") from None
        stream = self._streams[request_id] = _Stream(epoch, asyncio.Queue())
        self._write(body)
        ended = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                ended = item.finished
                yield item
                if ended:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not ended and self._dead is None:
                self._send(abort_message(request_id))

    def abort(self, request_id: str) -> None:
        """Asks the worker to stop the request; its stream then ends with finish_reason "abort"."""
        self._send(abort_message(request_id))

    @property
    def num_streams(self) -> int:
        """Requests in flight on this worker (dispatched by this client, not finished)."""
        return len(self._streams)

    # ---- health ---------------------------------------------------------------------------------------------
    @property
    def dead(self) -> WorkerDead | None:
        return self._dead

    @property
    def draining(self) -> bool:
        """The worker said it is shutting down: it takes no new request."""
        return self.latest_stats is not None and self.latest_stats.draining

    @property
    def usable(self) -> bool:
        """Can take new work now: connected, speaking, not draining."""
        return self._dead is None and not self.unresponsive and not self.draining

    @property
    def version(self) -> str | None:
        return self.hello.version if self.hello is not None else None

    async def wait_dead(self) -> WorkerDead:
        """Returns, with the reason, once the worker is dead to this client (closed, killed, silent or broken)."""
        return await asyncio.shield(self._closed)

    async def next_heartbeat(self) -> WorkerStats:
        """The stats of the next heartbeat to arrive (WorkerDead if the worker dies first)."""
        heartbeat = self._heartbeat
        await heartbeat.wait()  # the watchdog bounds this wait: death wakes it
        return self._heartbeat_stats()

    async def ping(self) -> WorkerStats:
        """The stats of a heartbeat sent after this call (the worker answers a ping with one at once)."""
        heartbeat = self._heartbeat
        self._send(ping_message())
        await heartbeat.wait()
        return self._heartbeat_stats()

    def _heartbeat_stats(self) -> WorkerStats:
        """The stats once a heartbeat waiter woke: set by that heartbeat, or the worker died (WorkerDead)."""
        self._check_alive()
        stats = self.latest_stats
        assert stats is not None  # only a heartbeat (which sets them first) or death wakes the waiters
        return stats

    async def wait_for_stats(self, predicate: Callable[[WorkerStats], bool], timeout: float) -> WorkerStats:
        """Waits for heartbeat stats that satisfy predicate; TimeoutError (with the last stats) after timeout."""
        deadline = self._loop.time() + timeout
        while True:
            self._check_alive()
            stats = self.latest_stats
            if stats is not None and predicate(stats):
                return stats
            remaining = deadline - self._loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._heartbeat.wait(), remaining)
            except TimeoutError:
                raise TimeoutError(f"no heartbeat matched within {timeout} s; last stats: {stats}") from None

    async def shutdown(self, grace_period: float = 0.0) -> None:
        """Asks the worker to stop (running requests get grace_period seconds) and waits until it closes."""
        self._send(shutdown_message(grace_period))
        await self.wait_dead()

    async def close(self) -> None:
        """Closes the connection without aborting anything: the worker aborts this connection's requests."""
        self._declare_dead("the client closed the connection", abort=False)
        if self._watchdog is not None:
            await asyncio.gather(self._watchdog, return_exceptions=True)

    async def __aenter__(self) -> WorkerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- incoming -------------------------------------------------------------------------------------------
    def _on_frame(self, body: bytes) -> None:
        if self._dead is not None:
            return
        try:
            if self._opener is None:  # before our auth: the challenge, in the clear, and nothing else
                message = decode_message(body, WORKER_MESSAGE_TYPES)
                if message["type"] != CHALLENGE:
                    raise ProtocolError(f"a {message['type']!r} message before the worker's challenge")
                self._on_challenge(message)
                return
            message = decode_message(self._open(self._opener, body), WORKER_MESSAGE_TYPES)
            kind = message["type"]
            if (self.hello is None) != (kind == HELLO) or kind == CHALLENGE:
                raise ProtocolError(f"a {kind!r} message {'before' if self.hello is None else 'after'} the worker's "
                                    "hello")
            handler = {HELLO: self._on_hello, OUTPUTS: self._on_outputs, REJECTED: self._on_rejected,
                       HEARTBEAT: self._on_heartbeat, ERROR: self._on_error}[kind]
            handler(message)
        except (ProtocolError, KeyError, TypeError, ValueError) as e:
            self._declare_dead(f"the worker sent a malformed message: {e!r}")

    def _on_challenge(self, message: dict[str, Any]) -> None:
        if message.get("protocol_version") != PROTOCOL_VERSION:
            raise ProtocolError(f"worker speaks protocol {message.get('protocol_version')!r}, this client "
                                f"{PROTOCOL_VERSION}")
        worker_nonce = message.get("nonce")
        if not valid_nonce(worker_nonce):
            raise ProtocolError("a challenge without a valid nonce")
        ours = new_nonce()
        self._nonces = (worker_nonce, ours)
        assert self._transport is not None  # connection_made set it before any byte arrived
        self._transport.write(encode_frame(auth_message(ours, client_proof(self._secret, worker_nonce, ours))))
        self._sealer, self._opener = channel(self._secret, worker_nonce, ours, worker_side=False)

    def _open(self, opener: Opener, sealed: bytes) -> bytes:
        try:
            return opener.open(sealed)
        except ProtocolError as e:
            if self.hello is None:  # the hello is the first sealed frame: the worker's proof
                unsealed = _unsealed_type(sealed)
                what = f"it sent {unsealed!r} in the clear" if unsealed else "its hello does not open"
                raise ProtocolError(f"the worker failed authentication: {what} (it does not know the shared secret, "
                                    "or the connection was tampered with)") from None
            raise ProtocolError(f"{e}: the connection was tampered with") from None

    def _on_hello(self, message: dict[str, Any]) -> None:
        hello = WorkerHello.from_wire(message)
        if hello.protocol_version != PROTOCOL_VERSION:
            raise ProtocolError(f"worker speaks protocol {hello.protocol_version}, this client {PROTOCOL_VERSION}")
        self.hello = hello
        if not self._hello.done():
            self._hello.set_result(hello)

    def _on_outputs(self, message: dict[str, Any]) -> None:
        entries = message["outputs"]
        self.num_output_messages += 1
        self.num_batched_output_messages += len(entries) > 1
        step_s = message.get("step_s")
        if self.on_step is not None and step_s is not None:
            self.on_step(step_s, len(entries), message)
        now = time.perf_counter()
        for entry in entries:
            out = WorkerOutput.from_wire(entry)
            out.received_at = now
            stream = self._stream_for(out.request_id, out.epoch)
            if stream is not None:
                stream.queue.put_nowait(out)

    def _on_rejected(self, message: dict[str, Any]) -> None:
        stream = self._stream_for(message["request_id"], message["epoch"])
        if stream is not None:
            kind = WorkerUnavailable if message.get("retry") else RequestRejected
            stream.queue.put_nowait(kind(message["error"]))

    def _on_error(self, message: dict[str, Any]) -> None:
        request_id = message.get("request_id")
        if request_id is None:
            self.errors.append(message["error"])
            return
        stream = self._stream_for(request_id, message.get("epoch"))
        if stream is not None:
            if message.get("retry"):
                stream.queue.put_nowait(WorkerUnavailable(message["error"]))
            else:  # a code the client does not know (a newer worker's) is no code: the failure is the server's
                code = message.get("code")
                stream.queue.put_nowait(RequestFailed(message["error"], code if code in CLIENT_ERROR_CODES else None))

    def _on_heartbeat(self, message: dict[str, Any]) -> None:
        self.latest_stats = WorkerStats.from_wire(message["stats"])
        self.num_heartbeats += 1
        self._wake_heartbeat_waiters()

    def _stream_for(self, request_id: str, epoch: int | None) -> _Stream | None:
        stream = self._streams.get(request_id)
        if stream is None or stream.epoch != epoch:
            self.num_stale_outputs += 1
            return None
        return stream

    def _wake_heartbeat_waiters(self) -> None:
        self._heartbeat.set()
        self._heartbeat = asyncio.Event()

    # ---- liveness -------------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        period = self.heartbeat_timeout / 10
        while self._dead is None:
            asleep = self._loop.time()
            await asyncio.sleep(period)
            if self._loop.time() - asleep > 2 * period:
                # this process's own event loop was stalled: the worker's frames of that time may wait unread in
                # the socket (a loop turn runs its due timers before it polls the sockets), so the silence may be
                # ours. Judge once they are read, a period from now: a dead worker is still found then
                continue
            silent = self._loop.time() - self._last_seen
            if silent > self.heartbeat_timeout:
                reason = f"no frame from the worker for {silent:.2f} s (heartbeat timeout {self.heartbeat_timeout} s)"
                if self.close_on_silence or silent > UNRESPONSIVE_CLOSE_S:
                    self._declare_dead(reason)
                elif not self.unresponsive:
                    self._give_up(reason)

    def _give_up(self, reason: str) -> None:
        """Silent, but the connection stays: fail (and abort there) every stream; take no work until it speaks."""
        self.unresponsive = True
        self.num_given_up += 1
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.queue.put_nowait(WorkerDead(reason))
            self._write(encode_body(abort_message(request_id)))  # read when (if) it wakes up

    def _recovered(self) -> None:
        self.unresponsive = False
        for callback in self.on_recover:
            callback()

    def _declare_dead(self, reason: str, abort: bool = True) -> None:
        if self._dead is not None:
            return
        dead = self._dead = WorkerDead(reason)
        for stream in self._streams.values():
            stream.queue.put_nowait(WorkerDead(reason))
        if not self._hello.done():
            self._hello.set_exception(WorkerDead(reason))
        if not self._closed.done():
            self._closed.set_result(dead)
        self._wake_heartbeat_waiters()
        if self._transport is not None:
            self._transport.abort() if abort else self._transport.close()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise WorkerDead(str(self._dead))

    def _send(self, message: dict[str, Any]) -> None:
        self._check_alive()
        self._write(encode_body(message))

    def _write(self, body: bytes) -> None:
        """Seals and writes at once, on the event loop: frames leave in the order of their counters."""
        # only sealed frames come here, all sent once connect returned (the hello opened): by then the connection
        # and the keys exist
        assert self._transport is not None and self._sealer is not None
        self._transport.write(frame(self._sealer.seal(body)))


def _unsealed_type(body: bytes) -> str | None:
    """The type of a frame that is a plain message where a sealed one belongs (for the error), else None."""
    try:
        return decode_message(body, WORKER_MESSAGE_TYPES)["type"]
    except ProtocolError:
        return None

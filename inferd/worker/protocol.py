"""The wire protocol between a worker and its client (the gateway): framing, message types and their fields.

A frame is a 4-byte big-endian length followed by that many bytes. During the handshake the bytes are UTF-8 JSON,
one object with a "type"; after it they are that JSON sealed (inferd/worker/sealing.py: AES-GCM under per-direction
keys derived from the secret and both nonces, the tag at the end). A length over MAX_FRAME_BYTES (sealed: the
ciphertext's) is a protocol error that ends the connection (the stream cannot be resynchronised, and the reader never
allocates more than the limit), and so is a sealed frame that does not open; a frame that opens but is not a JSON
object with a known type is answered with an `error` message and the connection carries on.

The handshake (mutual, by a shared secret that never travels): on connect the worker sends `challenge` (its nonce);
the client answers `auth` (its own nonce and HMAC-SHA256(secret, "gateway", worker nonce, client nonce)); the worker
checks it in constant time and only then derives the keys and sends `hello`, the first sealed frame: the client
opening it proves the worker knows the secret, and what it announces cannot have been changed on the way. From then
on a relay between the two (e.g. one a forged Redis registration points the gateway at) can neither read nor alter
anything: it can only cut the connection, which the gateway sees as a lost worker. A connection that fails or does
not finish the handshake in time is closed, touching nothing else. Without a secret (loopback only) both sides use
the empty key: the same exchange, no protection.

worker -> client: challenge, hello (once, after auth), outputs (one per engine step, every request's new tokens),
rejected (a request refused by validation), heartbeat (from its own thread, with a stats snapshot), error.
client -> worker: auth, add, abort, ping (answered by a heartbeat at once), shutdown.

Every `add` carries an epoch chosen by the client; the worker echoes it in every output and refusal for that
request, so that a client which gave up on a dispatch can drop whatever still arrives for it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import re
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, TypeGuard

# the limits live with every other limit, in inferd/config.py
from ..config import (  # noqa: F401
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    MAX_FRAME_BYTES,
    MAX_HELLO_STRING,
    MAX_WORKER_LORA_NAMES,
    TIERS,
)
from ..engine.errors import InvalidRequestError
from ..engine.outputs import RequestOutput, TokenLogprob
from ..engine.request import SamplingParams

# 2: hello.version, stats.draining, rejected/error "retry"; 3: the challenge-response handshake; 4: every frame after
# the handshake sealed, the hello first (it no longer carries a proof: opening it is the proof)
PROTOCOL_VERSION = 4

_LENGTH = struct.Struct(">I")
SEAL_TAG_BYTES = 16  # what sealing adds to a frame (AES-GCM's tag): the frame limit holds for the sealed frame

# worker -> client
CHALLENGE, HELLO, OUTPUTS, REJECTED = "challenge", "hello", "outputs", "rejected"
HEARTBEAT, ERROR = "heartbeat", "error"
# client -> worker
AUTH, ADD, ABORT, PING, SHUTDOWN = "auth", "add", "abort", "ping", "shutdown"
CLIENT_MESSAGE_TYPES = frozenset({ADD, ABORT, PING, SHUTDOWN})
WORKER_MESSAGE_TYPES = frozenset({CHALLENGE, HELLO, OUTPUTS, REJECTED, HEARTBEAT, ERROR})
NONCE_BYTES = 32
_NONCE_HEX = re.compile(f"[0-9a-f]{{{2 * NONCE_BYTES}}}")


# ---- the handshake --------------------------------------------------------------------------------------------
def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _proof(secret: bytes, role: str, worker_nonce: str, client_nonce: str) -> str:
    message = b"\0".join((b"inferd", role.encode(), worker_nonce.encode(), client_nonce.encode()))
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def client_proof(secret: bytes, worker_nonce: str, client_nonce: str) -> str:
    """What a gateway shows: it knows the secret (bound to this connection's two nonces). The worker shows it back
    by sealing its hello under keys only the secret derives (inferd/worker/sealing.py)."""
    return _proof(secret, "gateway", worker_nonce, client_nonce)


def proof_matches(expected: str, given: Any) -> bool:
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def valid_nonce(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and _NONCE_HEX.fullmatch(value) is not None


def challenge_message(nonce: str) -> dict[str, Any]:
    return {"type": CHALLENGE, "protocol_version": PROTOCOL_VERSION, "nonce": nonce}


def auth_message(nonce: str, proof: str) -> dict[str, Any]:
    return {"type": AUTH, "nonce": nonce, "proof": proof}


class ProtocolError(Exception):
    """A frame or message that breaks the protocol. `fatal`: the byte stream cannot be trusted any more."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


# ---- framing --------------------------------------------------------------------------------------------------
def encode_body(message: dict[str, Any]) -> bytes:
    """A message's JSON, the body of a frame (sealed or not). ProtocolError if its frame, sealed, would be over the
    limit."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(body) + SEAL_TAG_BYTES > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {message.get('type')!r} message of {len(body)} bytes is over the "
                            f"{MAX_FRAME_BYTES}-byte frame limit")
    return body


def frame(payload: bytes) -> bytes:
    """The length prefix and the payload (a body, or a sealed body)."""
    return _LENGTH.pack(len(payload)) + payload


def encode_frame(message: dict[str, Any]) -> bytes:
    """An unsealed frame: the handshake's (challenge, auth)."""
    return frame(encode_body(message))


class FrameDecoder:
    """Cuts a byte stream into frame bodies. Holds at most one partial frame, so never more than the limit."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The bodies of the frames completed by data. Raises a fatal ProtocolError on an oversize length."""
        self._buffer += data
        bodies = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > self.max_frame_bytes:
                self._buffer.clear()
                raise ProtocolError(f"frame of {length} bytes is over the {self.max_frame_bytes}-byte limit",
                                    fatal=True)
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            bodies.append(bytes(self._buffer[_LENGTH.size:end]))
            del self._buffer[:end]
        return bodies


def decode_message(body: bytes, known_types: frozenset[str]) -> dict[str, Any]:
    """One frame body -> a message dict with a known "type". Raises ProtocolError (not fatal) otherwise."""
    try:
        message = json.loads(body.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"frame body is not UTF-8 JSON: {e}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(message).__name__}")
    kind = message.get("type")
    if kind not in known_types:
        raise ProtocolError(f"unknown message type {kind!r} (expected one of {', '.join(sorted(known_types))})")
    return message


def read_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, deadline: float | None = None) -> bytes | None:
    """Blocking read of one frame body from a socket; None on a clean end of stream between frames. deadline (a
    time.monotonic() value): the whole frame must have arrived by then (TimeoutError otherwise), however slowly its
    bytes trickle in; the socket's timeout is changed to get there."""
    header = _recv_exactly(sock, _LENGTH.size, deadline)
    if header is None:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes is over the {max_bytes}-byte limit", fatal=True)
    body = _recv_exactly(sock, length, deadline)
    if body is None:
        raise ProtocolError("connection closed in the middle of a frame", fatal=True)
    return body


def _recv_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the frame did not arrive in time")
            sock.settimeout(remaining)
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            if got:
                raise ProtocolError("connection closed in the middle of a frame", fatal=True)
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ---- sampling parameters --------------------------------------------------------------------------------------
_PARAM_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}


def sampling_params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in _PARAM_FIELDS}


def sampling_params_from_dict(data: Any) -> SamplingParams:
    """The inverse of sampling_params_to_dict; missing fields take their defaults. Unknown keys and list fields
    that are not lists raise InvalidRequestError; value ranges are the engine's to check (SamplingParams.validate)."""
    if not isinstance(data, dict):
        raise InvalidRequestError(f"sampling params must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_PARAM_FIELDS))
    if unknown:
        raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    for name, item_type in (("stop", str), ("stop_token_ids", int)):
        value = data.get(name, [])
        if not isinstance(value, list) or not all(_is(v, item_type) for v in value):
            raise InvalidRequestError(f"{name} must be a list of {item_type.__name__}, got {value!r}")
    values: dict[str, Any] = {k: list(v) if isinstance(v, list) else v for k, v in data.items()}
    return SamplingParams(**values)


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


# ---- what the messages carry ----------------------------------------------------------------------------------
@dataclass
class WorkerHello:
    protocol_version: int
    worker_id: str
    pid: int
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    kv_num_blocks: int
    kv_block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    heartbeat_interval: float
    version: str = "v1"  # the model version this worker serves (rollouts route by it)
    peak_bandwidth: float = 0.0  # bytes/s of its device (calibrated or given): MBU = bytes read / time / this
    peak_flops: float = 0.0  # FLOP/s of its device in its dtype: MFU = FLOPs / time / this
    task: str = "generate"  # generate | embed (an embedding model's worker: one vector per request)
    embedding_dim: int = 0  # the vectors' size (embed workers)

    def to_wire(self) -> dict[str, Any]:
        return {"type": HELLO, **dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> WorkerHello:
        """Validated: every field of the right type and in range (a worker's announcement is not trusted);
        ProtocolError otherwise."""
        hello = cls(**{f.name: message[f.name] for f in dataclasses.fields(cls) if f.name in message})
        problem = hello._problem()
        if problem is not None:
            raise ProtocolError(f"invalid hello: {problem}")
        return hello

    def _problem(self) -> str | None:
        for name in ("protocol_version", "pid", "max_model_len", "vocab_size", "kv_num_blocks", "kv_block_size",
                     "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not _is(value, int) or value < 0 or value > 1 << 40:
                return f"{name} must be a non-negative integer, got {value!r}"
        for name in ("max_model_len", "vocab_size", "kv_block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                return f"{name} must be at least 1"
        for name in ("worker_id", "model", "version"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > MAX_HELLO_STRING:
                return f"{name} must be a string of 1 to {MAX_HELLO_STRING} characters"
        if not isinstance(self.eos_token_ids, list) or len(self.eos_token_ids) > 64 or not all(
                _is(t, int) and 0 <= t < self.vocab_size for t in self.eos_token_ids):
            return "eos_token_ids must be a list of token ids of the vocabulary"
        for name in ("heartbeat_interval", "peak_bandwidth", "peak_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                return f"{name} must be a finite number >= 0, got {value!r}"
        if not self.heartbeat_interval > 0:
            return "heartbeat_interval must be > 0"
        if self.task not in ("generate", "embed"):
            return f"task must be generate or embed, got {self.task!r}"
        if not _is(self.embedding_dim, int) or not 0 <= self.embedding_dim <= 1 << 20:
            return f"embedding_dim must be an integer in [0, 2^20], got {self.embedding_dim!r}"
        return None


@dataclass
class WorkerStats:
    """A heartbeat's snapshot of the engine, taken between steps."""
    running: int = 0
    waiting: int = 0
    kv_blocks_in_use: int = 0  # referenced by a request
    kv_blocks_free: int = 0  # free or evictable (cached, unreferenced): what can be handed out now
    kv_num_blocks: int = 0
    prefix_cache_hits: int = 0  # prompt tokens served from the prefix cache
    prefix_cache_queries: int = 0  # prompt tokens looked up
    num_preemptions: int = 0
    num_steps: int = 0
    # per tier rank (config.TIERS): running sequences, and requests preempted so far
    running_by_tier: list[int] = dataclasses.field(default_factory=lambda: [0] * len(TIERS))
    preemptions_by_tier: list[int] = dataclasses.field(default_factory=lambda: [0] * len(TIERS))
    step_seconds_total: float = 0.0  # engine steps' wall time, summed
    # tokens the engine's batch ran in its latest step (decode rows + prefill chunks); 0 when it has nothing to run
    step_tokens: int = 0
    # how long the step in progress has run when the heartbeat left: heartbeats prove the process is alive, this
    # lets a client notice an engine stuck inside one step
    step_in_progress_s: float = 0.0
    draining: bool = False  # shutting down: takes no new request, its running ones finish within the grace period
    # LoRA adapters: the names this worker holds (the router prefers it for them), slots in use, loads, evictions
    lora_adapters: list[str] = dataclasses.field(default_factory=list)
    lora_slots_used: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> WorkerStats:
        stats = cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
        for name in ("running_by_tier", "preemptions_by_tier"):  # per tier: exactly one whole number each
            value = getattr(stats, name)
            if not isinstance(value, list) or len(value) != len(TIERS) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
                setattr(stats, name, [0] * len(TIERS))
        names = stats.lora_adapters  # bounded: a worker's announcement is not trusted
        if not isinstance(names, list) or len(names) > MAX_WORKER_LORA_NAMES or not all(
                isinstance(n, str) and 0 < len(n) <= 128 for n in names):
            stats.lora_adapters = []
        for name in ("lora_slots_used", "lora_loads", "lora_evictions"):
            value = getattr(stats, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                setattr(stats, name, 0)
        return stats


@dataclass
class WorkerOutput(RequestOutput):
    """What one engine step produced for one request, as the client sees it: the engine's RequestOutput (without
    text: the worker sends token ids) and the epoch of the dispatch it answers."""
    epoch: int = 0
    received_at: float = 0.0  # time.perf_counter() when its frame arrived (the client sets it; not on the wire)

    @classmethod
    def from_wire(cls, entry: dict[str, Any]) -> WorkerOutput:
        logprobs = [_logprob_from_wire(lp) for lp in entry.get("logprobs", [])]
        prompt = entry.get("prompt_logprobs")
        return cls(prompt_logprobs=None if prompt is None else [None if lp is None else _logprob_from_wire(lp)
                                                                for lp in prompt],
                   request_id=entry["request_id"], epoch=entry["epoch"], new_token_ids=entry["new_token_ids"],
                   finished=entry["finished"], finish_reason=entry["finish_reason"],
                   stop_reason=entry["stop_reason"], num_prompt_tokens=entry["num_prompt_tokens"],
                   num_output_tokens=entry["num_output_tokens"], num_cached_tokens=entry["num_cached_tokens"],
                   logprobs=logprobs, embedding=_decode_vector(entry.get("embedding")))


def output_entry(out: RequestOutput, epoch: int) -> dict[str, Any]:
    """One engine RequestOutput as an entry of an `outputs` message."""
    entry = {"request_id": out.request_id, "epoch": epoch, "new_token_ids": out.new_token_ids,
             "finished": out.finished, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
             "num_prompt_tokens": out.num_prompt_tokens, "num_output_tokens": out.num_output_tokens,
             "num_cached_tokens": out.num_cached_tokens}
    embedding = out.embedding
    if embedding is not None:  # float32 little-endian, base64: a quarter of JSON's size
        entry["embedding"] = base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()
    if out.logprobs:
        entry["logprobs"] = [_logprob_to_wire(lp) for lp in out.logprobs]
    if out.prompt_logprobs is not None:
        entry["prompt_logprobs"] = [None if lp is None else _logprob_to_wire(lp) for lp in out.prompt_logprobs]
    return entry


def _logprob_to_wire(lp: TokenLogprob) -> dict[str, Any]:
    entry = {"token_id": lp.token_id, "logprob": _finite_logprob(lp.logprob),
             "top": [[t, _finite_logprob(v)] for t, v in lp.top]}
    if lp.rank is not None:
        entry["rank"] = lp.rank
    return entry


def _logprob_from_wire(lp: dict[str, Any]) -> TokenLogprob:
    return TokenLogprob(lp["token_id"], lp["logprob"], [tuple(t) for t in lp["top"]], lp.get("rank"))


def _decode_vector(text: str | None) -> list[float] | None:
    if text is None:
        return None
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _finite_logprob(value: float) -> float:
    """JSON has no -inf: an impossible token's logprob is sent as -9999.0, as OpenAI-compatible servers do."""
    return value if value > -9999.0 else -9999.0  # NaN compares False and becomes -9999.0 too


@dataclass
class AddRequest:
    """A parsed `add` message."""
    request_id: str
    epoch: int
    prompt_token_ids: list[int]
    num_prompt_tokens: int | None
    params: SamplingParams


def parse_add(message: dict[str, Any]) -> AddRequest:
    """Raises ProtocolError when the message names no request (nothing to refuse), InvalidRequestError when the
    request itself is malformed (refused as that request)."""
    request_id, epoch = message.get("request_id"), message.get("epoch", 0)
    if not isinstance(request_id, str) or not request_id:
        raise ProtocolError("an add message needs a non-empty string request_id")
    if not _is(epoch, int):
        raise ProtocolError(f"epoch must be an integer, got {epoch!r}")
    prompt = message.get("prompt_token_ids")
    if not isinstance(prompt, list) or not all(_is(t, int) for t in prompt):
        raise InvalidRequestError("prompt_token_ids must be a list of integers")
    num_prompt = message.get("num_prompt_tokens")
    if num_prompt is not None and not _is(num_prompt, int):
        raise InvalidRequestError(f"num_prompt_tokens must be an integer or null, got {num_prompt!r}")
    return AddRequest(request_id, epoch, prompt, num_prompt, sampling_params_from_dict(message.get("params", {})))


# ---- message constructors -------------------------------------------------------------------------------------
def add_message(request_id: str, epoch: int, prompt_token_ids: list[int], params: SamplingParams,
                num_prompt_tokens: int | None = None) -> dict[str, Any]:
    return {"type": ADD, "request_id": request_id, "epoch": epoch, "prompt_token_ids": list(prompt_token_ids),
            "num_prompt_tokens": num_prompt_tokens, "params": sampling_params_to_dict(params)}


def abort_message(request_id: str) -> dict[str, Any]:
    return {"type": ABORT, "request_id": request_id}


def ping_message() -> dict[str, Any]:
    return {"type": PING}


def shutdown_message(grace_period: float) -> dict[str, Any]:
    """Stop taking requests, give the running ones grace_period seconds to finish, abort the rest, exit."""
    return {"type": SHUTDOWN, "grace_period": grace_period}


def rejected_message(request_id: str, epoch: int, error: str, retry: bool = False) -> dict[str, Any]:
    """retry: the request itself is fine, this worker cannot take it (it is draining): send it elsewhere."""
    return {"type": REJECTED, "request_id": request_id, "epoch": epoch, "error": error, "retry": retry}


# the codes of a request's failure that are the request's own fault (a 4xx for its client); other failures are the
# server's (a 500). Optional on the wire: a client that does not know one treats the failure as the server's
CLIENT_ERROR_CODES = frozenset({"grammar_too_slow", "adapter_unavailable"})


def error_message(error: str, request_id: str | None = None, epoch: int | None = None,
                  retry: bool = False, code: str | None = None) -> dict[str, Any]:
    """A protocol error (no request_id) or the failure of one admitted request. retry: the request was stopped
    by this worker's shutdown (not by its own fault) and can be replayed on another worker. code: one of
    CLIENT_ERROR_CODES when the request itself was at fault (its grammar too slow)."""
    message = {"type": ERROR, "error": error, "request_id": request_id, "epoch": epoch, "retry": retry}
    if code is not None:
        message["code"] = code
    return message


def heartbeat_message(seq: int, monotonic_time: float, stats: WorkerStats) -> dict[str, Any]:
    return {"type": HEARTBEAT, "seq": seq, "time": monotonic_time, "stats": dataclasses.asdict(stats)}

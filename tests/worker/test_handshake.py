"""The client's side of the worker handshake (inferd/worker/client.py) against workers that are not what they claim:
an impostor that does not know the secret, a worker of another protocol version, and messages out of order. Each
worker here is a real socket server on loopback speaking the protocol's frames, playing a script; the client must
refuse it with a clear WorkerDead and send it nothing but its `auth` answer (never a request)."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from inferd.worker.client import WorkerClient, WorkerDead
from inferd.worker.protocol import (
    AUTH,
    PROTOCOL_VERSION,
    FrameDecoder,
    WorkerHello,
    WorkerStats,
    challenge_message,
    client_proof,
    heartbeat_message,
    new_nonce,
    proof_matches,
)
from inferd.worker.sealing import channel

SECRET = b"the-shared-secret"
HELLO = WorkerHello(protocol_version=PROTOCOL_VERSION, worker_id="w", pid=1, model="m", max_model_len=256,
                    vocab_size=100, eos_token_ids=[2], kv_num_blocks=10, kv_block_size=16, max_num_seqs=4,
                    max_num_batched_tokens=64, heartbeat_interval=0.5)


class Peer:
    """The worker's end of one connection: plain and sealed frames out, every frame the client sent recorded."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()
        self.frames: list[bytes] = []  # bodies, as they came (the auth in the clear; anything after it sealed)
        self._read = 0  # frames handed out by frame()
        self.nonce = new_nonce()
        self.sealer = None

    def send(self, message: dict) -> None:
        self.send_body(json.dumps(message).encode())

    def send_body(self, body: bytes) -> None:
        self.writer.write(struct.pack(">I", len(body)) + body)

    def send_sealed(self, message: dict) -> None:
        self.send_body(self.sealer.seal(json.dumps(message).encode()))

    def challenge(self, **changes) -> None:
        self.send({**challenge_message(self.nonce), **changes})

    async def frame(self) -> bytes | None:
        """The client's next frame (None: it closed the connection)."""
        while self._read == len(self.frames):
            try:
                data = await self.reader.read(1 << 16)
            except ConnectionError:  # the client aborted the connection (its unread bytes made it a reset)
                data = b""
            if not data:
                return None
            self.frames += self.decoder.feed(data)
        self._read += 1
        return self.frames[self._read - 1]

    async def auth(self, secret: bytes | None) -> dict:
        """Reads the client's auth; with `secret` (a worker that knows one), checks its proof and keys the channel
        under it."""
        auth = json.loads(await self.frame())
        assert auth["type"] == AUTH
        if secret is not None:
            assert proof_matches(client_proof(secret, self.nonce, auth["nonce"]), auth["proof"])
            self.sealer, _ = channel(secret, self.nonce, auth["nonce"], worker_side=True)
        return auth

    async def drain(self) -> None:
        """Everything the client still sends, until it closes the connection."""
        while await self.frame() is not None:
            pass


async def play(script, connect):
    """Serves one connection on loopback with `script(peer)` (then reads what the client still sends, until it closes
    it) while `connect(port)` runs; returns connect's result and the types of the messages the worker got (the auth
    in the clear; any frame after it, sealed, as "sealed": a request would show so)."""
    done = asyncio.get_running_loop().create_future()

    async def serve(reader, writer):
        peer = Peer(reader, writer)
        try:
            await script(peer)
            await peer.drain()
        finally:
            writer.close()
            done.set_result(peer.frames)

    async with await asyncio.start_server(serve, "127.0.0.1", 0) as server:
        result = await connect(server.sockets[0].getsockname()[1])
        frames = await asyncio.wait_for(done, 10)
    kinds = []
    for body in frames:
        try:
            kinds.append(json.loads(body)["type"])
        except ValueError:
            kinds.append("sealed")
    return result, kinds


def run(script, handshake_timeout: float = 5.0) -> tuple[str, list]:
    """A client (with SECRET) against a worker playing script: (its refusal, what the worker got). It must refuse."""
    async def connect(port: int) -> str:
        with pytest.raises(WorkerDead) as refused:
            client = await WorkerClient.connect("127.0.0.1", port, heartbeat_timeout=2.0, secret=SECRET,
                                                handshake_timeout=handshake_timeout)
            await client.close()  # accepted: the test fails (after closing it)
        return str(refused.value)

    return asyncio.run(play(script, connect))


# ---- an impostor: it speaks the protocol but does not know the secret -------------------------------------------
async def impostor_hello_in_the_clear(peer: Peer) -> None:
    peer.challenge()
    await peer.auth(None)
    peer.send(HELLO.to_wire())


async def impostor_sealing_with_a_guess(peer: Peer) -> None:
    peer.challenge()
    auth = await peer.auth(None)
    peer.sealer, _ = channel(b"a guess", peer.nonce, auth["nonce"], worker_side=True)
    peer.send_sealed(HELLO.to_wire())


async def impostor_sealing_without_a_secret(peer: Peer) -> None:
    peer.challenge()
    auth = await peer.auth(None)
    peer.sealer, _ = channel(b"", peer.nonce, auth["nonce"], worker_side=True)  # a loopback worker's keys
    peer.send_sealed(HELLO.to_wire())


async def impostor_replaying_the_clients_proof(peer: Peer) -> None:
    peer.challenge()
    auth = await peer.auth(None)
    peer.send_body(auth["proof"].encode())  # what it holds that is derived from the secret


@pytest.mark.parametrize("script,reason", [
    (impostor_hello_in_the_clear, "failed authentication: it sent 'hello' in the clear"),
    (impostor_sealing_with_a_guess, "failed authentication: its hello does not open"),
    (impostor_sealing_without_a_secret, "failed authentication: its hello does not open"),
    (impostor_replaying_the_clients_proof, "failed authentication: its hello does not open"),
], ids=["hello in the clear", "sealed with a guess", "sealed without a secret", "the client's proof replayed"])
def test_an_impostor_worker_is_refused_and_gets_no_request(script, reason):
    refusal, received = run(script)
    assert reason in refusal and "shared secret" in refusal
    assert received == [AUTH]


# ---- another protocol version -----------------------------------------------------------------------------------
async def challenge_of_version_3(peer: Peer) -> None:
    peer.challenge(protocol_version=3)


async def challenge_without_a_version(peer: Peer) -> None:
    peer.challenge(protocol_version=None)


async def hello_of_version_5(peer: Peer) -> None:
    """A worker that knows the secret (one of ours), of a later protocol."""
    peer.challenge()
    await peer.auth(SECRET)
    peer.send_sealed({**HELLO.to_wire(), "protocol_version": PROTOCOL_VERSION + 1})


@pytest.mark.parametrize("script,reason,received", [
    (challenge_of_version_3, f"worker speaks protocol 3, this client {PROTOCOL_VERSION}", []),
    (challenge_without_a_version, f"worker speaks protocol None, this client {PROTOCOL_VERSION}", []),
    (hello_of_version_5, f"worker speaks protocol {PROTOCOL_VERSION + 1}, this client {PROTOCOL_VERSION}", [AUTH]),
], ids=["challenge v3", "challenge without a version", "hello v5"])
def test_a_worker_of_another_protocol_version_is_refused(script, reason, received):
    refusal, got = run(script)
    assert reason in refusal
    assert got == received  # a challenge of another version is not even answered


# ---- out of order -------------------------------------------------------------------------------------------------
async def hello_before_the_challenge(peer: Peer) -> None:
    peer.send(HELLO.to_wire())
    peer.challenge()


async def heartbeat_before_the_challenge(peer: Peer) -> None:
    peer.send(heartbeat_message(0, 0.0, WorkerStats()))
    peer.challenge()


async def auth_instead_of_the_challenge(peer: Peer) -> None:
    """A proof of its own before any hello (auth is the client's message)."""
    peer.send({"type": AUTH, "nonce": peer.nonce, "proof": "0" * 64})


async def two_challenges_at_once(peer: Peer) -> None:
    peer.challenge()
    peer.challenge()


async def a_second_challenge_after_the_auth(peer: Peer) -> None:
    peer.challenge()
    await peer.auth(SECRET)
    peer.nonce = new_nonce()
    peer.challenge()


async def a_second_challenge_sealed(peer: Peer) -> None:
    peer.challenge()
    await peer.auth(SECRET)
    peer.send_sealed(challenge_message(new_nonce()))


async def heartbeat_before_the_hello(peer: Peer) -> None:
    """A worker that knows the secret, but sends a (sealed) heartbeat where its hello belongs, then its hello."""
    peer.challenge()
    await peer.auth(SECRET)
    peer.send_sealed(heartbeat_message(0, 0.0, WorkerStats()))
    peer.send_sealed(HELLO.to_wire())


async def two_hellos(peer: Peer) -> None:
    peer.challenge()
    await peer.auth(SECRET)
    peer.send_sealed(HELLO.to_wire())
    peer.send_sealed(HELLO.to_wire())


@pytest.mark.parametrize("script,reason,received", [
    (hello_before_the_challenge, "a 'hello' message before the worker's challenge", []),
    (heartbeat_before_the_challenge, "a 'heartbeat' message before the worker's challenge", []),
    (auth_instead_of_the_challenge, "unknown message type 'auth'", []),
    (two_challenges_at_once, "failed authentication: it sent 'challenge' in the clear", [AUTH]),
    (a_second_challenge_after_the_auth, "failed authentication: it sent 'challenge' in the clear", [AUTH]),
    (a_second_challenge_sealed, "a 'challenge' message before the worker's hello", [AUTH]),
    (heartbeat_before_the_hello, "a 'heartbeat' message before the worker's hello", [AUTH]),
], ids=["hello before challenge", "heartbeat before challenge", "a proof before the hello", "two challenges",
        "a second challenge after the auth", "a second challenge, sealed", "heartbeat before hello"])
def test_handshake_messages_out_of_order_are_refused(script, reason, received):
    refusal, got = run(script)
    assert reason in refusal
    assert got == received


def test_a_second_hello_ends_an_accepted_connection():
    async def connect(port: int) -> str:
        client = await WorkerClient.connect("127.0.0.1", port, heartbeat_timeout=2.0, secret=SECRET)
        return str(await asyncio.wait_for(client.wait_dead(), 10))

    reason, received = asyncio.run(play(two_hellos, connect))
    assert "a 'hello' message after the worker's hello" in reason
    assert received == [AUTH]


def test_a_hello_trickled_byte_by_byte_does_not_hold_the_client():
    """A worker that never goes silent (a byte every 50 ms keeps the heartbeat watchdog quiet) but never finishes
    its hello: the client gives up at the handshake deadline."""
    async def trickle(peer: Peer) -> None:
        peer.challenge()
        await peer.auth(None)
        hello = struct.pack(">I", 1000) + b"x" * 1000
        for i in range(len(hello)):  # until the client closes the connection
            if peer.reader.at_eof() or peer.writer.is_closing():
                return
            peer.writer.write(hello[i:i + 1])
            await asyncio.sleep(0.05)

    refusal, received = run(trickle, handshake_timeout=0.5)
    assert "did not finish the handshake within 0.5 s" in refusal
    assert received == [AUTH]

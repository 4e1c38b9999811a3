"""A relay that knows no secret, between a real WorkerClient and a real (echo) worker with a secret (tests/relay.py:
what a forged registration in an open Redis could put there). The handshake passes through it, but what follows is
sealed: it reads no prompt and no token, and a frame it alters or replays, either way, ends the connection as a
protocol error; the client never delivers an altered token."""

from __future__ import annotations

import asyncio

import pytest

from inferd.engine import SamplingParams
from inferd.worker.client import WorkerClient, WorkerDead
from relay import TO_CLIENT, TO_WORKER, Frame, Relay, flip_a_bit

pytestmark = pytest.mark.timeout(120)

SECRET = "relay-test-secret"
PROMPT = [4093, 2718, 1618, 3141, 2236, 1414]  # the echo worker answers with these, in turn


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def start(spawn_worker):
    return spawn_worker("--echo", "--heartbeat-interval", "0.1", env={"INFERD_WORKER_SECRET": SECRET})


def test_a_relay_reads_no_prompt_and_no_token(spawn_worker):
    proc = start(spawn_worker)

    async def main():
        async with await WorkerClient.connect(relay.host, relay.port, secret=SECRET.encode()) as client:
            return [out async for out in client.generate("private-request", PROMPT, greedy(2 * len(PROMPT)))]

    with Relay((proc.host, proc.port)) as relay:
        out = asyncio.run(asyncio.wait_for(main(), 60))
        seen = relay.seen()
    assert tokens(out) == PROMPT * 2  # relayed untouched, both ways
    assert len(relay.recorded[TO_WORKER]) > 8 * len(PROMPT)  # the request went through it
    compact, spaced = ",".join(map(str, PROMPT[:3])), ", ".join(map(str, PROMPT[:3]))
    for needle in (compact, spaced, "private-request", "prompt_token_ids", "new_token_ids", '"outputs"',
                   '"heartbeat"', '"hello"', "max_model_len"):
        assert needle.encode() not in seen, needle


def tamper_once(direction: str, how: str):
    """Tampers with the first frame of `direction` after the client's add (the second frame it sends)."""
    def tamper(frame: Frame) -> bytes:
        after_add = frame.relayed[TO_WORKER] >= (2 if direction == TO_CLIENT else 1)
        if frame.direction != direction or not after_add or tampered:
            return frame.payload
        tampered.append(frame.index)
        return flip_a_bit(frame.payload) if how == "flip" else frame.earlier[-1]

    tampered: list[int] = []
    return tamper


@pytest.mark.parametrize("direction,how", [(TO_CLIENT, "flip"), (TO_CLIENT, "replay"), (TO_WORKER, "flip"),
                                           (TO_WORKER, "replay")])
def test_a_relay_cannot_alter_a_stream(spawn_worker, direction, how):
    """An outputs frame (or the add itself) with a bit flipped, or replaced by the frame before it: the connection
    dies as a protocol error, the stream fails with WorkerDead, and every token delivered before was the worker's."""
    proc = start(spawn_worker)

    async def main():
        client = await WorkerClient.connect(relay.host, relay.port, secret=SECRET.encode())
        got = []
        with pytest.raises(WorkerDead) as dead:
            async for out in client.generate("tampered", PROMPT, greedy(500)):
                got.append(out)
        await client.close()
        return got, str(dead.value)

    with Relay((proc.host, proc.port), tamper_once(direction, how)) as relay:
        got, reason = asyncio.run(asyncio.wait_for(main(), 60))
    assert relay.num_tampered == 1
    delivered = tokens(got)
    assert delivered == (PROMPT * 100)[:len(delivered)] and len(delivered) < 500
    if direction == TO_CLIENT:  # the client itself found it out
        assert "integrity check" in reason and "tampered" in reason
    else:  # the worker did, and closed the connection
        assert "lost" in reason or "integrity" in reason
        assert "failed its integrity check" in proc.log()


def test_a_relay_cannot_alter_the_hello(spawn_worker):
    """What the worker announces (model, context, stop tokens) is bound to the connection: a hello with one bit
    flipped is refused as a failed authentication, and nothing is attached."""
    proc = start(spawn_worker)

    def tamper(frame: Frame) -> bytes:
        hello = frame.direction == TO_CLIENT and frame.index == 1
        return flip_a_bit(frame.payload) if hello else frame.payload

    async def main():
        with pytest.raises(WorkerDead, match="failed authentication"):
            await WorkerClient.connect(relay.host, relay.port, secret=SECRET.encode())

    with Relay((proc.host, proc.port), tamper) as relay:
        asyncio.run(asyncio.wait_for(main(), 60))
    assert relay.num_tampered == 1

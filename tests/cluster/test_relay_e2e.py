"""A relay without the secret (tests/relay.py) between `inferd gateway` and one of its two workers (echo workers on
the tiny Llama's tokenizer): it flips a bit of the first frame the worker sends after a request. The gateway finds
the connection broken (a frame that does not open), replays that worker's streams on the other one and reconnects:
every client gets exactly what an untouched run gives, never an altered token."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from cluster_util import random_prompts, wait_for
from remote_workers import start_workers

from relay import TO_CLIENT, TO_WORKER, Frame, Relay, flip_a_bit
from servers import kill_group

pytestmark = pytest.mark.timeout(240)


def test_a_tampered_stream_is_replayed_elsewhere_never_delivered(cluster, tiny_llama_dir, tmp_path):
    workers = start_workers(tmp_path, tiny_llama_dir, ["relayed", "direct"], "--echo")
    tampered: list[int] = []

    def tamper(frame: Frame) -> bytes:
        if frame.direction == TO_CLIENT and frame.relayed[TO_WORKER] >= 2 and not tampered:
            tampered.append(frame.index)
            return flip_a_bit(frame.payload)
        return frame.payload

    host, port = workers[0].address.rsplit(":", 1)
    prompts = random_prompts(8, (8, 24), seed=11)
    try:
        with Relay((host, int(port)), tamper) as relay:
            gateway = cluster("--worker", relay.address, "--worker", workers[1].address, command="gateway",
                              name="relay-gateway")

            async def complete(prompt: list[int]) -> httpx.Response:
                async with httpx.AsyncClient(timeout=60) as c:
                    return await c.post(gateway.url + "/v1/completions",
                                        json={"model": "tiny", "prompt": prompt, "max_tokens": 48})

            async def all_at_once():
                return await asyncio.gather(*(complete(p) for p in prompts))

            first = asyncio.run(all_at_once())
            assert tampered, "no request went through the relay"
            wait_for(lambda: "integrity check" in gateway.log())
            replays = gateway.metrics().get('inferd_replays_total{reason="worker_lost"}', 0)
            calm = [asyncio.run(complete(p)) for p in prompts]  # the relay tampers once: these are untouched
    finally:
        for w in workers:
            kill_group(w.proc)
    assert [r.status_code for r in first] == [200] * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in first] == [r.json()["choices"][0]["text"] for r in calm]
    assert replays >= 1  # the streams of the broken connection moved to the other worker

"""The worker process and its protocol over real processes, sockets and signals: streaming parity with the offline
engine, refusals, aborts, dropped and replaced connections, heartbeats, death detection (kill -9, SIGSTOP, a dead
parent), graceful shutdown and malformed frames."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import struct
import time

import pytest
import torch

from inferd.config import (
    MAX_HANDSHAKE_FRAME_BYTES,
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_HANDSHAKES_PER_ADDRESS,
    WORKER_HANDSHAKE_TIMEOUT_S,
    EngineConfig,
)
from inferd.engine import Engine, InvalidRequestError, SamplingParams
from inferd.models.build import load_model
from inferd.worker.client import RequestRejected, WorkerClient, WorkerDead, WorkerUnavailable
from inferd.worker.protocol import (
    ADD,
    CHALLENGE,
    ERROR,
    HEARTBEAT,
    HELLO,
    MAX_FRAME_BYTES,
    OUTPUTS,
    REJECTED,
    FrameDecoder,
    ProtocolError,
    auth_message,
    client_proof,
    decode_message,
    encode_frame,
    new_nonce,
    read_frame,
    sampling_params_from_dict,
    sampling_params_to_dict,
)
from inferd.worker.sealing import channel
from parity import greedy_divergence, scale_of, top2_gap

PROMPT_LENS = [3, 9, 17, 31, 47, 64, 90, 130]
MAX_NEW = [24, 30, 18, 28, 22, 32, 20, 26]
LONG = 800  # output tokens of a request still running when the test acts on it (prompts + 800 <= 1024)


def greedy(max_tokens: int) -> SamplingParams:
    # logprobs: the exactness rule compares the worker's numbers, not only its tokens
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The offline engine on the same model and settings as the workers, recording logits for near-tie checks."""
    model, cfg, tok = load_model(str(tiny_llama_dir), dtype=torch.float32)
    return Engine(model, cfg, EngineConfig(kv_cache_bytes=64 << 20, record_logits=True), torch.float32, tok)


@pytest.fixture(scope="module")
def prompts(reference):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, reference.model_config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def assert_same_greedy(outs, ref_req) -> None:
    """A worker's outputs equal the offline engine's request by the exactness rule (tests/parity.py): tokens, and
    the logprobs sent with them against the log-softmax of the recorded logits."""
    ours = tokens(outs)
    sent = [lp for out in outs for lp in out.logprobs]
    assert len(ours) == len(ref_req.output_token_ids) == len(sent)
    ref_logprobs = [torch.log_softmax(row.float(), dim=-1) for row in ref_req.debug_logits]

    def diff(i: int) -> float:
        row = ref_logprobs[i]
        return max([abs(sent[i].logprob - float(row[sent[i].token_id]))]
                   + [abs(value - float(row[token])) for token, value in sent[i].top])

    greedy_divergence(ours, ref_req.output_token_ids, lambda i: top2_gap(ref_req.debug_logits[i]), diff, "worker",
                      scale_at=lambda i: scale_of(ref_req.debug_logits[i]))


async def collect(client: WorkerClient, request_id: str, prompt: list[int], params: SamplingParams, **kw):
    return [out async for out in client.generate(request_id, prompt, params, **kw)]


def tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def idle(stats) -> bool:
    return stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_in_use == 0


async def first_output(stream):
    out = await asyncio.wait_for(anext(stream), 30)
    assert not out.finished
    return out


# ---- streaming ------------------------------------------------------------------------------------------------
def test_concurrent_streams_match_the_offline_engine(worker, reference, prompts):
    refs = reference.generate(prompts, [greedy(n) for n in MAX_NEW])

    async def main():
        async with await WorkerClient.connect(worker.host, worker.port) as client:
            assert client.hello.vocab_size == reference.model_config.vocab_size
            assert client.hello.max_model_len == reference.max_model_len
            runs = [collect(client, f"parity-{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, MAX_NEW))]
            return await asyncio.wait_for(asyncio.gather(*runs), 60), client.num_batched_output_messages

    streams, batched = asyncio.run(main())
    assert batched >= 1  # at least one engine step carried several requests in one message
    for outs, prompt, n, ref in zip(streams, prompts, MAX_NEW, refs):
        assert_same_greedy(outs, ref)
        last = outs[-1]
        assert last.finished and last.finish_reason == "length" and not any(o.finished for o in outs[:-1])
        assert (last.num_prompt_tokens, last.num_output_tokens) == (len(prompt), n)


def test_invalid_requests_are_rejected_without_disturbing_others(worker, reference, prompts):
    bad = [([], greedy(5)), (prompts[1], SamplingParams(max_tokens=0)), (prompts[1], SamplingParams(top_p=0.0)),
           (list(range(1, 1000)), greedy(100)), ([1, 2, reference.model_config.vocab_size], greedy(4))]
    expected = []
    for prompt, params in bad:
        with pytest.raises(InvalidRequestError) as e:
            reference.validate(prompt, params)
        expected.append(str(e.value))
    [ref] = reference.generate([prompts[2]], greedy(40))

    async def refused(client, i, prompt, params):
        with pytest.raises(RequestRejected) as e:
            await collect(client, f"bad-{i}", prompt, params, epoch=7)
        return str(e.value)

    async def main():
        async with await WorkerClient.connect(worker.host, worker.port) as client:
            good = asyncio.create_task(collect(client, "good", prompts[2], greedy(40)))
            messages = await asyncio.gather(*[refused(client, i, p, sp) for i, (p, sp) in enumerate(bad)])
            unsendable = await refused(client, "nan", prompts[1], SamplingParams(temperature=float("nan")))
            return messages, unsendable, await asyncio.wait_for(good, 30)

    messages, unsendable, good = asyncio.run(main())
    assert messages == expected
    assert "cannot be sent" in unsendable  # JSON has no NaN: refused by the client itself
    assert_same_greedy(good, ref)
    assert good[-1].finish_reason == "length"


def test_client_abort_ends_the_stream_with_abort(worker, prompts):
    async def main():
        async with await WorkerClient.connect(worker.host, worker.port) as client:
            stream = client.generate("to-abort", prompts[0], greedy(LONG))
            await first_output(stream)
            client.abort("to-abort")
            rest = [out async for out in stream]
            await client.wait_for_stats(idle, timeout=5)
            return rest

    rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert rest[-1].num_output_tokens < LONG


def test_leaving_a_stream_early_frees_its_blocks(worker, prompts):
    async def main():
        async with await WorkerClient.connect(worker.host, worker.port) as client:
            stream = client.generate("left", prompts[3], greedy(LONG))
            await first_output(stream)
            busy = await client.wait_for_stats(lambda s: s.running == 1 and s.kv_blocks_in_use > 0, timeout=5)
            await stream.aclose()  # what the API does when its HTTP client goes away
            after = await client.wait_for_stats(idle, timeout=5)
            return busy, after

    busy, after = asyncio.run(main())
    assert after.num_steps - busy.num_steps < LONG // 2  # stopped within a few steps, not run to the end
    assert after.kv_blocks_free == after.kv_num_blocks


def test_a_dropped_connection_frees_its_requests(worker, prompts):
    async def dropped():
        client = await WorkerClient.connect(worker.host, worker.port)
        streams = [client.generate(f"drop-{i}", prompts[i], greedy(LONG)) for i in range(3)]
        for s in streams:
            await first_output(s)
        await client.wait_for_stats(lambda s: s.running == 3, timeout=5)
        await client.close()  # no abort is sent
        with pytest.raises(WorkerDead):  # after the outputs that had already arrived
            await collect_rest(streams[0])

    async def next_client():
        async with await WorkerClient.connect(worker.host, worker.port) as client:
            stats = await client.wait_for_stats(idle, timeout=5)
            outs = await asyncio.wait_for(collect(client, "after-drop", prompts[0], greedy(8)), 30)
            return stats, outs

    asyncio.run(dropped())
    stats, outs = asyncio.run(next_client())
    assert stats.kv_blocks_free == stats.kv_num_blocks
    assert outs[-1].num_output_tokens == 8 and outs[-1].finish_reason == "length"


def test_two_connections_are_served_at_once_each_with_its_own_requests(worker, reference, prompts):
    """Two gateways on one worker, using the same request id: both streams complete, each equal to the offline
    engine's; one connection closing aborts only its own requests."""
    refs = reference.generate(prompts[:2], [greedy(20)] * 2)

    async def main():
        a = await WorkerClient.connect(worker.host, worker.port)
        async with await WorkerClient.connect(worker.host, worker.port) as b:
            outs = await asyncio.wait_for(asyncio.gather(collect(a, "same-id", prompts[0], greedy(20)),
                                                         collect(b, "same-id", prompts[1], greedy(20))), 60)
            long_a = a.generate("long", prompts[2], greedy(LONG))
            long_b = b.generate("long", prompts[3], greedy(60))
            await first_output(long_a)
            await a.close()  # a's requests are aborted there; b's carry on
            rest_b = await asyncio.wait_for(collect_rest(long_b), 60)
            return outs, rest_b

    (out_a, out_b), rest_b = asyncio.run(main())
    assert_same_greedy(out_a, refs[0])
    assert_same_greedy(out_b, refs[1])
    assert rest_b[-1].finished and rest_b[-1].num_output_tokens == 60


def test_the_handshake_keeps_out_what_does_not_know_the_secret(spawn_worker, prompts):
    """A worker with a secret: a port scan (connect, close), a TCP probe that sends garbage, a silent connection and
    a client with the wrong secret are each closed, without disturbing an authenticated stream."""
    secret = "s3cret-for-the-test"
    proc = spawn_worker("--heartbeat-interval", "0.1", env={"INFERD_WORKER_SECRET": secret})

    async def main():
        async with await WorkerClient.connect(proc.host, proc.port, secret=secret.encode()) as client:
            stream = client.generate("kept", prompts[0], greedy(300))
            await first_output(stream)
            socket.create_connection((proc.host, proc.port)).close()  # a port scan / tcpSocket probe
            probe = RawConnection(proc.host, proc.port, secret=None)
            probe.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert probe.receive() is None  # closed, nothing said after the challenge
            probe.close()
            wrong = RawConnection(proc.host, proc.port, secret=None)
            ours = new_nonce()
            wrong.send(auth_message(ours, client_proof(b"not the secret", wrong.challenge["nonce"], ours)))
            assert wrong.receive() is None
            wrong.close()
            with pytest.raises(WorkerDead, match="secret"):
                await WorkerClient.connect(proc.host, proc.port, secret=b"not the secret")
            with pytest.raises(WorkerDead, match="secret"):
                await WorkerClient.connect(proc.host, proc.port)  # no secret at all
            silent = RawConnection(proc.host, proc.port, secret=None)
            silent.sock.settimeout(WORKER_HANDSHAKE_TIMEOUT_S + 20)
            assert silent.receive() is None  # closed at the handshake deadline
            silent.close()
            return await asyncio.wait_for(collect_rest(stream), 60)

    rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].num_output_tokens == 300  # the authenticated stream never noticed
    assert "failed the handshake" in proc.log()


def closed_by_worker(sock: socket.socket, wait: float) -> bool:
    """After the challenge a worker says nothing to an unauthenticated connection: readable means closed."""
    if not select.select([sock], [], [], wait)[0]:
        return False
    try:
        return sock.recv(1 << 16) == b""
    except ConnectionResetError:
        return True


def test_unauthenticated_connections_cost_a_worker_bounded_memory_threads_and_time(spawn_worker):
    """Before the handshake nobody can make a worker buffer more than an auth message (a longer frame is refused at
    its length), keep a connection past the handshake deadline by trickling bytes, or hold more than
    MAX_PENDING_HANDSHAKES connections in their handshake (a flood: the oldest are closed as new ones come); an
    authenticated client is served throughout."""
    proc = spawn_worker("--echo", "--heartbeat-interval", "0.1")

    def oversize() -> None:
        raw = RawConnection(proc.host, proc.port, secret=None)
        raw.sock.sendall(struct.pack(">I", MAX_HANDSHAKE_FRAME_BYTES + 1))
        assert closed_by_worker(raw.sock, 60)
        raw.close()

    def flood() -> list[RawConnection]:
        """Three times the bound, from enough addresses that no per-address bound applies: all but the newest
        MAX_PENDING_HANDSHAKES are closed, oldest first."""
        per = MAX_PENDING_HANDSHAKES_PER_ADDRESS
        pending = [RawConnection(proc.host, proc.port, secret=None, source=f"127.0.1.{i // per}")
                   for i in range(3 * MAX_PENDING_HANDSHAKES)]
        kept = pending[-MAX_PENDING_HANDSHAKES:]
        assert all(closed_by_worker(raw.sock, 30) for raw in pending[:-MAX_PENDING_HANDSHAKES])
        assert not any(closed_by_worker(raw.sock, 0) for raw in kept)
        return pending

    def trickle() -> int:
        """Sends an auth frame's body a byte at a time; returns how many bytes went before the worker closed."""
        raw = RawConnection(proc.host, proc.port, secret=None)
        raw.sock.sendall(struct.pack(">I", MAX_HANDSHAKE_FRAME_BYTES))
        sent = 0
        try:
            while sent < MAX_HANDSHAKE_FRAME_BYTES and not closed_by_worker(raw.sock, 0.2):
                raw.sock.sendall(b" ")
                sent += 1
        except (BrokenPipeError, ConnectionResetError):
            pass
        raw.close()
        return sent

    async def main():
        async with await WorkerClient.connect(proc.host, proc.port) as client:
            await asyncio.to_thread(oversize)
            pending = await asyncio.to_thread(flood)
            out = await asyncio.wait_for(collect(client, "during-flood", [5, 6, 7], greedy(8)), 30)
            assert tokens(out) == [5, 6, 7, 5, 6, 7, 5, 6]  # the echo worker's answer
            for raw in pending:
                raw.close()
            sent = await asyncio.to_thread(trickle)
            await asyncio.wait_for(client.ping(), 30)
            return sent

    sent = asyncio.run(main())
    assert sent < MAX_HANDSHAKE_FRAME_BYTES  # closed at the handshake deadline, not when the frame was complete
    log = proc.log()
    assert f"over the {MAX_HANDSHAKE_FRAME_BYTES}-byte limit" in log
    assert "closed the oldest pending handshake" in log
    assert f"no auth message within {WORKER_HANDSHAKE_TIMEOUT_S:g} s" in log


def test_idle_connections_never_lock_a_gateway_out(spawn_worker):
    """MAX_PENDING_HANDSHAKES idle connections (renewed as they expire, they used to keep every new gateway out:
    "closed during the handshake"): a gateway with the secret still connects, in the room of the oldest, and
    generates. One address holds at most MAX_PENDING_HANDSHAKES_PER_ADDRESS of them: its newest push out its oldest,
    not the others' handshakes."""
    secret = "flood-secret"
    proc = spawn_worker("--echo", "--heartbeat-interval", "0.1", env={"INFERD_WORKER_SECRET": secret})
    per = MAX_PENDING_HANDSHAKES_PER_ADDRESS

    def idle_from(source: str, n: int) -> list[RawConnection]:
        return [RawConnection(proc.host, proc.port, secret=None, source=source) for _ in range(n)]

    def flood() -> list[RawConnection]:  # the bound exactly, `per` from each address: no one is closed yet
        return [raw for i in range(MAX_PENDING_HANDSHAKES // per) for raw in idle_from(f"127.0.0.{2 + i}", per)]

    async def generate(tag: str) -> list[int]:
        async with await WorkerClient.connect(proc.host, proc.port, secret=secret.encode()) as client:
            return tokens(await asyncio.wait_for(collect(client, tag, [5, 6, 7], greedy(5)), 30))

    async def main():
        idle = await asyncio.to_thread(flood)
        assert await generate("through-the-flood") == [5, 6, 7, 5, 6]
        assert closed_by_worker(idle[0].sock, 30)  # the oldest made room for the gateway
        assert not any(closed_by_worker(raw.sock, 0) for raw in idle[1:])
        for raw in idle:
            raw.close()
        # (any of those the worker has not seen closed yet are older than what follows: they go first)
        other = await asyncio.to_thread(idle_from, "127.0.0.199", 2)
        one = await asyncio.to_thread(idle_from, "127.0.0.200", 2 * per)  # one address, twice its share
        assert all(closed_by_worker(raw.sock, 30) for raw in one[:per])  # its own oldest made room...
        assert not any(closed_by_worker(raw.sock, 0) for raw in one[per:] + other)  # ...not another's
        assert await generate("after-one-address") == [5, 6, 7, 5, 6]
        for raw in other + one:
            raw.close()

    asyncio.run(main())
    assert "closed the oldest pending handshake" in proc.log()


async def collect_rest(stream) -> list:
    return [out async for out in stream]


def test_heartbeats_flow_while_a_long_request_runs(worker, prompts):
    async def main():
        async with await WorkerClient.connect(worker.host, worker.port) as client:
            interval = client.hello.heartbeat_interval
            before, t0 = client.num_heartbeats, time.monotonic()
            outs = await asyncio.wait_for(collect(client, "long", prompts[0], greedy(300)), 60)
            return client.num_heartbeats - before, time.monotonic() - t0, interval, outs

    beats, seconds, interval, outs = asyncio.run(main())
    assert tokens(outs) and outs[-1].num_output_tokens == 300
    assert beats >= max(2, int(0.5 * seconds / interval)), f"{beats} heartbeats in {seconds:.2f} s"


# ---- death --------------------------------------------------------------------------------------------------------
def test_kill_9_fails_the_open_stream_within_the_heartbeat_timeout(spawn_worker, prompts):
    proc = spawn_worker()

    async def main():
        async with await WorkerClient.connect(proc.host, proc.port, heartbeat_timeout=2.0) as client:
            stream = client.generate("doomed", prompts[0], greedy(LONG))
            await first_output(stream)
            os.kill(proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(WorkerDead):
                await asyncio.wait_for(collect_rest(stream), 10)
            return time.monotonic() - t0

    assert asyncio.run(main()) < 2.0 + 1.0


def test_a_long_step_never_looks_like_death_but_a_hung_worker_does(spawn_worker):
    """A prefill step made 3 s long (INFERD_FAULT slow: the step thread busy, whatever the CPU's speed): the
    heartbeat thread keeps the client's watchdog (2 s) satisfied throughout. Then SIGSTOP: no frame at all, dead
    within the timeout."""
    interval, timeout = 0.1, 2.0
    proc = spawn_worker("--heartbeat-interval", str(interval),
                        env={"INFERD_FAULT": "action=slow,phase=prefill,step=1,ms=3000"})
    prompt = torch.randint(0, 49152, (100,), generator=torch.Generator().manual_seed(5)).tolist()

    async def main():
        loop = asyncio.get_running_loop()
        async with await WorkerClient.connect(proc.host, proc.port, heartbeat_timeout=timeout) as client:
            arrivals = []
            recorder = asyncio.create_task(record_heartbeats(client, arrivals))
            try:
                t0 = loop.time()
                stream = client.generate("long-step", prompt, greedy(LONG))
                await first_output(stream)  # after the one step that ran the whole prompt
                step_seconds = loop.time() - t0
                times = [t for t, _ in arrivals]
                gaps = [b - a for a, b in zip([t0] + times, times + [loop.time()])]
                in_step = max(stats.step_in_progress_s for _, stats in arrivals)
                os.kill(proc.pid, signal.SIGSTOP)
                t_stop = loop.time()
                with pytest.raises(WorkerDead, match="no frame from the worker"):
                    await asyncio.wait_for(collect_rest(stream), 10)
                return step_seconds, max(gaps), in_step, loop.time() - t_stop, proc.proc.poll() is None
            finally:
                os.kill(proc.pid, signal.SIGKILL)
                recorder.cancel()
                await asyncio.gather(recorder, return_exceptions=True)

    step_seconds, max_gap, in_step, hung_seconds, still_there = asyncio.run(main())
    # the contract is "no gap near the 2 s timeout"; 10 intervals leaves room for a loaded CI machine
    assert step_seconds >= 3.0  # the slowed step ran (a sleep: never shorter)
    assert max_gap < 10 * interval, f"a {max_gap:.2f} s gap between heartbeats during a {step_seconds:.2f} s step"
    assert step_seconds - 1.5 < in_step <= step_seconds  # the heartbeats said how long the step had been running
    assert still_there  # stopped, not gone, when declared dead: the watchdog noticed, not a closed socket
    assert timeout - 0.5 <= hung_seconds < timeout + 2.0


def test_a_stall_of_our_own_event_loop_is_not_the_workers_silence(worker):
    """The gateway's event loop blocked for 2.5x the heartbeat timeout (as a big input parsed on it once did): the
    worker's heartbeats of that time wait unread in the socket, so it is not declared dead, and serves a request at
    once. Under uvloop (what `inferd serve` runs), whose due timers run before the sockets are polled: the watchdog
    used to wake first and count the stall as the worker's silence. A worker that is really silent is still found
    (test_a_long_step_never_looks_like_death_but_a_hung_worker_does)."""
    import uvloop

    timeout = 1.0

    async def main():
        loop = asyncio.get_running_loop()
        async with await WorkerClient.connect(worker.host, worker.port, heartbeat_timeout=timeout) as client:
            await client.next_heartbeat()
            # the stall, in an I/O callback (as an HTTP body parsed where it arrives): the sockets were polled just
            # before it, and the next loop turn runs the due timers before it polls them again
            readable, writable = os.pipe()
            stalled = loop.create_future()

            def stall() -> None:
                os.read(readable, 1)
                loop.remove_reader(readable)
                time.sleep(2.5 * timeout)  # nothing runs on this loop meanwhile
                stalled.set_result(None)

            loop.add_reader(readable, stall)
            os.write(writable, b"x")
            await stalled
            os.close(readable)
            os.close(writable)
            await asyncio.sleep(timeout / 2)  # the watchdog has woken (late) by now
            alive = client.dead is None
            outs = await asyncio.wait_for(collect(client, "after-stall", [1, 2, 3], greedy(3)), 30)
            return alive, outs

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        alive, outs = runner.run(main())
    assert alive, "the worker was declared dead for the gateway's own stall"
    assert outs[-1].finished and outs[-1].num_output_tokens == 3


async def record_heartbeats(client: WorkerClient, arrivals: list) -> None:
    """Appends (arrival time, stats) for every heartbeat, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        stats = await client.next_heartbeat()
        arrivals.append((loop.time(), stats))


def test_the_worker_exits_gracefully_when_its_parent_dies(spawn_worker, prompts):
    proc = spawn_worker("--die-with-parent", "--shutdown-grace", "0", via_parent=True)

    async def main():
        async with await WorkerClient.connect(proc.host, proc.port) as client:
            stream = client.generate("orphan", prompts[0], greedy(LONG))
            await first_output(stream)
            proc.proc.kill()  # SIGKILL to the parent: the kernel sends the worker SIGTERM
            with pytest.raises(WorkerUnavailable, match="shut down") as handed_back:
                await asyncio.wait_for(collect_rest(stream), 10)
            return handed_back.value, await asyncio.wait_for(client.wait_dead(), 10)

    handed_back, dead = asyncio.run(main())
    # SIGTERM is a drain: with no grace left, the running request is handed back (retryable), not silently cut
    assert not isinstance(handed_back, WorkerDead)
    assert "lost" in str(dead)
    assert proc.wait_gone(timeout=10)
    assert "stopped" in proc.log()


def test_shutdown_finishes_running_requests_and_exits_0(spawn_worker, prompts):
    proc = spawn_worker()

    async def main():
        client = await WorkerClient.connect(proc.host, proc.port)
        stream = client.generate("last", prompts[0], greedy(100))
        first = await first_output(stream)
        shutdown = asyncio.create_task(client.shutdown(grace_period=30))
        await asyncio.sleep(0)  # the shutdown frame goes out before the next add
        with pytest.raises(WorkerUnavailable, match="shutting down"):  # retryable: the gateway sends it elsewhere
            await collect(client, "too-late", prompts[1], greedy(5))
        assert (await client.ping()).draining  # and the heartbeats say so
        rest = await asyncio.wait_for(collect_rest(stream), 30)
        await asyncio.wait_for(shutdown, 10)
        return [first] + rest

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 100
    assert proc.proc.wait(timeout=10) == 0


# ---- malformed input ----------------------------------------------------------------------------------------------
class RawConnection:
    """A bare socket speaking frames, to send what a well-behaved client never would."""

    def __init__(self, host: str, port: int, secret: bytes | None = b"", source: str | None = None):
        """secret: run the handshake with it (None: none, the connection stays at the worker's challenge).
        source: the local address to connect from (another loopback address: another peer to the worker)."""
        self.sock = socket.create_connection((host, port), timeout=10,
                                             source_address=None if source is None else (source, 0))
        self.skipped: list[dict] = []  # messages receive_until passed over (outputs that arrived in between)
        self.sealer = self.opener = None  # after the handshake every frame is sealed, both ways
        self.challenge = self.receive()
        assert self.challenge["type"] == CHALLENGE
        if secret is not None:
            ours = new_nonce()
            self.send(auth_message(ours, client_proof(secret, self.challenge["nonce"], ours)))
            self.sealer, self.opener = channel(secret, self.challenge["nonce"], ours, worker_side=False)
            hello = self.receive()
            assert hello["type"] == HELLO

    def send(self, message) -> None:
        self.send_body(json.dumps(message).encode())

    def send_body(self, body: bytes) -> None:
        sealed = body if self.sealer is None else self.sealer.seal(body)
        self.sock.sendall(struct.pack(">I", len(sealed)) + sealed)

    def receive(self) -> dict | None:
        body = read_frame(self.sock)
        if body is not None and self.opener is not None:
            body = self.opener.open(body)
        return None if body is None else json.loads(body)

    def receive_until(self, kind: str) -> dict:
        """The next message of this kind; a message of another kind is kept in `skipped`, or handed out first
        when it is of the kind asked for."""
        for i, message in enumerate(self.skipped):
            if message["type"] == kind:
                return self.skipped.pop(i)
        while True:
            message = self.receive()
            assert message is not None, f"connection closed while waiting for {kind!r}"
            if message["type"] == kind:
                return message
            if message["type"] != HEARTBEAT:
                self.skipped.append(message)

    def errors_until_closed(self) -> list[str]:
        """The errors received until the worker closed the connection (heartbeats aside)."""
        errors = []
        try:
            while (message := self.receive()) is not None:
                if message["type"] == ERROR:
                    errors.append(message["error"])
                else:
                    assert message["type"] == HEARTBEAT, message
        except ConnectionResetError:  # closed with our unread bytes in its buffer: the kernel resets
            pass
        return errors

    def close(self) -> None:
        self.sock.close()


def test_malformed_frames_get_errors_and_the_worker_keeps_serving(worker, reference, prompts):
    raw = RawConnection(worker.host, worker.port)
    params = sampling_params_to_dict(greedy(200))
    raw.send({"type": ADD, "request_id": "raw-ok", "epoch": 3, "prompt_token_ids": prompts[0], "params": params})
    for body, match in [(b"{not json", "JSON"), (b"\xff\xfe", "JSON"), (b"[1, 2]", "object"),
                        (b'{"type": "bogus"}', "unknown message type"), (b'{"type": "add"}', "request_id")]:
        raw.send_body(body)
        assert match in raw.receive_until(ERROR)["error"]
    raw.send({"type": ADD, "request_id": "raw-typo", "epoch": 1, "prompt_token_ids": [1, 2],
              "params": {"temprature": 0}})
    rejected = raw.receive_until(REJECTED)
    assert rejected["request_id"] == "raw-typo" and "temprature" in rejected["error"]
    got = []  # the good request was not lost among the bad frames
    while not (got and got[-1]["finished"]):
        got += [e for e in raw.receive_until(OUTPUTS)["outputs"] if e["request_id"] == "raw-ok"]
    assert sum(len(e["new_token_ids"]) for e in got) == 200 and {e["epoch"] for e in got} == {3}
    raw.sock.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))  # never allocated: an error, then the end
    assert any("limit" in e for e in raw.errors_until_closed())
    raw.close()

    garbage = RawConnection(worker.host, worker.port)
    garbage.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # "GET " read as a length is over the limit
    assert all("limit" in e for e in garbage.errors_until_closed())  # an error, or a reset before we read it
    garbage.close()
    half = RawConnection(worker.host, worker.port)
    half.sock.sendall(struct.pack(">I", 100) + b"{")  # gone in the middle of a frame
    half.close()

    async def still_serving():
        async with await WorkerClient.connect(worker.host, worker.port) as client:
            await client.wait_for_stats(idle, timeout=5)
            return await asyncio.wait_for(collect(client, "after-garbage", prompts[4], greedy(6)), 30)

    assert asyncio.run(still_serving())[-1].num_output_tokens == 6
    assert worker.proc.poll() is None


# ---- protocol units -----------------------------------------------------------------------------------------------
def test_sampling_params_round_trip_and_unknown_keys():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=123, stop=["\n\n"],
                            stop_token_ids=[5, 6], ignore_eos=True, logprobs=2, priority=1, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.1, min_tokens=2)
    wire = json.loads(json.dumps(sampling_params_to_dict(params)))
    assert sampling_params_from_dict(wire) == params
    assert sampling_params_from_dict({}) == SamplingParams()
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter.*temprature"):
        sampling_params_from_dict({"temprature": 0.0})
    with pytest.raises(InvalidRequestError, match="stop must be a list"):
        sampling_params_from_dict({"stop": "\n"})
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        sampling_params_from_dict({"stop_token_ids": [True]})


def test_frames_split_anywhere_decode_the_same():
    messages = [{"type": OUTPUTS, "outputs": [{"n": i, "text": "é" * i}]} for i in range(5)]
    stream = b"".join(encode_frame(m) for m in messages)
    for chunk in (1, 3, 7, len(stream)):
        decoder = FrameDecoder()
        bodies = [b for i in range(0, len(stream), chunk) for b in decoder.feed(stream[i:i + chunk])]
        assert [decode_message(b, frozenset({OUTPUTS})) for b in bodies] == messages
    with pytest.raises(ProtocolError) as e:
        FrameDecoder(max_frame_bytes=10).feed(struct.pack(">I", 11))
    assert e.value.fatal
    with pytest.raises(ProtocolError, match="over the"):
        encode_frame({"type": OUTPUTS, "blob": "x" * MAX_FRAME_BYTES})


def test_a_worker_hello_is_validated_field_by_field():
    from inferd.gateway.router import Router
    from inferd.worker.protocol import PROTOCOL_VERSION, WorkerHello

    good = dict(protocol_version=PROTOCOL_VERSION, worker_id="w", pid=1, model="m", max_model_len=256,
                vocab_size=100, eos_token_ids=[2], kv_num_blocks=10, kv_block_size=16, max_num_seqs=4,
                max_num_batched_tokens=64, heartbeat_interval=0.5, version="v1")
    assert WorkerHello.from_wire(good).worker_id == "w"
    for field, bad in [("max_model_len", -1), ("max_model_len", "256"), ("vocab_size", 0), ("pid", True),
                       ("worker_id", ""), ("worker_id", "x" * 300), ("model", 5), ("eos_token_ids", [100]),
                       ("eos_token_ids", "2"), ("heartbeat_interval", 0), ("heartbeat_interval", float("inf")),
                       ("peak_flops", -1.0), ("max_num_seqs", 1 << 50)]:
        with pytest.raises(ProtocolError, match="invalid hello"):
            WorkerHello.from_wire({**good, field: bad})
    # a worker of another vocabulary (or stop tokens) is not attached beside the ones there
    router = Router()
    assert router.incompatibility(WorkerHello.from_wire(good)) is None

    class Attached:
        hello = WorkerHello.from_wire(good)

    router.workers.append(Attached())
    assert router.incompatibility(WorkerHello.from_wire({**good, "worker_id": "w2"})) is None
    assert "vocabulary" in router.incompatibility(WorkerHello.from_wire({**good, "vocab_size": 200}))
    assert "end-of-sequence" in router.incompatibility(WorkerHello.from_wire({**good, "eos_token_ids": [3]}))


def test_a_worker_listening_beyond_loopback_needs_a_secret(tiny_llama_dir, tmp_path):
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    base = [sys.executable, "-m", "inferd", "worker", "--echo", "--model", str(tiny_llama_dir)]
    empty = tmp_path / "secret"
    empty.write_text("\n")
    with ThreadPoolExecutor(2) as pool:  # side by side: each run is a second of imports on one core
        no_secret = pool.submit(subprocess.run, [*base, "--listen", "0.0.0.0:0"], capture_output=True, text=True,
                                timeout=120, env={k: v for k, v in os.environ.items() if k != "INFERD_WORKER_SECRET"})
        empty_secret = pool.submit(subprocess.run, [*base, "--listen", "0.0.0.0:0", "--worker-secret-file", str(empty)],
                                   capture_output=True, text=True, timeout=120)
    out = no_secret.result()
    assert out.returncode == 2 and "without a worker secret" in out.stderr
    out = empty_secret.result()
    assert out.returncode == 2 and "is empty" in out.stderr

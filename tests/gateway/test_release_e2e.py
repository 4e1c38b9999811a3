"""No path leaks what an admitted request holds (docs/architecture.md, "Who releases what"): a client that
disconnects mid-stream (n=2, a list of prompts), one that disconnects while its stream still waits in the queue (the
keep-alive phase), and one that never reads. Afterwards the gateway's open requests, the workers' room, the tenant's
reserved tokens and concurrency leases (in-process, or in Redis) are back where they started, so are the worker's
running and waiting requests and KV blocks in use (its heartbeats), the worker stopped stepping for a dropped request
long before its max_tokens (it aborted it, it did not run it out), and a request is served at once.

The server: echo workers slowed to 20 ms a step (INFERD_FAULT slow), 2 batch slots + 1 queued request per worker
(the issue's reproduction: three dropped streams used to wedge it for good). The n=2 drop runs once more on the tiny
model, where the engine's own KV blocks are taken and given back (the echo worker only counts them)."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import httpx
import pytest
from gw import bearer, make_keys

TENANT = "t"
STEP_MS = 20
LONG = 400  # max_tokens of a dropped stream: 8 s at STEP_MS, were it run out


def _start(request, backend: str, tmp_path_factory, tiny_llama_dir, extra: list[str], env: dict[str, str],
           echo: bool = True):
    from servers import kill_group, start_server

    folder = tmp_path_factory.mktemp(f"release-{backend}")
    keys = make_keys(folder / "keys.json", {TENANT: {"max_concurrency": 16, "tpm": 100_000_000}})
    extra = [*(["--echo"] if echo else []), "--heartbeat-interval", "0.1", "--sse-write-timeout", "2", "--keys",
             str(folder / "keys.json"), "--metrics-key", "release-metrics-key", *extra]
    redis = None
    if backend == "redis":
        import redis as redis_lib

        url = request.getfixturevalue("redis_url")
        extra += ["--redis", url]
        redis = redis_lib.Redis.from_url(url)
    srv = start_server(tiny_llama_dir, folder / "serve.log", *extra, model_name="tiny", env=env)
    srv.key = keys[TENANT]
    srv.redis = redis
    yield srv
    kill_group(srv.proc)
    if redis is not None:
        redis.close()


SLOW = ["--max-num-seqs", "2", "--worker-queue-depth", "1", "--sse-keepalive", "0.2"]


@pytest.fixture(scope="module", params=["memory", "redis"])
def server(request, tmp_path_factory, tiny_llama_dir):
    """Echo workers at 20 ms a step: 2 batch slots + 1 queued request (a worker's room is 3 sequences)."""
    yield from _start(request, request.param, tmp_path_factory, tiny_llama_dir, ["--max-model-len", "2048", *SLOW],
                      {"INFERD_FAULT": f"action=slow,times=0,ms={STEP_MS}"})


@pytest.fixture(scope="module")
def model_server(request, tmp_path_factory, tiny_llama_dir):
    """The same on the tiny model's engine (the session's tiny_server steps too fast to drop a stream mid-way on a
    loaded machine, and has no keys): its scheduler takes and frees real KV blocks."""
    yield from _start(request, "tiny-model", tmp_path_factory, tiny_llama_dir, ["--max-model-len", "1024", *SLOW],
                      {"INFERD_FAULT": f"action=slow,times=0,ms={STEP_MS}"}, echo=False)


@pytest.fixture(scope="module", params=["memory", "redis"])
def fast_server(request, tmp_path_factory, tiny_llama_dir):
    """Echo workers at full speed (microseconds a step): a stream of megabytes in a second or two."""
    yield from _start(request, request.param, tmp_path_factory, tiny_llama_dir, ["--max-model-len", "4096"], {})


def _held(server) -> dict[str, float]:
    """What admitted requests hold, from /metrics (and Redis' lease set where Redis keeps the limits): the gateway's
    gauges, and the worker's as of its latest heartbeat (-1 while it has sent none); "steps": the worker's engine
    steps so far."""
    m = server.metrics()
    model = f'{{model="{server.model}"}}'
    held = {"open": m.get("inferd_gateway_open_requests", -1),
            "room": m.get("inferd_gateway_in_flight_sequences", -1),
            "settling": m.get("inferd_gateway_settlements_pending", -1),
            "tenant_open": m.get(f'inferd_tenant_open_requests{{tenant="{TENANT}"}}', 0),
            "reserved": m.get(f'inferd_tenant_reserved_tokens{{tenant="{TENANT}"}}', 0),
            "leases": m.get(f'inferd_tenant_concurrency_leases{{tenant="{TENANT}"}}', 0),
            "running": m.get(f"inferd_num_requests_running{model}", -1),
            "waiting": m.get(f"inferd_num_requests_waiting{model}", -1),
            "kv_in_use": m.get(f"inferd_kv_blocks_in_use{model}", -1),
            "steps": m.get(f"inferd_engine_steps_total{model}", -1)}
    if server.redis is not None:
        held["leases"] = server.redis.zcard(f"inferd:{{{TENANT}}}:leases")
    return held


IDLE = {"open": 0, "room": 0, "settling": 0, "tenant_open": 0, "reserved": 0, "leases": 0, "running": 0, "waiting": 0,
        "kv_in_use": 0}


def _wait_held(server, expected: dict, timeout: float = 30.0) -> dict:
    box = {}

    def matches(_m) -> bool:
        box["held"] = _held(server)
        return all(box["held"][k] == v for k, v in expected.items())

    try:
        server.wait_metrics(matches, timeout=timeout)
    except AssertionError:  # what was held, not the whole of /metrics
        raise AssertionError(f"never {expected} within {timeout} s; last held {box['held']}") from None
    return box["held"]


def _served_at_once(server) -> None:
    """A small request gets a worker within 2 s of queueing (a leaked room makes it wait its whole deadline: 503)."""
    r = httpx.post(server.url + "/v1/completions", headers={**bearer(server.key), "x-inferd-queue-timeout": "2"},
                   json={"model": server.model, "prompt": "hello there", "max_tokens": 8, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def _body(server, **extra) -> dict:
    return {"model": server.model, "prompt": "one two three four five six", "max_tokens": LONG, "stream": True,
            **extra}


def _drop_after(server, body: dict, lines: int, want: str = "data: {", before_drop=None) -> None:
    """Opens a stream, reads `lines` lines starting with `want`, calls before_drop(), drops the connection."""
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body, headers=bearer(server.key)) as r:
            assert r.status_code == 200, r.read()
            got, stream = 0, r.iter_lines()  # held: a dropped iterator would close the connection at the break
            for line in stream:
                got += line.startswith(want)
                if got == lines:
                    break
            assert got == lines
            if before_drop is not None:
                before_drop()
    # leaving the blocks closes the connection mid-stream


def _released(server, steps_before: float, max_tokens: int) -> None:
    """Nothing held, by the gateway or the worker, and the worker stepped less than half a dropped request's
    max_tokens since steps_before (read before the drops): it aborted them (one run out steps max_tokens)."""
    assert steps_before >= 0
    held = _wait_held(server, IDLE)
    assert held["steps"] - steps_before < max_tokens // 2, (held["steps"], steps_before, max_tokens)


def test_disconnects_mid_stream_with_n_2_release_everything(server):
    steps = _wait_held(server, IDLE)["steps"]
    for _ in range(3):  # the reproduction: three of these wedged the server
        _drop_after(server, _body(server, n=2), 4)
    _released(server, steps, LONG)
    _served_at_once(server)
    _wait_held(server, IDLE)


def test_a_disconnect_mid_stream_with_n_2_frees_the_engines_kv_blocks(model_server):
    """The n=2 drop on the tiny model: both choices run and hold KV blocks when the client leaves; then the engine's
    blocks in use are 0 again."""
    server = model_server
    steps = _wait_held(server, IDLE)["steps"]
    busy = {}
    _drop_after(server, _body(server, n=2, ignore_eos=True), 4,
                before_drop=lambda: busy.update(_wait_held(server, {"running": 2, "room": 2})))
    assert busy["kv_in_use"] > 0, busy
    _released(server, steps, LONG)
    _served_at_once(server)
    _wait_held(server, IDLE)


def test_disconnects_mid_stream_with_a_list_of_prompts_release_everything(server):
    steps = _wait_held(server, IDLE)["steps"]
    for _ in range(3):
        _drop_after(server, _body(server, prompt=["a b c d", "e f g h i j"]), 4)
    _released(server, steps, LONG)
    _served_at_once(server)


def test_a_disconnect_while_waiting_in_the_line_releases_it(server):
    """A stream that waits for a worker (the worker's 3 places are taken) sends keep-alive comments; its client
    leaves then. Only the blocker is left holding anything; once it ends, nothing is."""
    _wait_held(server, IDLE)
    with httpx.Client(timeout=60) as blocker_client:
        # 3 sequences: both batch slots and the queued place of the only worker (1,000 steps: 20 s, were it run out)
        with blocker_client.stream("POST", server.url + "/v1/completions", json=_body(server, n=3, max_tokens=1000),
                                   headers=bearer(server.key)) as blocker:
            assert blocker.status_code == 200
            _wait_held(server, {"open": 1, "room": 3})
            _drop_after(server, _body(server), 1, want=": keep-alive")
            held = _wait_held(server, {"open": 1, "room": 3, "running": 2, "waiting": 1})
            assert held["tenant_open"] == 1
    _released(server, held["steps"], 1000)  # the blocker's client left too
    _served_at_once(server)


def test_a_client_that_never_reads_does_not_hold_its_request(fast_server, smollm2_tokenizer):
    """The request is released when the worker's last output arrives, not when the client has read it; the stream's
    connection is closed after --sse-write-timeout (2 s here) of writes that cannot complete."""
    server = fast_server
    _wait_held(server, IDLE)
    url = urlparse(server.url)
    # n=16 x 2,000 tokens of the vocabulary's longest token: ~10 MB of SSE, far over what a 4 KiB receive window and
    # the socket buffers (4 MiB at most here) hold, so the server's writes block
    vocab = smollm2_tokenizer.hf.get_vocab()
    longest = vocab[max(vocab, key=len)]
    body = json.dumps(_body(server, prompt=[longest] * 4, n=16, max_tokens=2000)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.key}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    before = server.metrics()
    timeouts_before = before.get("inferd_sse_write_timeouts_total", 0)
    finished = 'inferd_request_finished_total{finish_reason="length"}'
    try:
        sock.connect((url.hostname, url.port))
        sock.sendall(head + body)
        # all 16 choices reach their max_tokens in the worker (the client has read almost nothing)
        server.wait_metrics(lambda m: m.get(finished, 0) == before.get(finished, 0) + 16)
        # the worker finishes all 2,000 steps while the client reads nothing: everything comes back
        _wait_held(server, IDLE, timeout=60)
        _served_at_once(server)
        server.wait_metrics(lambda m: m.get("inferd_sse_write_timeouts_total", 0) == timeouts_before + 1)
        sock.settimeout(30)
        received = b""
        while True:  # the server dropped the connection: what is left in the buffers, then EOF (or a reset)
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        assert not received.endswith(b"data: [DONE]\n\n")  # cut off, not completed
    finally:
        sock.close()
    _wait_held(server, IDLE)

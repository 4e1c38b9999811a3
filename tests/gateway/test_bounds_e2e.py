"""Bounded cost per request and per tenant (issue 13, part 3), against a real server on echo workers slowed to
20 ms a step: one tenant cannot fill the queue, room is counted per sequence, a prompt too long to ever fit is
refused before it is tokenized (and a long one is tokenized off the event loop), /tokenize counts against the
tenant's request rate, a request refused with 503 before it reached a worker (queue timeout, full line) gives its
request back to the tenant's rate, and the HTTP limits (head deadline, head size, connection count) hold. The rate
window is 600 s, so a request-rate bucket refills by less than one request during the module."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
from gw import bearer, make_keys
from starlette.requests import Request

STEP_MS = 20
WINDOW = 600.0


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    from servers import kill_group, start_server

    folder = tmp_path_factory.mktemp("bounds")
    keys = make_keys(folder / "keys.json", {"a": {}, "b": {}, "slow": {"rpm": 3}, "shed": {"rpm": 2}})
    srv = start_server(tiny_llama_dir, folder / "serve.log", "--echo", "--max-model-len", "256",
                       "--heartbeat-interval", "0.1", "--keys", str(folder / "keys.json"), "--max-num-seqs", "2",
                       "--worker-queue-depth", "1", "--max-queue-requests", "4", "--tenant-queue-share", "0.5",
                       "--http-head-timeout", "1", "--rate-window", str(WINDOW), model_name="tiny",
                       env={"INFERD_FAULT": f"action=slow,times=0,ms={STEP_MS}"})
    srv.keys = keys
    yield srv
    kill_group(srv.proc)


def _post(server, tenant: str, path: str = "/v1/completions", headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(server.url + path, headers={**bearer(server.keys[tenant]), **(headers or {})}, timeout=120,
                      json={"model": server.model, **body})


def _idle(server) -> None:
    server.wait_metrics(lambda m: m.get("inferd_gateway_open_requests") == 0)


def test_one_tenant_cannot_fill_the_waiting_line(server):
    """The line holds 4 requests; tenant a may hold half. With the worker full, a's third waiting request is refused
    with 429 queue_share_exceeded while b still gets a place."""
    _idle(server)
    with ThreadPoolExecutor(8) as pool:
        blocker = pool.submit(_post, server, "a", prompt="x y z", max_tokens=150, n=3)  # the worker's 3 places
        server.wait_metrics(lambda m: m.get("inferd_gateway_in_flight_sequences") == 3)
        waiting = [pool.submit(_post, server, "a", prompt="w", max_tokens=4) for _ in range(2)]
        server.wait_metrics(lambda m: m.get('inferd_queue_requests{tier="standard"}') == 2)
        refused = _post(server, "a", prompt="w", max_tokens=4)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "queue_share_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
        other = pool.submit(_post, server, "b", prompt="w", max_tokens=4)
        for f in [blocker, *waiting, other]:
            assert f.result().status_code == 200
    _idle(server)


def test_room_is_counted_per_sequence(server):
    """A request with n=3 takes all 3 places of the worker: the next request waits in the queue until it ends."""
    _idle(server)
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(_post, server, "a", prompt="x y z", max_tokens=100, n=3)
        server.wait_metrics(lambda m: m.get("inferd_gateway_in_flight_sequences") == 3)
        small = pool.submit(_post, server, "b", prompt="w", max_tokens=2)
        server.wait_metrics(lambda m: m.get('inferd_queue_requests{tier="standard"}') == 1)
        assert big.result().status_code == 200
        r = small.result()
        assert r.status_code == 200
        assert int(r.headers["x-inferd-dispatch-seq"]) > int(big.result().headers["x-inferd-dispatch-seq"])
    _idle(server)


def test_a_prompt_that_can_never_fit_is_refused_before_tokenizing(server, smollm2_tokenizer):
    vocab = smollm2_tokenizer.hf.get_vocab()
    longest = max(len(t) for t in vocab)
    too_long = "a" * (256 * longest + 1)  # more characters than 256 tokens of the longest token hold
    r = _post(server, "a", prompt=too_long, max_tokens=1)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]
    # long, but tokenized (off the event loop): the model's own context check answers
    r = _post(server, "a", prompt="hello " * 1000, max_tokens=1)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "tokens" in r.json()["error"]["message"]
    r = _post(server, "a", prompt="hi " * 700 + "end", max_tokens=1)  # 2.8k characters, under 256 tokens
    assert r.status_code in (200, 400), r.text


def test_a_request_refused_with_503_gets_its_request_back(server):
    """Tenant `shed` (2 requests per window) is refused twice with 503 before any work, once at its queue deadline
    (it waited in the queue, the worker full) and once at once (the queue full). Neither counts against its rate: it
    then gets its 2 requests (200s, 1 then 0 remaining), and only a third one is 429."""
    _idle(server)
    with ThreadPoolExecutor(8) as pool:
        blocker = pool.submit(_post, server, "a", prompt="x y z", max_tokens=150, n=3)  # the worker's 3 places, >= 3 s
        server.wait_metrics(lambda m: m.get("inferd_gateway_in_flight_sequences") == 3)
        # a deadline the estimate admits (a few tokens at the drain rate) but the blocker outlasts
        timed_out = _post(server, "shed", prompt="w", max_tokens=4, headers={"x-inferd-queue-timeout": "0.5"})
        assert timed_out.status_code == 503, timed_out.text
        assert timed_out.json()["error"]["code"] == "queue_timeout"
        waiting = [pool.submit(_post, server, tenant, prompt="w", max_tokens=4) for tenant in ("a", "a", "b", "b")]
        server.wait_metrics(lambda m: m.get('inferd_queue_requests{tier="standard"}') == 4)  # the line is full
        shed = _post(server, "shed", prompt="w", max_tokens=4)
        assert shed.status_code == 503, shed.text
        assert shed.json()["error"]["code"] == "overloaded"
        for f in [blocker, *waiting]:
            assert f.result().status_code == 200
    _idle(server)
    first = _post(server, "shed", prompt="w", max_tokens=1)
    assert first.status_code == 200, f"the 503s were counted against the rate: {first.text}"
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    second = _post(server, "shed", prompt="w", max_tokens=1)
    assert second.status_code == 200, second.text
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    third = _post(server, "shed", prompt="w", max_tokens=1)
    assert third.status_code == 429 and "requests" in third.json()["error"]["message"], third.text


def test_tokenize_counts_against_the_request_rate(server):
    codes = [_post(server, "slow", "/tokenize", prompt="hello").status_code for _ in range(4)]
    assert codes[:3] == [200, 200, 200]
    assert codes[3] == 429


def test_a_silent_connection_is_closed_at_the_head_deadline(server):
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.settimeout(30)
        start = time.monotonic()
        assert sock.recv(100) == b""  # closed by the server (--http-head-timeout 1), nothing answered
        assert time.monotonic() - start < 25
    with socket.create_connection((url.hostname, url.port)) as sock:  # a head sent a byte at a time
        sock.settimeout(30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(50):
            try:
                sock.sendall(b"X")
            except OSError:
                break
            data = sock.recv(100) if _readable(sock) else None
            if data == b"":
                break
            time.sleep(0.1)
        else:
            pytest.fail("the server kept a connection whose head never ended")


def _readable(sock) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def test_a_head_over_the_size_limit_gets_431(server):
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.settimeout(30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 431"), data[:100]
    assert b"request_header_fields_too_large" in data
    assert httpx.get(server.url + "/health").status_code == 200  # and the server is fine


def test_the_queue_timeout_header_is_capped_by_the_tier():
    from inferd.api.request_tier import requested_timeout as _requested_timeout
    from inferd.config import MAX_QUEUE_TIMEOUT_BY_TIER_S, TIERS

    def request(value: str) -> Request:
        return Request({"type": "http", "headers": [(b"x-inferd-queue-timeout", value.encode())]})

    assert _requested_timeout(request("5"), TIERS.index("interactive")) == 5.0
    assert _requested_timeout(request("3000"), TIERS.index("interactive")) == MAX_QUEUE_TIMEOUT_BY_TIER_S["interactive"]
    assert _requested_timeout(request("3000"), TIERS.index("batch")) == 3000.0

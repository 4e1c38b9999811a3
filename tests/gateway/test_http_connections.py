"""What one client can hold of the API process's HTTP server (inferd/api/http_limits.py), against a real server on
echo workers: a body trickled a byte at a time, idle and unauthenticated connections, requests past
--limit-concurrency; and /health and /ready answer through all of it."""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
from gw import bearer, make_keys

LIMIT = 6
IDLE_PER_ADDRESS = 4
BODY_TIMEOUT = 1.0
KEEP_ALIVE = 1.0
HEAD_TIMEOUT = 30.0  # long: idle connections here must be closed by the other limits, not by this one


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    from servers import kill_group, start_server

    folder = tmp_path_factory.mktemp("http")
    keys = make_keys(folder / "keys.json", {"a": {}})
    srv = start_server(tiny_llama_dir, folder / "serve.log", "--echo", "--max-model-len", "256",
                       "--keys", str(folder / "keys.json"), "--limit-concurrency", str(LIMIT),
                       "--http-idle-per-address", str(IDLE_PER_ADDRESS), "--http-body-timeout", str(BODY_TIMEOUT),
                       "--http-keep-alive", str(KEEP_ALIVE), "--http-head-timeout", str(HEAD_TIMEOUT),
                       model_name="tiny", env={"INFERD_FAULT": "action=slow,times=0,ms=20"})
    srv.keys = keys
    srv.address = (urlparse(srv.url).hostname, urlparse(srv.url).port)
    yield srv
    kill_group(srv.proc)


def _connect(server, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(server.address, timeout=30, source_address=(source, 0))
    return sock


def _closed(sock: socket.socket, within: float, received: bytearray | None = None) -> bytes | None:
    """What the server sent before closing sock, if it closes it within `within` seconds; else None. received keeps
    what was read across calls (a call that times out has still read what came)."""
    received = bytearray() if received is None else received
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return bytes(received)
            if not chunk:
                return bytes(received)
            received += chunk
    return None


def _healthy(server) -> None:
    for path in ("/health", "/ready"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200, (path, r.status_code, r.text)


def _slow_body_head(key: str | None = None, length: int = 10_000_000) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_unauthenticated_slow_bodies_are_answered_and_closed(server):
    """The issue's reproduction, scaled down: connections announcing a 10 MB body with no key and trickling it. Each
    gets its 401 and is closed at once (each was held open, and counted against the cap, for as long as it
    trickled), and /health keeps answering. (Past the cap, idle-connection eviction takes over: tested below.)"""
    socks = []
    try:
        for _ in range(LIMIT - 1):
            socks.append(_connect(server))
            socks[-1].sendall(_slow_body_head())
        for sock in socks:
            try:
                sock.sendall(b"{")
            except OSError:  # answered and closed already
                pass
            answer = _closed(sock, 10)
            assert answer is not None, "a connection whose request was refused stayed open"
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
            assert b"invalid_api_key" in answer
            _healthy(server)
    finally:
        for sock in socks:
            sock.close()


def test_a_trickled_body_gets_408_at_the_body_deadline(server):
    """With a key, a body that arrives a byte every 0.2 s is cut at --http-body-timeout (plus its tiny allowance
    for the bytes received): 408, closed; a body sent at once in two parts, a pause between, passes."""
    with _connect(server) as sock:
        sock.sendall(_slow_body_head(key=server.keys["a"], length=1_000_000))  # under --max-body-bytes
        start = time.monotonic()
        answer, received = None, bytearray()
        while answer is None and time.monotonic() - start < 20:
            try:
                sock.sendall(b" ")
            except OSError:
                break
            answer = _closed(sock, 0.2, received)
        answer = answer if answer is not None else _closed(sock, 5, received)
        assert answer is not None, "a trickled body held its connection past the body deadline"
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"request_timeout" in answer
        assert time.monotonic() - start < BODY_TIMEOUT + 5
    body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 2}'
    with _connect(server) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.keys['a']}\r\n"
                     f"Content-Type: application/json\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body[:10])
        time.sleep(BODY_TIMEOUT / 2)  # a pause the deadline allows (the test is that this is not cut)
        sock.sendall(body[10:])
        answer = _closed(sock, 30)
        assert answer is not None and answer.startswith(b"HTTP/1.1 200"), answer


def test_idle_connections_never_make_the_server_refuse_work(server):
    """Twice --limit-concurrency idle connections from other addresses: the oldest idle ones are closed to make
    room, and a request with a key is served (before, every new request got 503, /health included)."""
    socks = [_connect(server, f"127.0.0.{2 + i % 3}") for i in range(2 * LIMIT)]
    try:
        _healthy(server)
        r = httpx.post(server.url + "/v1/completions", headers=bearer(server.keys["a"]), timeout=30,
                       json={"model": server.model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert _closed(socks[0], 10) == b"", "the oldest idle connection was not the one closed"
    finally:
        for sock in socks:
            sock.close()


def test_idle_connections_are_bounded_per_address(server):
    """Past --http-idle-per-address idle connections from one address, its oldest goes; another address's stay."""
    other = _connect(server, "127.0.0.9")
    mine = [_connect(server, "127.0.0.8") for _ in range(IDLE_PER_ADDRESS + 2)]
    try:
        assert _closed(mine[0], 10) == b""
        assert _closed(mine[1], 10) == b""
        assert _closed(mine[-1], 0.5) is None  # the newest stay
        assert _closed(other, 0.5) is None
    finally:
        for sock in [other, *mine]:
            sock.close()


def test_bytes_between_requests_do_not_extend_keep_alive(server):
    """A kept-alive connection that sends blank lines (which start no request) is closed at --http-keep-alive: they
    used to reset uvicorn's keep-alive timer, so a trickle held the connection forever."""
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < KEEP_ALIVE + 10:
            try:
                sock.sendall(b"\r\n")
            except OSError:
                closed = True
                break
            if _closed(sock, 0.2) is not None:
                closed = True
                break
        assert closed, "blank lines kept the connection open past the keep-alive time"


def test_requests_past_the_cap_get_503_but_probes_pass(server):
    """--limit-concurrency requests in progress (streams slowed by the echo worker): the next request gets 503 with
    Retry-After in OpenAI's shape; /health and /ready still answer 200."""
    started = threading.Semaphore(0)

    def stream() -> int:
        with httpx.stream("POST", server.url + "/v1/completions", headers=bearer(server.keys["a"]), timeout=120,
                          json={"model": server.model, "prompt": "hi", "max_tokens": 250, "stream": True}) as r:
            started.release()  # its response has started: its request is in progress until the stream ends
            for _ in r.iter_bytes():
                pass
            return r.status_code

    with ThreadPoolExecutor(LIMIT) as pool:
        running = [pool.submit(stream) for _ in range(LIMIT)]
        for _ in range(LIMIT):
            assert started.acquire(timeout=60)
        r = httpx.post(server.url + "/v1/completions", headers=bearer(server.keys["a"]), timeout=30,
                       json={"model": server.model, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_overloaded"
        assert int(r.headers["retry-after"]) >= 1
        _healthy(server)
        assert not any(f.done() for f in running), "a stream ended before the checks: they prove nothing"
        assert [f.result() for f in running] == [200] * LIMIT


def test_a_pipelined_request_waiting_for_the_one_before_is_not_timed_out(server):
    """Two requests on one connection, the second sent before the first is answered, its body a moment after its
    head: the server does not read it while the first runs (3 s here, past --http-body-timeout), which is not the
    client's delay: both are answered 200."""
    def request(max_tokens: int, close: bool = False) -> tuple[bytes, bytes]:
        payload = f'{{"model": "tiny", "prompt": "hi", "max_tokens": {max_tokens}}}'.encode()
        return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.keys['a']}\r\n"
                f"Content-Type: application/json\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}"
                f"Content-Length: {len(payload)}\r\n\r\n").encode(), payload

    (head1, body1), (head2, body2) = request(150), request(2, close=True)
    with _connect(server) as sock:
        sock.sendall(head1 + body1 + head2)
        time.sleep(0.3)  # the second body arrives after the server stopped reading (the test is that it waits)
        sock.sendall(body2)
        received = _closed(sock, 60)  # the second asked to close the connection after its answer
    assert received is not None
    assert re.findall(rb"HTTP/1\.1 (\d+)", received) == [b"200", b"200"], received[:500]

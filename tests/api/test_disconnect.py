"""A client that disconnects, streaming or not, aborts its request at once: the worker's running count and the
KV blocks in use (read from /metrics, i.e. the worker's heartbeats), and the gateway's open requests, return to zero
long before the request would have finished, and the engine stops stepping for it. Default model: ~50 ms a step, so
a 2,000-token request would run for minutes."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import httpx

LONG = 2000  # tokens the aborted requests ask for


# -1 until the worker's first heartbeat: a missing gauge is never taken for an idle worker
def _running(m):
    return m.get('inferd_num_requests_running{model="smollm2"}', -1)


def _kv_in_use(m):
    return m.get('inferd_kv_blocks_in_use{model="smollm2"}', -1)


def _steps(m):
    return m.get('inferd_engine_steps_total{model="smollm2"}', -1)


def _idle(m):
    """The worker holds nothing, and neither does the gateway (open requests, the worker room they take)."""
    return (_running(m) == 0 and _kv_in_use(m) == 0 and m.get('inferd_num_requests_waiting{model="smollm2"}') == 0
            and m.get("inferd_gateway_open_requests") == 0 and m.get("inferd_gateway_in_flight_sequences") == 0)


def test_stream_disconnect_frees_the_request(smollm2_server):
    server = smollm2_server
    server.wait_metrics(_idle)
    body = {"model": server.model, "prompt": "Write a long story about a dragon.", "max_tokens": LONG,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: {")
                if got == 3:
                    break
            busy = server.wait_metrics(lambda m: _running(m) == 1 and _kv_in_use(m) > 0)
        # leaving the block closes the connection mid-stream
    idle = server.wait_metrics(_idle, timeout=20)
    assert _steps(idle) - _steps(busy) < LONG // 4  # stopped, far from max_tokens


def test_non_stream_disconnect_frees_the_request(smollm2_server):
    server = smollm2_server
    server.wait_metrics(_idle)
    url = urlparse(server.url)
    payload = (b'{"model": "%s", "prompt": "Write a long story about a dragon.", "max_tokens": %d, '
               b'"ignore_eos": true, "temperature": 0}' % (server.model.encode(), LONG))
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(payload)) + payload
    sock = socket.create_connection((url.hostname, url.port))
    try:
        sock.sendall(request)
        busy = server.wait_metrics(lambda m: _running(m) == 1 and _kv_in_use(m) > 0)
    finally:
        sock.close()  # the client goes away before any response byte
    idle = server.wait_metrics(_idle, timeout=20)
    assert _steps(idle) - _steps(busy) < LONG // 4


def test_disconnect_during_many_streams_leaves_others_running(smollm2_server):
    """Two streams; one client leaves; the other completes in full."""
    server = smollm2_server
    server.wait_metrics(_idle)
    body = {"model": server.model, "prompt": "Count to ten:", "max_tokens": 40, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as keep, httpx.Client(timeout=120) as leave:
        with keep.stream("POST", server.url + "/v1/completions", json=body) as kept:
            with leave.stream("POST", server.url + "/v1/completions", json={**body, "max_tokens": LONG}) as left:
                next(left.iter_lines())
            text = b"".join(kept.iter_bytes())
    assert text.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in text
    server.wait_metrics(_idle, timeout=20)

"""The Batch API keeps tenants apart, against a real `inferd serve` (echo workers: the runner is what is tested, not
the model) with a keys file, through the official `openai` client: a malformed input file (JSON nested past the
parser's limit, a lone surrogate) fails its own batch and never the runner; a line over the HTTP body limit is its
line's error and the event loop stays free while a big file is validated; a line that can never fit its tenant's
quota is not retried and does not hold up another tenant's batch."""

from __future__ import annotations

import io
import json
import threading
import time

import httpx
import openai
import pytest

from batch_util import jsonl, wait_status

pytestmark = pytest.mark.timeout(300)

MAX_BODY = 1 << 20  # --max-body-bytes of the server: batch lines are bounded like HTTP bodies


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    from inferd.gateway.tenants import create_key
    from servers import kill_group, start_server

    tmp = tmp_path_factory.mktemp("batch-isolation")
    keys = {name: create_key(str(tmp / "keys.json"), name, **settings)[0]
            for name, settings in {"alice": {}, "bob": {}, "small": {"tpm": 8}}.items()}
    srv = start_server(tiny_llama_dir, tmp / "serve.log", "--echo", "--max-model-len", "256", "--keys",
                       str(tmp / "keys.json"), "--state-dir", str(tmp / "state"), "--max-body-bytes", str(MAX_BODY),
                       model_name="tiny")
    srv.keys = keys
    yield srv
    kill_group(srv.proc)


def client(srv, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.keys[tenant], max_retries=0, timeout=60)


def chat_line(i: int, content: str | None = None, max_tokens: int = 4) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content or f"Say {i}"}],
                     "max_tokens": max_tokens}}


def submit(c: openai.OpenAI, data: bytes, endpoint: str = "/v1/chat/completions"):
    f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")


def lines_counted(srv) -> dict[str, float]:
    m = srv.metrics()
    return {o: m.get(f'inferd_batch_lines_total{{outcome="{o}"}}', 0.0) for o in ("ok", "error", "retried",
                                                                                  "invalid")}


def test_a_malformed_input_fails_its_own_batch_and_never_the_runner(server):
    alice, bob = client(server, "alice"), client(server, "bob")
    before = lines_counted(server)
    deep = submit(alice, b"[" * 100_000 + b"\n")  # past json's recursion limit: RecursionError, not ValueError
    line = json.dumps(chat_line(0))
    lone_id = submit(alice, line.replace('"req-0"', '"a\\ud800"').encode() + b"\n")  # a JSON escape, valid ASCII
    lone_body = submit(alice, line.replace('"Say 0"', '"x\\ud800"').encode() + b"\n")
    other = submit(bob, jsonl([chat_line(1)]))  # created after them: the runner must reach it
    done = wait_status(bob, other.id, ("completed", "failed"), timeout=30)
    assert done.status == "completed" and done.request_counts.completed == 1
    for batch, code in ((deep, "invalid_json_line"), (lone_id, "invalid_unicode"), (lone_body, "invalid_unicode")):
        b = wait_status(alice, batch.id, ("completed", "failed"), timeout=30)
        assert b.status == "failed" and [(e.line, e.code) for e in b.errors.data] == [(1, code)], b
    assert "Traceback" not in server.log()  # refused, not crashed (the old runner logged it 4 times a second)
    assert lines_counted(server)["invalid"] - before["invalid"] == 3


def test_a_line_over_the_body_limit_is_its_error_and_validation_leaves_the_event_loop_free(server):
    alice = client(server, "alice")
    over = chat_line(0, "x" * MAX_BODY)
    r = httpx.post(server.url + "/v1/chat/completions", json=over["body"],
                   headers={"Authorization": f"Bearer {server.keys['alice']}"}, timeout=60)
    assert r.status_code == 413  # over HTTP ...
    b = wait_status(alice, submit(alice, jsonl([chat_line(1), over, chat_line(2)])).id, ("failed", "completed"), 30)
    assert b.status == "failed" and [(e.line, e.code) for e in b.errors.data] == [(2, "request_too_large")]  # ... here

    # ~100 MB of lines just under the limit, validated and stored while /health is polled (stored on the event
    # loop, they stalled it for ~0.4 s per 60 MB)
    big = jsonl([chat_line(i, "x" * (MAX_BODY - 200)) for i in range(100)])
    f = alice.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
    latencies, stop = [], threading.Event()

    def poll():
        with httpx.Client(base_url=server.url, timeout=30) as h:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert h.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.5)
    idle = sorted(latencies)[len(latencies) // 2]
    started = len(latencies)
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    try:
        b = wait_status(alice, batch.id, ("in_progress", "completed", "failed"), timeout=120)
        assert b.status != "failed", b.errors
    finally:
        stop.set()
        poller.join(30)
        alice.batches.cancel(batch.id)
        # its lines in flight still end (and count) after the cancel: the next test counts lines from here on
        wait_status(alice, batch.id, ("cancelled", "completed", "failed"), timeout=120)
    during = latencies[started:]
    assert len(during) >= 5 and max(during) < 0.25, (f"/health took up to {max(during):.3f} s while the file was "
                                                     f"validated (idle median {idle:.4f} s)")


def test_a_line_that_can_never_fit_is_not_retried_and_holds_up_no_other_tenant(server):
    small, bob = client(server, "small"), client(server, "bob")
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_line(0)["body"],
                   headers={"Authorization": f"Bearer {server.keys['small']}"}, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "request_too_large"  # over its tpm of 8: never fits
    before = lines_counted(server)
    hopeless = submit(small, jsonl([chat_line(i) for i in range(40)]))  # older: it would go first, oldest first
    other = submit(bob, jsonl([chat_line(i) for i in range(4)]))
    t0 = time.monotonic()
    done = wait_status(bob, other.id, ("completed", "failed"), timeout=30)
    assert done.status == "completed" and done.request_counts.completed == 4
    took = time.monotonic() - t0
    b = wait_status(small, hopeless.id, ("completed", "failed"), timeout=30)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (0, 40)
    errors = [json.loads(x) for x in small.files.content(b.error_file_id).text.splitlines()]
    assert {(e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errors} == \
        {(429, "request_too_large")}
    after = lines_counted(server)
    assert after["retried"] == before["retried"], "a line that can never fit was retried"
    assert after["error"] - before["error"] == 40 and after["ok"] - before["ok"] == 4
    assert took < 10, f"the other tenant's 4 lines took {took:.1f} s"

"""The Batch API's error paths against a real `inferd serve` (echo workers, a keys file) through the official `openai`
client: busy answers (a tenant's 429, the service's 503) pause the runner for their Retry-After or the back-off,
counted from the server's own metrics, and the lines succeed once capacity returns; a batch whose tenant is removed
while it runs fails with tenant_gone; an input file gone from the disk fails its batch with file_not_found, an empty
one with empty_file. (What a crash leaves in the state folder: test_batches.py's kill -9 test.)"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sqlite3
import threading
import time
from datetime import datetime

import httpx
import openai
import pytest

from batch_util import jsonl, wait_status

pytestmark = pytest.mark.timeout(300)

RATE_WINDOW_S = 3  # --rate-window: the "metered" tenant's one request per window comes back after 3 s
SLOW_SEED = 4242  # requests sampled with this seed take SLOW_MS per engine step (INFERD_FAULT): work that lasts
SLOW_MS = 40
BATCH_CONCURRENCY = 2  # --batch-concurrency: never more batch lines in flight than this


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    """One request at a time on the worker and a line of 2 (a third interactive request saturates the service for
    batch work), a 3 s rate window; requests with SLOW_SEED are slow."""
    from inferd.gateway.tenants import create_key
    from servers import kill_group, start_server

    tmp = tmp_path_factory.mktemp("batch-errors")
    keys_path = tmp / "keys.json"
    keys = {name: create_key(str(keys_path), name, **settings)[0] for name, settings in {
        "alice": {}, "metered": {"rpm": 1}, "vip": {"tier": "interactive"}, "bulk": {}, "leaving": {}}.items()}
    srv = start_server(tiny_llama_dir, tmp / "serve.log", "--echo", "--max-model-len", "256", "--keys",
                       str(keys_path), "--state-dir", str(tmp / "state"), "--rate-window", str(RATE_WINDOW_S),
                       "--max-num-seqs", "1", "--worker-queue-depth", "0", "--max-queue-requests", "2",
                       "--tenant-queue-share", "1", "--batch-concurrency", str(BATCH_CONCURRENCY), model_name="tiny",
                       env={"INFERD_FAULT": f"action=slow,ms={SLOW_MS},times=0,seed={SLOW_SEED}"})
    srv.keys, srv.keys_path, srv.state = keys, keys_path, tmp / "state"
    yield srv
    kill_group(srv.proc)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def client(srv, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.keys[tenant], max_retries=0, timeout=60)


def line(i: int, max_tokens: int = 2, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"Say {i}", "max_tokens": max_tokens, **body}}


def submit(c: openai.OpenAI, data: bytes, endpoint: str = "/v1/completions"):
    f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")


def counted(srv, outcome: str) -> float:
    """inferd_batch_lines_total{outcome} of the server: "retried" counts busy answers, "ok" lines served."""
    return srv.metrics().get(f'inferd_batch_lines_total{{outcome="{outcome}"}}', 0.0)


def wait_counted(srv, outcome: str, at_least: float, timeout: float = 60.0) -> tuple[float, float]:
    """(the count, the wall-clock time it was seen) once the count reached at_least."""
    deadline = time.monotonic() + timeout
    while (n := counted(srv, outcome)) < at_least:
        assert time.monotonic() < deadline, f"{outcome} stayed at {n} (waiting for {at_least})"
        time.sleep(0.02)
    return n, time.time()


BUSY_RE = re.compile(r"^(\S+ \S+) inferd\.batches INFO batch (\S+) line \d+: busy \((\d+) (\S+), Retry-After "
                     r"(\S+)\); .* wait (\S+) s$", re.M)


def busy_answers(srv, batch_id: str) -> list[dict]:
    """The runner's log of the busy answers to the batch's lines: when (wall-clock seconds, from the server's log
    line), status, code, Retry-After and the pause it set."""
    out = []
    for when, batch, status, code, retry_after, pause in BUSY_RE.findall(srv.log()):
        if batch == batch_id:
            stamp = datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append({"at": stamp, "status": int(status), "code": code,
                        "retry_after": None if retry_after == "None" else float(retry_after), "pause": float(pause)})
    return out


def reload_keys(srv, change) -> None:
    """Applies change(KeyStore) -> KeyStore to the keys file, sends the server SIGHUP and waits for its reload."""
    from inferd.gateway.tenants import KeyStore, locked

    reloads = srv.log().count("keys reloaded")
    with locked(str(srv.keys_path)):
        change(KeyStore.load(str(srv.keys_path))).save(str(srv.keys_path))
    os.kill(srv.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while srv.log().count("keys reloaded") <= reloads:
        assert time.monotonic() < deadline, "the server never reloaded its keys"
        time.sleep(0.02)


def read_jsonl(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


def test_a_tenants_429_pauses_it_for_the_retry_after_and_its_lines_run_once_its_quota_returns(server):
    """"metered" may send one request per 3 s (Retry-After: 3). Of its 12 lines one runs and the next is refused;
    its quota is then raised, yet no line of it runs before the Retry-After; then all do. The old runner paused each
    line alone: every refusal freed a slot that the next line took at once (11 refusals in the first burst)."""
    from inferd.gateway.tenants import KeyStore, Tenant

    metered = client(server, "metered")
    retried, ok = counted(server, "retried"), counted(server, "ok")
    b = submit(metered, jsonl([line(i) for i in range(12)]))
    _, refused_at = wait_counted(server, "retried", retried + 1)
    reload_keys(server, lambda ks: KeyStore({**ks.tenants, "metered": Tenant("metered", rpm=1_000_000)}, ks.keys))
    lifted_at = time.time()
    _, resumed = wait_counted(server, "ok", ok + 2)  # the line that fitted, then the first after the pause
    done = wait_status(metered, b.id, ("completed", "failed"), timeout=60)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    refusals = counted(server, "retried") - retried
    # a burst of at most the runner's concurrency per Retry-After while the quota was short (one more for slack)
    bound = BATCH_CONCURRENCY * (2 + int((lifted_at - refused_at) / RATE_WINDOW_S))
    assert refusals <= bound, f"{refusals} refusals in {lifted_at - refused_at:.1f} s: they grew with the pending lines"
    busy = busy_answers(server, b.id)
    assert len(busy) == refusals and {(x["status"], x["code"]) for x in busy} == {(429, "rate_limit_exceeded")}
    assert all(x["retry_after"] == RATE_WINDOW_S and x["pause"] >= RATE_WINDOW_S for x in busy), busy
    for before, after in zip(busy, busy[1:]):  # a refusal is in the burst before it, or after its pause
        assert after["at"] - before["at"] < 0.5 or after["at"] - before["at"] >= before["pause"] - 0.01, busy
    waited = resumed - busy[-1]["at"]
    assert waited >= RATE_WINDOW_S - 0.05, f"a line ran {waited:.2f} s after a Retry-After of {RATE_WINDOW_S} s"
    out = read_jsonl(metered, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(12))


def test_a_saturated_service_pauses_every_batch_line_with_a_growing_back_off(server):
    """Interactive work fills the worker and the line (3 slow requests at a time): batch lines get 503 overloaded.
    The runner tries one line at a time, after a back-off that doubles (1 s, then 2 s) and is never shorter than the
    answer's Retry-After; the batch completes once the interactive work is gone. The old runner sent every pending line
    as soon as the one before was refused (6 refusals at once, then again each second)."""
    stop = threading.Event()

    def load():
        with httpx.Client(base_url=server.url, headers=bearer(server.keys["vip"]), timeout=60) as h:
            while not stop.is_set():
                h.post("/v1/completions", json={"model": "tiny", "prompt": "hold the line", "max_tokens": 8,
                                                "seed": SLOW_SEED})

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    bulk = client(server, "bulk")
    try:
        deadline = time.monotonic() + 30
        while True:  # saturated for batch work: a batch-tier request is refused with a Retry-After
            r = httpx.post(server.url + "/v1/completions", json=line(0)["body"], timeout=60,
                           headers={**bearer(server.keys["alice"]), "x-inferd-tier": "batch"})
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "overloaded" and int(r.headers["Retry-After"]) >= 1
                break
            assert time.monotonic() < deadline, "the service never saturated"
        retried, ok = counted(server, "retried"), counted(server, "ok")
        b = submit(bulk, jsonl([line(i) for i in range(6)]))
        wait_counted(server, "retried", retried + 2)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    _, resumed = wait_counted(server, "ok", ok + 1)
    done = wait_status(bulk, b.id, ("completed", "failed"), timeout=60)
    assert done.status == "completed" and done.request_counts.completed == 6
    # 2 while saturated (1 s apart), one more if the load drained slowly
    refusals = counted(server, "retried") - retried
    assert refusals <= 3, f"{refusals} refusals: the runner did not wait between tries"
    busy = busy_answers(server, b.id)
    assert len(busy) == refusals and {x["status"] for x in busy} == {503}, busy
    for k, x in enumerate(busy):  # the k-th refusal in a row: at least 2**k s and the Retry-After
        assert x["pause"] >= max(2 ** k, x["retry_after"] or 0), busy
        if k:
            assert x["at"] - busy[k - 1]["at"] >= busy[k - 1]["pause"] - 0.01, f"tried before the pause ended: {busy}"
    assert resumed - busy[-1]["at"] >= busy[-1]["pause"] - 0.05, f"a line ran before the pause ended: {busy}"


def test_a_batch_whose_tenant_is_removed_while_it_runs_fails_with_tenant_gone(server):
    """Its lines done stay in the output file, those not run are in the error file under tenant_gone, and the batch
    fails with that code (the old runner sent every remaining line to a 401 and called the batch completed). The
    tenant's things are its identity's: a key made again for the same tenant sees them."""
    from inferd.gateway.tenants import KeyStore, create_key

    leaving = client(server, "leaving")
    b = submit(leaving, jsonl([line(i, max_tokens=6, seed=SLOW_SEED) for i in range(16)]))  # ~0.25 s each
    deadline = time.monotonic() + 60
    while leaving.batches.retrieve(b.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    reload_keys(server, lambda ks: KeyStore({n: t for n, t in ks.tenants.items() if n != "leaving"},
                                            {k: r for k, r in ks.keys.items() if r.tenant != "leaving"}))
    with pytest.raises(openai.AuthenticationError):
        leaving.batches.retrieve(b.id)
    db = sqlite3.connect(f"file:{server.state / 'batches.sqlite3'}?mode=ro", uri=True)
    try:  # the tenant can no longer look: the server's own state says when the batch ended
        while db.execute("SELECT status FROM batches WHERE id = ?", (b.id,)).fetchone()[0] not in (
                "completed", "failed"):
            assert time.monotonic() < deadline, "the batch of a removed tenant never ended"
            time.sleep(0.02)
    finally:
        db.close()
    key, _ = create_key(str(server.keys_path), "leaving")
    server.keys["leaving"] = key
    reload_keys(server, lambda ks: ks)
    back = client(server, "leaving")
    done = back.batches.retrieve(b.id)
    assert done.status == "failed" and done.failed_at, done
    assert [(e.code, e.line) for e in done.errors.data] == [("tenant_gone", None)]
    out, errors = read_jsonl(back, done.output_file_id), read_jsonl(back, done.error_file_id)
    assert len(out) >= 2 and len(out) + len(errors) == 16 and errors
    assert sorted(o["custom_id"] for o in out + errors) == sorted(f"req-{i}" for i in range(16))  # each once
    assert {e["error"]["code"] for e in errors} == {"tenant_gone"} and all(e["response"] is None for e in errors)
    assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(errors))


def test_an_input_file_gone_from_the_disk_fails_its_batch_with_file_not_found(server):
    alice = client(server, "alice")
    f = alice.files.create(file=("in.jsonl", io.BytesIO(jsonl([line(0)]))), purpose="batch")
    (server.state / "files" / f.id).unlink()  # its bytes lost (an operator, a restore from an old backup)
    r = httpx.get(f"{server.url}/v1/files/{f.id}/content", headers=bearer(server.keys["alice"]), timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found", r.text  # was a 500
    b = alice.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    b = wait_status(alice, b.id, ("completed", "failed"), timeout=30)
    assert b.status == "failed" and b.request_counts.total == 0 and b.output_file_id is None
    assert [(e.code, e.param, e.line) for e in b.errors.data] == [("file_not_found", "input_file_id", None)]
    g = alice.files.create(file=("in.jsonl", io.BytesIO(jsonl([line(0)]))), purpose="batch")
    alice.files.delete(g.id)  # deleted through the API: the batch is refused when it is created
    with pytest.raises(openai.NotFoundError) as e:
        alice.batches.create(input_file_id=g.id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.body["code"] == "file_not_found"


def test_an_empty_input_file_fails_its_batch_with_empty_file(server):
    alice = client(server, "alice")
    for data in (b"", b"\n  \n\n"):  # nothing, or only blank lines (which are skipped)
        b = wait_status(alice, submit(alice, data).id, ("completed", "failed"), timeout=30)
        assert b.status == "failed" and b.request_counts.total == 0 and b.output_file_id is None
        assert [(e.code, e.line) for e in b.errors.data] == [("empty_file", None)]

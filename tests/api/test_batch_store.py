"""The Batch API's store and runner on their own (a real SQLite store in a temporary folder): the limits, results
recorded once, a database from before migrated; the runner's concurrency: it backs off to one line at a time while more
important work runs, and grows back once it has been quiet; tenants take turns, each with its own concurrency, busy
lines are retried with a back-off, and a failure in one batch is that batch's alone. The lines run through an execute
function of the test's (the whole HTTP path is tested in test_batches.py: this checks the runner's policy, which the
server's timing would blur)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from inferd.api import batch_input, batch_runner, batches
from inferd.api.batch_input import parse_input
from inferd.api.batch_runner import BatchRunner, LineOutcome
from inferd.api.batches import BatchStore
from inferd.api.errors import APIError


def put_file(store: BatchStore, tmp_path, lines: list[dict], tenant: str = "t") -> dict:
    src = tmp_path / f"in-{len(list(tmp_path.iterdir()))}.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tmp = store.files_dir / ".upload-test"
    src.rename(tmp)
    return store.add_file(tenant, "batch", "in.jsonl", tmp)


def line(i: int) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"x{i}"}}


def test_limits(tmp_path, monkeypatch):
    store = BatchStore(tmp_path / "state")
    f = put_file(store, tmp_path, [line(0)])
    for _ in range(batches.MAX_ACTIVE_BATCHES_PER_TENANT):
        store.create_batch("t", "/v1/completions", f["id"], "24h", None)
    with pytest.raises(APIError) as e:  # MAX_ACTIVE_BATCHES_PER_TENANT
        store.create_batch("t", "/v1/completions", f["id"], "24h", None)
    assert e.value.status == 429 and e.value.code == "too_many_batches"
    store.create_batch("other", "/v1/completions", f["id"], "24h", None)  # per tenant
    with pytest.raises(APIError) as e:  # MAX_BATCH_WINDOW_S
        store.create_batch("other", "/v1/completions", f["id"], "200h", None)
    assert e.value.param == "completion_window"
    monkeypatch.setattr(batch_input, "MAX_BATCH_LINES", 3)
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps(line(i)) + "\n" for i in range(5)))
    lines, errors, refused = parse_input(big, "/v1/completions", 1 << 20)
    assert [e["code"] for e in errors] == ["too_many_lines"] and errors[0]["line"] == 4
    with pytest.raises(APIError) as e:  # another tenant's file does not exist for this one
        store.get_file("other", f["id"])
    assert e.value.status == 404


def test_a_result_is_recorded_once(tmp_path):
    store = BatchStore(tmp_path / "state")
    f = put_file(store, tmp_path, [line(0), line(1)])
    b = store.create_batch("t", "/v1/completions", f["id"], "24h", None)
    lines, _, _ = parse_input(store.path(f["id"]), "/v1/completions", 1 << 20)
    assert store.store_lines(b["id"], lines)
    assert store.record(b["id"], 1, True, {"custom_id": "c0"})
    assert not store.record(b["id"], 1, True, {"custom_id": "c0"})  # a second run of the same line
    row = store.get_batch("t", b["id"])
    assert (row["total"], row["completed"], row["failed"], row["status"]) == (2, 1, 0, "in_progress")


def test_the_runner_backs_off_while_more_important_work_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_runner, "BATCH_BUSY_COOLDOWN_S", 0.3)

    async def scenario():
        store = BatchStore(tmp_path / "state")
        f = put_file(store, tmp_path, [line(i) for i in range(60)])
        busy = {"now": 1}
        inflight, peaks = [0], {"busy": 0, "quiet": 0}

        async def execute(tenant, endpoint, body):
            inflight[0] += 1
            key = "busy" if busy["now"] else "quiet"
            peaks[key] = max(peaks[key], inflight[0])
            await asyncio.sleep(0.05)
            inflight[0] -= 1
            return LineOutcome(200, {"ok": True})

        runner = BatchRunner(store, execute, max_concurrency=8, interactive_busy=lambda: busy["now"])
        b = store.create_batch("t", "/v1/completions", f["id"], "24h", None)
        runner.start()
        try:
            while store.get_batch("t", b["id"])["completed"] < 10:
                await asyncio.sleep(0.02)
            busy["now"] = 0
            while store.get_batch("t", b["id"])["status"] != "completed":
                await asyncio.sleep(0.02)
        finally:
            await runner.stop()
        out = [json.loads(x) for x in store.path(store.get_batch("t", b["id"])["output_file_id"]).read_text()
               .splitlines()]
        return peaks, [o["custom_id"] for o in out]

    peaks, ids = asyncio.run(scenario())
    assert peaks["busy"] == batch_runner.BUSY_BATCH_CONCURRENCY
    assert peaks["quiet"] > 2  # it grew back once the other work had been gone for the cool-down
    assert ids == [f"c{i}" for i in range(60)]


def run_batches(tmp_path, execute, per_tenant: dict[str, int], max_concurrency: int, until, timeout: float = 20.0,
                patch=None):
    """A real store with one batch per tenant (created in the dict's order, oldest first) and a runner with the
    test's execute, run until until(store, batches) holds; returns (store, batches, runner's last concurrencies)."""
    async def scenario():
        store = BatchStore(tmp_path / "state")
        made = {}
        for tenant, n in per_tenant.items():
            f = put_file(store, tmp_path, [line(i) for i in range(n)], tenant=tenant)
            made[tenant] = store.create_batch(tenant, "/v1/completions", f["id"], "24h", None)
        if patch is not None:
            patch(store, made)
        runner = BatchRunner(store, execute, max_concurrency=max_concurrency)
        runner.start()
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while not until(store, made):
                assert asyncio.get_running_loop().time() < deadline, {
                    t: store.get_batch(t, b["id"]) for t, b in made.items()}
                await asyncio.sleep(0.02)
        finally:
            await runner.stop()
        return store, made

    return asyncio.run(scenario())


def done(store, made, *tenants) -> bool:
    return all(store.get_batch(t, made[t]["id"])["status"] == "completed" for t in tenants)


def test_tenants_take_turns_whatever_the_age_of_their_batches(tmp_path):
    calls = []

    async def execute(tenant, endpoint, body):
        calls.append(tenant)
        await asyncio.sleep(0.005)
        return LineOutcome(200, {"ok": True})

    # one line at a time: the older batch's 30 lines would all go first, oldest first
    run_batches(tmp_path, execute, {"key:old": 30, "key:new": 30}, 1, lambda s, m: done(s, m, "key:old", "key:new"))
    assert calls[:20] == ["key:new", "key:old"] * 10 or calls[:20] == ["key:old", "key:new"] * 10, calls[:20]


def test_a_busy_tenant_slows_only_itself_and_backs_off(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_runner, "BATCH_RETRY_S", 0.05)
    monkeypatch.setattr(batch_runner, "BATCH_RETRY_MAX_S", 0.4)
    inflight, peak, attempts = {"key:busy": 0, "key:calm": 0}, {"key:busy": 0, "key:calm": 0}, {}

    async def execute(tenant, endpoint, body):
        inflight[tenant] += 1
        if sum(attempts.values()) >= 8:  # once the busy tenant's first refusals have had their effect (not a time:
            peak[tenant] = max(peak[tenant], inflight[tenant])  # a loaded machine once took the 0.5 s used here)
        try:
            if tenant == "key:busy":  # its own rate limit, every time: "busy", retried
                attempts[body] = attempts.get(body, 0) + 1
                return LineOutcome(429, {"error": {"code": "rate_limit_exceeded"}}, retry=True)
            await asyncio.sleep(0.02)
            return LineOutcome(200, {"ok": True})
        finally:
            inflight[tenant] -= 1

    began = time.monotonic()
    run_batches(tmp_path, execute, {"key:busy": 20, "key:calm": 400}, 8, lambda s, m: done(s, m, "key:calm"))
    took = time.monotonic() - began
    assert peak["key:calm"] >= 6  # its concurrency grew to the runner's, whatever the other tenant's 429s
    assert peak["key:busy"] <= 1  # halved to one at a time by its own
    # retried after 0.05, 0.1, 0.2, 0.4, 0.4, ... s: at most ~took/0.4 + 4 tries per line, not took/0.05
    assert max(attempts.values()) <= took / 0.4 + 5, (max(attempts.values()), took)


def test_a_failure_in_one_batch_is_that_batchs_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_runner, "BATCH_RETRY_S", 0.05)

    async def execute(tenant, endpoint, body):
        if tenant == "key:broken":
            raise RuntimeError("an unexpected failure")
        return LineOutcome(200, {"ok": True})

    failed_once = []

    def patch(store, made):  # the broken tenant's finalization fails once (a full disk, say)
        finalize = store.finalize

        def flaky(batch, *args):
            if batch["id"] == made["key:broken"]["id"] and not failed_once:
                failed_once.append(1)
                raise OSError(28, "No space left on device")
            return finalize(batch, *args)

        store.finalize = flaky

    store, made = run_batches(tmp_path, execute, {"key:broken": 5, "key:fine": 5}, 4,
                              lambda s, m: done(s, m, "key:broken", "key:fine"), patch=patch)
    broken = store.get_batch("key:broken", made["key:broken"]["id"])
    assert failed_once and (broken["completed"], broken["failed"]) == (0, 5)  # each line's result: a 500
    errors = [json.loads(x) for x in store.path(broken["error_file_id"]).read_text().splitlines()]
    assert {e["response"]["status_code"] for e in errors} == {500}
    assert store.get_batch("key:fine", made["key:fine"]["id"])["completed"] == 5


def test_a_database_from_before_is_migrated_and_made_private(tmp_path):
    import os
    import sqlite3
    import stat

    state = tmp_path / "state"
    (state / "files").mkdir(parents=True, mode=0o755)
    os.chmod(state, 0o755)
    db = sqlite3.connect(state / "batches.sqlite3", isolation_level=None)  # as the server wrote it before
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(batches._SCHEMA)
    for i, tenant in enumerate(["alice", "anonymous", "default"]):
        db.execute("INSERT INTO files VALUES (?, ?, 'batch', 'in.jsonl', 1, 0)", (f"file-{i}", tenant))
        (state / "files" / f"file-{i}").write_text("x")
    db.execute("INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, created_at, "
               "expires_at, completed_at, seq) VALUES ('batch_1', 'alice', '/v1/completions', 'file-0', '24h', "
               "'completed', 0, 1, 1, 1)")
    db.executemany("INSERT INTO lines VALUES ('batch_1', ?, ?, ?, 'ok', '{}')",
                   [(n, f"c{n}", "x" * 4000) for n in range(200)])  # a finished batch's lines, never deleted
    db.close()
    os.chmod(state / "batches.sqlite3", 0o644)

    store = BatchStore(state)
    owners = {r["id"]: r["tenant"] for r in store._q("SELECT id, tenant FROM files")}
    assert owners == {"file-0": "key:alice", "file-1": "builtin:anonymous", "file-2": "builtin:default"}
    assert store.get_batch("key:alice", "batch_1")["status"] == "completed"
    assert store._q("SELECT COUNT(*) AS n FROM lines")[0]["n"] == 0
    assert store._q("PRAGMA auto_vacuum")[0]["auto_vacuum"] == 2  # incremental: deletes give pages back
    assert (state / "batches.sqlite3").stat().st_size < 200 * 4000 / 2
    for path in (state, state / "files"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for path in [state / "batches.sqlite3", *(state / "files").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    store.close()


def test_a_batch_whose_tenant_is_gone_before_it_runs_fails_with_tenant_gone(tmp_path):
    """Its file is never validated into lines and none of them runs: the batch fails with tenant_gone (its tenant
    was removed from the keys file, or the server started without it). A batch of another tenant runs."""
    ran = []

    async def execute(tenant, endpoint, body):
        ran.append(tenant)
        return LineOutcome(200, {"ok": True})

    async def scenario():
        store = BatchStore(tmp_path / "state")
        made = {}
        for tenant in ("key:gone", "key:here"):
            f = put_file(store, tmp_path, [line(0), line(1)], tenant=tenant)
            made[tenant] = store.create_batch(tenant, "/v1/completions", f["id"], "24h", None)["id"]
        runner = BatchRunner(store, execute, tenant_exists=lambda identity: identity != "key:gone")
        runner.start()
        deadline = asyncio.get_running_loop().time() + 20
        try:
            while {store.get_batch(t, b)["status"] for t, b in made.items()} - {"completed", "failed"}:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)
        finally:
            await runner.stop()
        return store, made

    store, made = asyncio.run(scenario())
    gone = store.get_batch("key:gone", made["key:gone"])
    assert gone["status"] == "failed" and gone["failed_at"] and gone["in_progress_at"] is None
    assert [e["code"] for e in json.loads(gone["errors"])] == ["tenant_gone"]
    assert (gone["total"], gone["output_file_id"], gone["error_file_id"]) == (0, None, None)
    assert store.get_batch("key:here", made["key:here"])["status"] == "completed" and ran == ["key:here"] * 2


def test_a_burst_of_busy_answers_pauses_once_and_the_pause_doubles_per_burst(tmp_path, monkeypatch):
    """The tenant's first lines go out together and are all refused (busy): that is one refusal of the tenant, a pause
    of BATCH_RETRY_S, not one doubling per line in flight (4 refusals would make it 8x); the next refusal, of a line
    sent after the pause, doubles it. Its lines run once the service takes them."""
    monkeypatch.setattr(batch_runner, "BATCH_RETRY_S", 0.3)
    calls: list[float] = []
    refuse = {"tries": 5}  # the first burst (4 lines in flight) and the one try after it

    async def execute(tenant, endpoint, body):
        calls.append(time.monotonic())
        if len(calls) <= refuse["tries"]:
            await asyncio.sleep(0.01)  # answers come back while the burst's other lines are in flight
            return LineOutcome(429, {"error": {"code": "rate_limit_exceeded"}}, retry=True)
        return LineOutcome(200, {"ok": True})

    run_batches(tmp_path, execute, {"key:t": 6}, 8, lambda s, m: done(s, m, "key:t"))
    first, second, third = calls[0], calls[4], calls[5]
    assert all(t - first < 0.1 for t in calls[:4]), calls  # the burst: the tenant's first four lines at once
    assert 0.3 - 0.01 <= second - first < 0.3 + batch_runner.TICK_S + 0.3, calls  # one pause, not doubled per line
    assert third - second >= 0.6 - 0.01, calls  # the next refusal doubled it
    assert len(calls) == 5 + 6

"""The Batch API's store and runner on their own (a real SQLite store in a temporary folder): the limits, results
recorded once, and the runner's concurrency: it backs off to one line at a time while more important work runs,
and grows back once it has been quiet. The lines run through an execute function of the test's (the whole HTTP path
is tested in test_batches.py: this checks the runner's policy, which the server's timing would blur)."""

from __future__ import annotations

import asyncio
import json

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
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}


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

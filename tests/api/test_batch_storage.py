"""What the Batch API stores is reclaimed and kept private, against a real `inferd serve` (echo workers) through the
official `openai` client: rounds of upload-run-delete leave the state folder the size it started at (a finished
batch's lines are deleted, the database shrinks, the WAL is truncated), everything in it is the server's user's
alone (0700 folders, 0600 files), a tenant's files are bounded by --batch-storage-per-tenant, and a finished batch
goes after --batch-retention."""

from __future__ import annotations

import io
import os
import sqlite3
import stat
import time
from pathlib import Path

import openai
import pytest

from batch_util import jsonl, wait_status

pytestmark = pytest.mark.timeout(300)


def start(tiny_llama_dir, tmp: Path, *extra: str):
    from servers import start_server

    return start_server(tiny_llama_dir, tmp / f"serve-{time.monotonic_ns()}.log", "--echo", "--max-model-len", "256",
                        "--state-dir", str(tmp / "state"), *extra, model_name="tiny")


def client_for(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def line(i: int, padding: int = 0) -> dict:
    # `stop` takes up to 16 strings of 1,024 characters: a valid request of ~16 KB
    stop = ["z" * 1000 + str(k) for k in range(padding)]
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"Say {i}", "max_tokens": 2, **({"stop": stop} if stop else {})}}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def stored_lines(state: Path) -> int:
    db = sqlite3.connect(state / "batches.sqlite3")
    try:
        return db.execute("SELECT COUNT(*) FROM lines").fetchone()[0]
    finally:
        db.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_upload_run_delete_leaves_the_state_folder_as_it_was_and_private(tiny_llama_dir, tmp_path):
    from servers import kill_group

    srv = start(tiny_llama_dir, tmp_path)
    state = tmp_path / "state"
    try:
        client = client_for(srv)
        start_bytes = folder_bytes(state)
        for round_ in range(3):
            data = jsonl([line(i, padding=16) for i in range(200)])  # ~3.2 MB
            f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
            b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            b = wait_status(client, b.id, ("completed", "failed"))
            assert b.status == "completed" and b.request_counts.completed == 200, b
            assert stored_lines(state) == 0  # the output file holds them now
            if round_ == 0:  # the server's user's alone
                db = state / "batches.sqlite3"
                assert mode(state) == 0o700 and mode(state / "files") == 0o700
                for path in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), state / "lock",
                             state / "files" / f.id, state / "files" / b.output_file_id):
                    assert mode(path) == 0o600, path
            for file_id in (f.id, b.output_file_id):
                assert client.files.delete(file_id).deleted
            assert not [p for p in (state / "files").iterdir()]
        grown = folder_bytes(state) - start_bytes
        assert grown < 256 << 10, f"the state folder grew {grown} bytes over 3 rounds of ~3.2 MB, all deleted"
        assert client.files.list().data == []
    finally:
        kill_group(srv.proc)


@pytest.fixture(scope="module")
def small_server(tiny_llama_dir, tmp_path_factory):
    from servers import kill_group

    tmp = tmp_path_factory.mktemp("batch-quota")
    srv = start(tiny_llama_dir, tmp, "--batch-storage-per-tenant", "100K", "--batch-retention", "2s")
    srv.state = tmp / "state"
    yield srv
    kill_group(srv.proc)


def test_a_tenants_files_are_bounded_by_its_storage_quota(small_server):
    client = client_for(small_server)
    data = jsonl([line(i, padding=4) for i in range(15)])  # ~60 KB: one fits in 100 KiB, two do not
    first = client.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
    with pytest.raises(openai.RateLimitError) as e:
        client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
    error = e.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "storage_quota_exceeded"
    assert "--batch-storage-per-tenant" in error["message"]
    assert [f.id for f in client.files.list().data] == [first.id]  # nothing of the refused upload stays
    assert len(list((small_server.state / "files").iterdir())) == 1
    client.files.delete(first.id)
    second = client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")  # room again
    client.files.delete(second.id)


def test_a_finished_batch_goes_after_the_retention_period(small_server):
    client = client_for(small_server)
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line(0), line(1)]))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    b = wait_status(client, b.id, ("completed", "failed"))
    assert b.status == "completed" and b.output_file_id
    deadline = time.monotonic() + 30  # --batch-retention 2s: swept within a second after that
    while True:
        try:
            client.batches.retrieve(b.id)
        except openai.NotFoundError:
            break
        assert time.monotonic() < deadline, "the finished batch was never removed"
        time.sleep(0.1)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(b.output_file_id)
    assert not (small_server.state / "files" / b.output_file_id).exists()
    assert client.files.retrieve(f.id).id == f.id  # the tenant's own upload stays until it deletes it
    client.files.delete(f.id)

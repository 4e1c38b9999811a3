"""The Batch API against real `inferd serve` processes on the tiny Llama, with the official `openai` client: a
200-line batch to completed, a server killed (kill -9) in the middle of a batch and started again on the same state
dir (every custom_id exactly once), cancel, expiry, malformed files and bad lines, limits."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from batch_util import jsonl, wait_status
from tests.conftest import TINY_MAX_MODEL_LEN

pytestmark = pytest.mark.timeout(300)


def start(tiny_llama_dir, tmp_path: Path, state_dir: Path, *extra: str, name: str = "batch"):
    from servers import start_server

    log = tmp_path / f"{name}-{time.monotonic_ns()}.log"
    return start_server(tiny_llama_dir, log, "--max-model-len", str(TINY_MAX_MODEL_LEN), "--kv-cache-bytes", "32M",
                        "--state-dir", str(state_dir), *extra, model_name="tiny")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    from servers import kill_group

    tmp = tmp_path_factory.mktemp("batches")
    srv = start(tiny_llama_dir, tmp, tmp / "state", "--batch-concurrency", "2")  # batches that last
    yield srv
    kill_group(srv.proc)


def client_for(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat_line(i: int, max_tokens: int = 6, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def read_jsonl(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def test_two_hundred_lines_through_the_official_client(server):
    client = client_for(server)
    lines = [chat_line(i) for i in range(200)]
    lines[8]["body"]["prompt_logprobs"] = 1  # vLLM's field goes through a batch line too
    f = client.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and client.files.retrieve(f.id).filename == "input.jsonl"
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "nightly"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "nightly"}
    b = wait_status(client, b.id, ("completed", "failed"), timeout=180)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (200, 200, 0)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.error_file_id is None
    out = read_jsonl(client, b.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(200)]  # each once, in input order
    direct = client.chat.completions.create(**lines[7]["body"])
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"
    assert out[7]["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    with_prompt = out[8]["response"]["body"]
    assert len(with_prompt["prompt_logprobs"]) == with_prompt["usage"]["prompt_tokens"]
    assert with_prompt["prompt_logprobs"][0] is None and all(len(p) >= 1 for p in with_prompt["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in out[7]["response"]["body"]
    listed = client.batches.list(limit=5)
    assert b.id in [x.id for x in listed.data]
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"
    with pytest.raises(openai.ConflictError):  # a finished batch cannot be cancelled
        client.batches.cancel(b.id)
    assert client.files.delete(f.id).deleted  # the input of a finished batch may go
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_bad_lines_land_in_the_error_file_and_malformed_files_fail_with_line_numbers(server):
    client = client_for(server)
    lines = [chat_line(0), chat_line(1, temperature=5), chat_line(2, frobnicate=1), chat_line(3)]
    f = client.files.create(file=("mixed.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    b = wait_status(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id, ("completed", "failed"), timeout=180)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 2)
    assert [o["custom_id"] for o in read_jsonl(client, b.output_file_id)] == ["req-0", "req-3"]
    errors = read_jsonl(client, b.error_file_id)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("req-1", 400), ("req-2", 400)]
    assert errors[1]["response"]["body"]["error"]["param"] == "frobnicate"

    bad = (jsonl([chat_line(0)]) + b"{not json\n" + jsonl([chat_line(0)]) +
           jsonl([{**chat_line(5), "url": "/v1/completions"}]) + jsonl([{**chat_line(6), "method": "GET"}]))
    f = client.files.create(file=("bad.jsonl", io.BytesIO(bad)), purpose="batch")
    b = wait_status(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id, ("failed",), timeout=180)
    found = [(e.line, e.code) for e in b.errors.data]
    assert found == [(2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "mismatched_url"),
                     (5, "invalid_method")]
    assert b.request_counts.total == 0 and b.output_file_id is None


def test_cancel_and_expiry(server):
    client = client_for(server)
    lines = [chat_line(i, max_tokens=60, ignore_eos=True) for i in range(200)]  # ~10 s of work
    f = client.files.create(file=("slow.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until = time.monotonic() + 60
    while client.batches.retrieve(b.id).request_counts.completed < 2:
        assert time.monotonic() < wait_until
        time.sleep(0.05)
    with pytest.raises(openai.BadRequestError) as err:  # the input of a running batch stays
        client.files.delete(f.id)
    assert err.value.body["param"] == "file_id"
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    c = wait_status(client, b.id, ("cancelled",), timeout=180)
    done = read_jsonl(client, c.output_file_id)
    unrun = read_jsonl(client, c.error_file_id)
    assert len(done) >= 2 and len(done) + len(unrun) == 200 and unrun
    assert sorted(o["custom_id"] for o in done + unrun) == sorted(f"req-{i}" for i in range(200))
    assert all(e["error"]["code"] == "batch_cancelled" for e in unrun)
    assert c.request_counts.completed == len(done) and c.request_counts.failed == len(unrun)
    assert client.batches.cancel(b.id).status == "cancelled"  # cancelling again changes nothing

    many = [chat_line(i, max_tokens=60, ignore_eos=True) for i in range(200)]  # far more than 2 s of work
    g = client.files.create(file=("long.jsonl", io.BytesIO(jsonl(many))), purpose="batch")
    e = client.batches.create(input_file_id=g.id, endpoint="/v1/chat/completions", completion_window="2s")
    e = wait_status(client, e.id, ("expired",), timeout=60)
    done, unrun = read_jsonl(client, e.output_file_id), read_jsonl(client, e.error_file_id)
    assert len(done) + len(unrun) == 200 and len(unrun) > 0 and e.expired_at
    assert all(x["error"]["code"] == "batch_expired" for x in unrun)


def test_kill_minus_nine_mid_batch_resumes_and_every_custom_id_appears_once(tiny_llama_dir, tmp_path):
    """While the server lives its state folder is locked (a second server would run without the Batch API rather than
    run the same batch twice). Killed mid-batch, with what crashes leave in the folder (a partial upload, a partial
    output file, an output file written but never recorded), the next server on the folder drops those, keeps every
    recorded file, and finishes the batch with every custom_id once."""
    import fcntl

    from servers import kill_group

    state = tmp_path / "state"
    srv = start(tiny_llama_dir, tmp_path, state, "--batch-concurrency", "4", name="first")
    client = client_for(srv)
    lines = [chat_line(i, max_tokens=16, ignore_eos=True) for i in range(40)]
    f = client.files.create(file=("crash.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(b.id).request_counts.completed < 12:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with open(state / "lock", "a") as lock:  # held by the living server
        with pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    files = state / "files"
    on_disk = {p.name for p in files.iterdir()}
    leftovers = [files / ".upload-k2j4h1", files / f".file-{'ab' * 12}.tmp", files / f"file-{'cd' * 12}"]
    for path in leftovers:
        path.write_bytes(b'{"custom_id": "partial"')
    kill_group(srv.proc)  # SIGKILL to the server and its worker, lines in flight
    srv = start(tiny_llama_dir, tmp_path, state, name="second")
    try:
        assert not [p.name for p in leftovers if p.exists()]  # dropped before the server said READY
        client = client_for(srv)
        done = wait_status(client, b.id, ("completed",), timeout=180)
        out = read_jsonl(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(40))  # each exactly once
        assert (done.request_counts.completed, done.request_counts.failed) == (40, 0)
        assert done.error_file_id is None
        assert {x.id for x in client.files.list().data} == {f.id, done.output_file_id}
        assert {p.name for p in files.iterdir()} == on_disk | {done.output_file_id}  # every recorded file kept
    finally:
        kill_group(srv.proc)


def test_limits_and_refusals(server):
    client = client_for(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    import socket

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # refused on its header, body unsent
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: localhost\r\nContent-Type: multipart/form-data; "
                     b"boundary=b\r\nContent-Length: %d\r\n\r\n" % (1 << 40))
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    r = httpx.post(server.url + "/v1/files", content=b"--b--\r\n", headers={"content-type": "multipart/form-data"})
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id="file-none", endpoint="/v1/edits", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-none", endpoint="/v1/completions", completion_window="24h")
    f = client.files.create(file=("one.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="forever")
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")

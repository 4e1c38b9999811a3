"""The offline CLI as a user runs it: `inferd generate` and `inferd chat` in real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.models.build import load_model

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def inferd(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferd", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env=ENV)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    model, cfg, tok = load_model(str(tiny_llama_dir), dtype=torch.float32)
    return Engine(model, cfg, EngineConfig(kv_cache_bytes=64 << 20), torch.float32, tok)


def test_generate_prints_the_engines_completion(tiny_llama_dir, tiny_engine):
    prompt = "The quick brown fox"
    out = inferd("generate", prompt, "--model", str(tiny_llama_dir), "--max-tokens", "12", "--ignore-eos",
                 "--dtype", "float32", "--kv-cache-bytes", "64M")
    assert out.returncode == 0, out.stderr
    tok = tiny_engine.tokenizer
    [req] = tiny_engine.generate([tok.encode(prompt)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    expected = tok.decode(req.output_token_ids)
    assert expected.strip() and out.stdout == expected + "\n"


def test_generate_rejects_bad_input_with_a_clear_error(tiny_llama_dir):
    # the two runs side by side: each is seconds of imports and loading on one core
    with ThreadPoolExecutor(2) as pool:
        zero, too_long = pool.map(lambda n: inferd("generate", "hello", "--model", str(tiny_llama_dir),
                                                   "--max-tokens", n), ["0", "5000"])
    assert zero.returncode == 2 and "max_tokens" in zero.stderr and "Traceback" not in zero.stderr
    assert too_long.returncode == 2 and "context window" in too_long.stderr


def test_chat_streams_replies_turn_by_turn(smollm2_gguf_path):
    out = inferd("chat", "--max-tokens", "24", "--temperature", "0", "--dtype", "float32",
                 "--kv-cache-bytes", "128M", stdin="What is the capital of France?\n/reset\nSay hi.\n")
    assert out.returncode == 0, out.stderr
    replies = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(replies) >= 2
    assert "Paris" in out.stdout  # SmolLM2-Instruct knows this one, greedily

"""`--dtype auto` and what `make serve` runs on a machine with native bf16 (AVX-512 BF16 or AMX): the default model
served in bf16, end to end. $INFERD_AUTO_DTYPE makes `auto` mean bf16 or fp32 whatever this CPU has, so that both
kinds of machine are exercised on any machine (`INFERD_AUTO_DTYPE=bfloat16 make test`)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from inferd.config import AUTO_DTYPE_ENV, cpu_has_native_bf16, resolve_dtype

# SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x head_dim 64 per token
SMOLLM2_KV_VALUES_PER_TOKEN = 30 * 2 * 3 * 64
BLOCK_SIZE = 16


def test_auto_follows_the_cpu_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    assert resolve_dtype("auto") == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")
    assert resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16  # an explicit dtype is never overridden
    monkeypatch.setenv(AUTO_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match=AUTO_DTYPE_ENV):
        resolve_dtype("auto")


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory):
    from servers import kill_group, start_server

    log = tmp_path_factory.mktemp("bf16-server") / "serve.log"
    # no prefix caching: the second request computes exactly what the first did (in bf16 a cached prefix changes
    # the arithmetic of the rest of the prompt, and a near-tie could then go the other way)
    server = start_server(None, log, "--dtype", "auto", "--kv-cache-bytes", "64M", "--heartbeat-interval", "0.1",
                          "--no-prefix-caching", model_name="smollm2-auto", env={AUTO_DTYPE_ENV: "bfloat16"})
    yield server
    kill_group(server.proc)


def test_a_bf16_server_serves_chat_and_streams(bf16_server):
    server = bf16_server
    assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
    # the KV pool holds bf16 values: twice the blocks fp32 would give in the same bytes
    blocks = server.wait_metrics(lambda m: m.get('inferd_kv_blocks_total{model="smollm2-auto"}', 0) > 0)[
        'inferd_kv_blocks_total{model="smollm2-auto"}']
    assert blocks == (64 << 20) // (SMOLLM2_KV_VALUES_PER_TOKEN * BLOCK_SIZE * 2)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content.strip()
    assert 1 <= reply.usage.completion_tokens <= 12
    pieces, finish = [], None
    for chunk in client.chat.completions.create(model=server.model, messages=messages, max_tokens=12,
                                                temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == choice.message.content  # greedy: the same text streamed as in one piece
    assert finish == choice.finish_reason
    # /metrics counted both generations and their tokens (waited for: counted as the gateway settles them)
    finished = f'inferd_request_finished_total{{finish_reason="{choice.finish_reason}"}}'
    m = server.wait_metrics(lambda m: m.get(finished, 0) >= 2)
    assert m[finished] == 2 and m["inferd_generation_tokens_total"] == 2 * reply.usage.completion_tokens
    assert m['inferd_kv_blocks_total{model="smollm2-auto"}'] == blocks

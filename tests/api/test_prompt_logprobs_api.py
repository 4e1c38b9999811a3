"""Prompt logprobs through the API on the default model (float32): /v1/completions' `echo` with `logprobs` and
`max_tokens` 0 (what lm-evaluation-harness sends), vLLM's `prompt_logprobs` on both endpoints, streamed and not, with
n > 1 and stop strings; each position equal to the offline engine's by the exactness rule. (Against transformers:
tests/engine/test_prompt_logprobs.py; with a failover replay: tests/cluster/test_failover.py; in a batch:
tests/api/test_batches.py; lm-evaluation-harness end to end: tests/evaluation/test_lm_eval.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

from inferd.engine import SamplingParams
from parity import FP32, scale_of

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def http(smollm2_server):
    with httpx.Client(base_url=smollm2_server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def offline(smollm2_engine, smollm2_tokenizer):
    """The offline engine's prompt logprobs (top 3) of PROMPT: the reference."""
    ids = smollm2_tokenizer.encode(PROMPT)
    rid = smollm2_engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    entries = None
    while smollm2_engine.has_unfinished_requests():
        for out in smollm2_engine.step():
            if out.request_id == rid and out.prompt_logprobs is not None:
                entries = out.prompt_logprobs
    return ids, entries


def close(ours: float, ref: float, top) -> bool:
    return abs(ours - ref) <= 2 * FP32.tolerance(scale_of([v for _, v in top] + [ref]))


def test_echo_with_max_tokens_zero_is_the_prompt_and_its_logprobs(http, offline, smollm2_server):
    ids, ref = offline
    body = {"model": smollm2_server.model, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 3,
            "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    for p in range(1, len(ids)):
        e = ref[p]
        assert close(lp["token_logprobs"][p], e.logprob, e.top), f"position {p}"
        assert len(lp["top_logprobs"][p]) <= 3
        assert max(lp["top_logprobs"][p].values()) == pytest.approx(e.top[0][1], abs=1e-3)


def test_echo_n_and_stop_and_the_prompt_logprobs_field(http, offline, smollm2_server):
    """echo with a completion: each of n=2 choices starts with the prompt (a stop string inside the prompt does not
    end anything), its logprobs are the prompt's and then the completion's, and vLLM's prompt_logprobs field is
    there (top 2, each position holding the prompt's token with its rank)."""
    ids, ref = offline
    body = {"model": smollm2_server.model, "prompt": PROMPT, "max_tokens": 6, "echo": True, "logprobs": 1,
            "temperature": 0.8, "seed": 3, "n": 2, "stop": ["fox"], "prompt_logprobs": 2,
            "return_tokens_as_token_ids": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for c in choices:
        assert c["text"].startswith(PROMPT) and "fox" not in c["text"][len(PROMPT):]
        tokens = [int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
        assert tokens[:len(ids)] == ids and len(tokens) > len(ids)
        assert all(v is not None for v in c["logprobs"]["token_logprobs"][len(ids):])
        field = c["prompt_logprobs"]
        assert len(field) == len(ids) and field[0] is None
        for p in range(1, len(ids)):
            mine = field[p][str(ids[p])]
            assert close(mine["logprob"], ref[p].logprob, ref[p].top) and mine["rank"] >= 1
            assert 1 <= len(field[p]) <= 3  # the prompt's token and the top 2 (one of which it may be)


def test_streamed_echo_and_chat_prompt_logprobs(http, offline, smollm2_server):
    ids, ref = offline
    body = {"model": smollm2_server.model, "prompt": PROMPT, "max_tokens": 3, "echo": True, "prompt_logprobs": 0,
            "temperature": 0, "stream": True}
    chunks = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"].startswith(PROMPT)
    carrying = [c for c in chunks if "prompt_logprobs" in c]
    assert carrying == chunks[:1] and len(chunks[0]["prompt_logprobs"]) == len(ids)
    chat = {"model": smollm2_server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
            "prompt_logprobs": 1, "temperature": 0}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["prompt_logprobs"]) == out["usage"]["prompt_tokens"] and out["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in out["choices"][0]


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
])
def test_bad_values_are_400s(http, smollm2_server, body, param):
    r = http.post("/v1/completions", json={"model": smollm2_server.model, "prompt": "Hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param

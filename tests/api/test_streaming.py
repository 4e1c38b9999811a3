"""SSE exactly as OpenAI frames it, checked byte by byte with httpx, 32 concurrent streams that each equal their
offline result, and the seeds of sampled choices (tiny model)."""

from __future__ import annotations

import asyncio
import random

import httpx
from offline import assert_same_greedy, offline_greedy, token_ids

from servers import sse_data

NUM_STREAMS = 32
MAX_TOKENS = 20


def parse_sse(body: bytes) -> list[dict | str]:
    """Events of an SSE body, checking the framing: every event is one `data: ` line followed by a blank line, the
    last is `[DONE]`, nothing else is sent."""
    assert body.endswith(b"\n\n"), body[-80:]
    for raw in body[:-2].split(b"\n\n"):
        assert raw.startswith(b"data: ") and b"\n" not in raw, raw[:200]
    out = sse_data(body)
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


def check_chunks(chunks: list[dict], chat: bool, n: int, include_usage: bool) -> dict[int, dict]:
    """Shape of every chunk; returns per choice index its text, token ids, logprobs and finish reason."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    choices: dict[int, dict] = {}
    body = chunks[:-1] if include_usage else chunks
    for chunk in body:
        assert chunk["object"] == obj and len(chunk["choices"]) == 1
        assert ("usage" in chunk and chunk["usage"] is None) if include_usage else "usage" not in chunk
        c = chunk["choices"][0]
        state = choices.setdefault(c["index"], {"text": "", "ids": [], "logprobs": [], "finish": None,
                                                "role_first": None})
        assert state["finish"] is None, "a chunk after the choice finished"
        if chat:
            delta = c["delta"]
            if state["role_first"] is None:
                state["role_first"] = delta == {"role": "assistant", "content": ""}
            else:
                assert "role" not in delta
            state["text"] += delta.get("content", "")
            entries = (c["logprobs"] or {}).get("content") or []
            state["ids"] += token_ids([e["token"] for e in entries])
            state["logprobs"] += [e["logprob"] for e in entries]
        else:
            state["text"] += c["text"]
            if c["logprobs"]:
                state["ids"] += token_ids(c["logprobs"]["tokens"])
                state["logprobs"] += c["logprobs"]["token_logprobs"]
        state["finish"] = c["finish_reason"]
    assert sorted(choices) == list(range(n))
    assert all(s["finish"] in ("stop", "length") for s in choices.values())
    if chat:
        assert all(s["role_first"] for s in choices.values())
    if include_usage:
        last = chunks[-1]
        assert last["choices"] == [] and last["object"] == obj
        usage = last["usage"]
        assert usage["completion_tokens"] == sum(len(s["ids"]) for s in choices.values())
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return choices


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1000, vocab) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def test_32_concurrent_streams_equal_offline(tiny_server, tiny_engine):
    prompts = _prompts(NUM_STREAMS, tiny_engine.model_config.vocab_size)

    async def one(client: httpx.AsyncClient, i: int):
        chat = i % 2 == 1
        body = {"model": tiny_server.model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_tokens_as_token_ids": True,
                "stream_options": {"include_usage": True}}
        if chat:  # a chat request whose rendered prompt is checked through /tokenize below
            body |= {"messages": [{"role": "user", "content": f"message {i}"}], "logprobs": True}
            url = "/v1/chat/completions"
        else:
            body |= {"prompt": prompts[i], "logprobs": 0}
            url = "/v1/completions"
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = await r.aread()
        return chat, body, parse_sse(raw)

    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url, headers=tiny_server.headers, timeout=300,
                                     limits=httpx.Limits(max_connections=NUM_STREAMS)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_STREAMS)))

    results = asyncio.run(main())
    tok = tiny_engine.tokenizer
    for i, (chat, body, chunks) in enumerate(results):
        [state] = check_chunks(chunks, chat, 1, include_usage=True).values()
        prompt = tok.apply_chat_template(body["messages"], add_generation_prompt=True) if chat else body["prompt"]
        assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt)
        tokens, logits = offline_greedy(tiny_engine, prompt, MAX_TOKENS, ignore_eos=True)
        matched = assert_same_greedy(state["ids"], state["logprobs"], tokens, logits, f"stream {i}")
        if matched == MAX_TOKENS:
            assert state["text"] == tok.decode(tokens), f"stream {i}"


def test_n_choices_stream_and_finish_chunks(tiny_server):
    body = {"model": tiny_server.model, "prompt": ["one", "two"], "n": 3, "max_tokens": 5, "temperature": 0.8,
            "seed": 5, "stream": True, "ignore_eos": True}
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers=tiny_server.headers, timeout=120)
    assert r.status_code == 200
    chunks = parse_sse(r.content)
    choices = check_chunks(chunks, chat=False, n=6, include_usage=False)
    assert all(s["finish"] == "length" for s in choices.values())
    # the same request without streaming gives the same texts (same seeds per choice)
    body["stream"] = False
    whole = httpx.post(tiny_server.url + "/v1/completions", json=body, headers=tiny_server.headers, timeout=120)
    assert {c["index"]: c["text"] for c in whole.json()["choices"]} == {i: s["text"] for i, s in choices.items()}
    assert whole.json()["usage"]["completion_tokens"] == 30


def test_unseeded_requests_sample_differently(tiny_server):
    """Two requests without a seed for the same prompt at temperature 1 are sampled with seeds of their own, so they
    differ. Equal with probability sum over sequences s of P(s)^2 <= max_s P(s): the tiny model's 49152-token
    distributions are flat at temperature 1 (its greedy 32-token path has P < 1e-80), so never by chance."""
    body = {"model": tiny_server.model, "prompt": "one two three", "max_tokens": 32, "temperature": 1.0,
            "ignore_eos": True}
    texts = []
    for _ in range(2):
        r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers=tiny_server.headers, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 32
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] != texts[1], texts

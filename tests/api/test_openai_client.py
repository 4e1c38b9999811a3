"""The official `openai` client, sync and async, streaming and not, completions and chat, against a real server on
the default model: greedy outputs equal the offline engine's, token for token (exactness rule)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from offline import assert_same_greedy, offline_greedy, token_ids

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."}]
MAX_TOKENS = 24
AS_IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def async_client(smollm2_server):
    return openai.AsyncOpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# prompt ids -> the offline engine's greedy tokens and logits: the tests compare 4 prompts 8 times, and the
# offline run (alone in its batch, deterministic) is seconds of this process on a busy 2-core machine
_OFFLINE: dict[tuple[int, ...], tuple] = {}


def _offline(smollm2_engine, prompt_ids: list[int]):
    key = tuple(prompt_ids)
    if key not in _OFFLINE:
        _OFFLINE[key] = offline_greedy(smollm2_engine, prompt_ids, MAX_TOKENS, ignore_eos=True)
    return _OFFLINE[key]


def _check(served_ids, served_logprobs, text, smollm2_engine, prompt_ids, label):
    tokens, logits = _offline(smollm2_engine, prompt_ids)
    matched = assert_same_greedy(served_ids, served_logprobs, tokens, logits, label)
    if matched == len(tokens):
        assert text == smollm2_engine.tokenizer.decode(tokens), label
    return matched


def test_models(client, smollm2_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [smollm2_server.model]
    assert client.models.retrieve(smollm2_server.model).id == smollm2_server.model


def test_completions_sync(client, smollm2_server, smollm2_engine):
    for prompt in PROMPTS:
        r = client.completions.create(model=smollm2_server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=1, extra_body={"ignore_eos": True, **AS_IDS})
        choice = r.choices[0]
        assert choice.finish_reason == "length"
        assert r.usage.completion_tokens == MAX_TOKENS
        ids = smollm2_engine.tokenizer.encode(prompt)
        assert r.usage.prompt_tokens == len(ids)
        _check(token_ids(choice.logprobs.tokens), choice.logprobs.token_logprobs, choice.text, smollm2_engine, ids,
               prompt)


def test_completions_sync_stream(client, smollm2_server, smollm2_engine):
    prompt = PROMPTS[1]
    stream = client.completions.create(model=smollm2_server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, **AS_IDS})
    text, tokens, logprobs, finish, usage = "", [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            tokens += token_ids(c.logprobs.tokens)
            logprobs += c.logprobs.token_logprobs
        finish = c.finish_reason or finish
    assert finish == "length" and usage.completion_tokens == MAX_TOKENS
    _check(tokens, logprobs, text, smollm2_engine, smollm2_engine.tokenizer.encode(prompt), "stream")


def test_chat_sync_and_stream_agree(client, smollm2_server, smollm2_engine):
    prompt_ids = smollm2_engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    r = client.chat.completions.create(model=smollm2_server.model, messages=CHAT, max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True, **AS_IDS})
    choice = r.choices[0]
    assert choice.message.role == "assistant" and r.usage.prompt_tokens == len(prompt_ids)
    content = choice.logprobs.content
    assert all(len(t.top_logprobs) == 2 for t in content)
    _check(token_ids([t.token for t in content]), [t.logprob for t in content], choice.message.content,
           smollm2_engine, prompt_ids, "chat")

    stream = client.chat.completions.create(model=smollm2_server.model, messages=CHAT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_concurrent(async_client, smollm2_server, smollm2_engine):
    """Async, concurrent: one streaming chat and two non-streaming completions batched together by the engine."""

    async def chat_stream():
        stream = await async_client.chat.completions.create(
            model=smollm2_server.model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            logprobs=True, extra_body={"ignore_eos": True, **AS_IDS})
        tokens, logprobs, text = [], [], ""
        async for chunk in stream:
            c = chunk.choices[0]
            text += c.delta.content or ""
            if c.logprobs is not None:
                tokens += token_ids([t.token for t in c.logprobs.content])
                logprobs += [t.logprob for t in c.logprobs.content]
        return tokens, logprobs, text

    async def completion(prompt):
        r = await async_client.completions.create(model=smollm2_server.model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, logprobs=0,
                                                  extra_body={"ignore_eos": True, **AS_IDS})
        c = r.choices[0]
        return token_ids(c.logprobs.tokens), c.logprobs.token_logprobs, c.text

    async def main():
        return await asyncio.gather(chat_stream(), completion(PROMPTS[0]), completion(PROMPTS[2]))

    (chat, first, third) = asyncio.run(main())
    tok = smollm2_engine.tokenizer
    _check(*chat, smollm2_engine, tok.apply_chat_template(CHAT, add_generation_prompt=True), "async chat")
    _check(*first, smollm2_engine, tok.encode(PROMPTS[0]), "async completion 0")
    _check(*third, smollm2_engine, tok.encode(PROMPTS[2]), "async completion 2")


def test_errors_map_to_client_exceptions(client, smollm2_server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=smollm2_server.model, messages=CHAT, max_tokens=1,
                                       tools=[{"type": "function", "function": {"name": "f"}}], store=True)
    assert e.value.body["param"] == "store" and e.value.body["code"] == "unsupported_parameter"


def test_seeded_sampling_is_reproducible_and_n_choices_differ(client, smollm2_server):
    kwargs = dict(model=smollm2_server.model, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=1234, n=3,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # each choice has its own seed
    assert a.usage.completion_tokens == 3 * 16 and a.usage.prompt_tokens == b.usage.prompt_tokens

"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) with the official `anthropic` client against
a real `inferd serve` of the default model started with a keys file (the requests give their key as `x-api-key`, or
as a Bearer token where this version of the client does): text, system and stop sequences, max_tokens, a forced tool
call and its result, streams (the helper's text and final message, the raw event order), errors in Anthropic's shape
(401, 400, 404, 413, 429 with Retry-After), and the same greedy text as /v1/chat/completions (the translation is the
chat path's). The translation and the error shape on their own are checked without the server at the end."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest

from inferd.api.anthropic_messages import error_event, to_chat_request
from inferd.api.anthropic_schemas import MessagesRequest
from inferd.api.errors import APIError, response_for
from inferd.gateway.admission import QueueTimeout
from inferd.gateway.tenants import create_key
from inferd.worker.client import WorkerDead
from servers import kill_group, sse_data, start_server

MODEL = "smollm2"
T0 = {"temperature": 0}  # (the client no longer has the sampling parameters; the API, vLLM and inferd take them)
USER = [{"role": "user", "content": "Name three primary colors."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, tenant -> key): `agent` unlimited, `limited` one request a minute."""
    folder = tmp_path_factory.mktemp("anthropic")
    keys = {name: create_key(str(folder / "keys.json"), name, **settings)[0]
            for name, settings in (("agent", {}), ("limited", {"rpm": 1}))}
    server = start_server(None, folder / "serve.log", "--kv-cache-bytes", "256M", "--heartbeat-interval", "0.1",
                          "--max-body-bytes", "64K", "--keys", str(folder / "keys.json"), model_name=MODEL)
    yield server, keys
    kill_group(server.proc)


@pytest.fixture(scope="module")
def client(served):
    """The key as `x-api-key` (what Claude Code and the SDK's earlier versions send; this version sends api_key as
    a Bearer token, which the wrong-key test below uses), and no Authorization header even if $ANTHROPIC_API_KEY
    is set."""
    server, keys = served
    return anthropic.Anthropic(base_url=server.url, api_key=None, max_retries=0, timeout=120,
                               default_headers={"x-api-key": keys["agent"], "Authorization": anthropic.omit})


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


@pytest.fixture(scope="module")
def greedy(client):
    """The greedy answer to USER (24 tokens at most), which several tests compare against."""
    return client.messages.create(model=MODEL, max_tokens=24, extra_body=T0, messages=USER)


def test_create_gives_a_message(client, greedy, smollm2_tokenizer):
    m = greedy
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    prompt = smollm2_tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    # Anthropic counts the cached prompt tokens apart from input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt)
    assert 1 <= m.usage.output_tokens <= 24
    assert client.messages.count_tokens(model=MODEL, messages=USER).input_tokens == len(prompt)


def test_the_same_greedy_text_as_chat_completions(served, greedy):
    server, keys = served
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=keys["agent"], max_retries=0, timeout=120)
    r = chat.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == _text(greedy)
    assert {"length": "max_tokens", "stop": "end_turn"}[r.choices[0].finish_reason] == greedy.stop_reason


def test_system_blocks_and_stop_sequences(client, smollm2_tokenizer):
    system = [{"type": "text", "text": "You are a painter.", "cache_control": {"type": "ephemeral"}}]
    whole = client.messages.create(model=MODEL, max_tokens=24, extra_body=T0, system=system, messages=USER)
    text = _text(whole)
    words = re.findall(r"[A-Za-z]{4,}", text)
    assert len(words) >= 2, text
    stop = words[1]  # a word of the greedy answer that is not its start: the answer stops right before it
    m = client.messages.create(model=MODEL, max_tokens=24, extra_body=T0, system=system, messages=USER,
                               stop_sequences=["@@never@@", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == text[:text.index(stop)]
    # the system text reached the prompt: the count is the template's with it as the system message
    rendered = smollm2_tokenizer.apply_chat_template([{"role": "system", "content": "You are a painter."}, *USER],
                                                     add_generation_prompt=True)
    assert client.messages.count_tokens(model=MODEL, system=system, messages=USER).input_tokens == len(rendered)


def test_max_tokens_reached(client):
    m = client.messages.create(model=MODEL, max_tokens=3, extra_body=T0,
                               messages=[{"role": "user", "content": "Write a long story about a dragon."}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def test_a_forced_tool_call_and_its_result(client):
    m = client.messages.create(model=MODEL, max_tokens=60, messages=TOOL_ASK, tools=[WEATHER], extra_body=T0,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use", m
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    assert isinstance(calls[0].input, dict)
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    messages = [*TOOL_ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                              "content": [{"type": "text", "text": "21 degrees, sunny"}]},
                                             {"type": "text", "text": "Thanks. Summarize it."}]}]
    final = client.messages.create(model=MODEL, max_tokens=8, extra_body=T0, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "none"})
    assert final.stop_reason in ("end_turn", "max_tokens") and _text(final)
    assert not [b for b in final.content if b.type == "tool_use"]


def test_stream_helper_gives_the_text_and_final_message(client, greedy):
    with client.messages.stream(model=MODEL, max_tokens=24, extra_body=T0, messages=USER) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(final) == _text(greedy)
    assert final.stop_reason == greedy.stop_reason and final.usage.output_tokens == greedy.usage.output_tokens


def test_raw_event_order(served, client):
    """Through the client, and raw: each event's `event:` line names its data's type, and the ping the client drops
    follows message_start. (Streamed tool_use blocks: tests/api/test_reasoning_api.py, on a scripted server.)"""
    server, keys = served
    body = {"model": MODEL, "max_tokens": 5, "messages": USER}
    events = list(client.messages.create(**body, extra_body=T0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"], kinds
    assert set(kinds[2:-3]) == {"content_block_delta"}, kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 5
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, **T0, "stream": True}, timeout=120,
                      headers={"x-api-key": keys["agent"]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    names = re.findall(r"^event: (\S+)$", raw, re.M)
    assert names == [d["type"] for d in sse_data(raw)] == kinds[:1] + ["ping"] + kinds[1:]


def test_errors_are_in_anthropics_shape(served, client):
    server, keys = served
    bad_key = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_key.messages.create(model=MODEL, max_tokens=4, messages=USER)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:  # validation (a 400, never FastAPI's 422)
        client.messages.create(model=MODEL, max_tokens=0, messages=USER)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "'image'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # unknown fields are refused, as Anthropic does
        client.messages.create(model=MODEL, max_tokens=4, messages=USER, extra_body={"frequency": 1})
    assert "frequency" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.RequestTooLargeError) as e:  # the body-limit middleware's 413
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x" * 70_000}])
    assert e.value.body["error"]["type"] == "request_too_large"
    # the other APIs keep OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 0},
                   headers={"x-api-key": keys["agent"]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_rate_limit_is_a_429_with_retry_after(served):
    server, keys = served
    limited = anthropic.Anthropic(base_url=server.url, api_key=keys["limited"], max_retries=0, timeout=120)
    limited.messages.create(model=MODEL, max_tokens=1, messages=USER)  # its one request this minute
    with pytest.raises(anthropic.RateLimitError) as e:
        limited.messages.create(model=MODEL, max_tokens=1, messages=USER)
    assert e.value.body["error"]["type"] == "rate_limit_error"
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_keys_as_bearer_or_x_api_key(served):
    server, keys = served
    url, body = server.url + "/v1/messages/count_tokens", {"model": MODEL, "messages": USER}
    for headers in ({"x-api-key": keys["agent"]}, {"Authorization": f"Bearer {keys['agent']}"},
                    {"x-api-key": keys["agent"], "Authorization": f"Bearer {keys['agent']}"}):
        assert httpx.post(url, json=body, headers=headers).status_code == 200, headers
    # two different keys: refused, whichever is valid (which tenant pays must not depend on a header's order)
    r = httpx.post(url, json=body, headers={"x-api-key": keys["agent"], "Authorization": "Bearer sk-other"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "two different" in r.json()["error"]["message"]
    r = httpx.post(url, json=body)
    assert r.status_code == 401 and "x-api-key" in r.json()["error"]["message"]


def test_requests_are_counted_by_route(served, greedy):
    server, keys = served
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'inferd_requests_total\{route="/v1/messages",status="200"\} [1-9]', text), text


# ---- without the server ----------------------------------------------------------------------------------------
def _chat(body: dict) -> dict:
    return to_chat_request(MessagesRequest.model_validate({"model": MODEL, "max_tokens": 8, **body})).model_dump(
        exclude_none=True, exclude_defaults=True)


def test_translation_of_tool_turns_and_choices():
    chat = _chat({"system": "Be brief.", "stop_sequences": ["END"], "top_k": 5, "metadata": {"user_id": "u1"},
                  "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                  "messages": [
                      {"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": [
                          {"type": "thinking", "thinking": "hm", "signature": "s"},
                          {"type": "text", "text": "Checking."},
                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                           "input": {"city": "Oslo", "unit": "celsius"}}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold", "is_error": False},
                          {"type": "text", "text": "And now?"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
         "tool_calls": [{"id": "toolu_1", "function": {"name": "get_weather",
                                                       "arguments": '{"city":"Oslo","unit":"celsius"}'}}]},
        {"role": "tool", "content": "cold", "tool_call_id": "toolu_1"},
        {"role": "user", "content": [{"type": "text", "text": "And now?"}]}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert chat["stop"] == ["END"] and chat["top_k"] == 5 and chat["user"] == "u1" and chat["max_tokens"] == 8
    named = _chat({"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    result = {"type": "tool_result", "tool_use_id": "t", "is_error": True,
              "content": [{"type": "text", "text": "boom"}]}
    failed = _chat({"messages": [{"role": "user", "content": [result]}]})
    assert failed["messages"] == [{"role": "tool", "content": "Error: boom", "tool_call_id": "t"}]


@pytest.mark.parametrize("body, param", [
    ({"messages": [*USER, {"role": "assistant", "content": "Red,"}]}, "messages.1"),  # prefill
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}, *USER]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                      "input": {"x": float("nan")}}]}, *USER]},
     "messages.0.content.0"),  # (Python's JSON parser lets NaN into a body)
])
def test_what_cannot_be_served_is_a_400_naming_it(body, param):
    with pytest.raises(APIError) as e:
        _chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_error_shape_keeps_status_and_headers():
    error = APIError(503, "overloaded", code="overloaded", headers={"Retry-After": "2"})
    r = response_for("/v1/messages", error)
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert json.loads(r.body) == {"type": "error", "error": {"type": "overloaded_error", "message": "overloaded"}}
    failed = response_for("/v1/messages/count_tokens", APIError(500, "x"))
    assert json.loads(failed.body)["error"]["type"] == "api_error"
    assert json.loads(response_for("/v1/chat/completions", error).body)["error"]["code"] == "overloaded"
    assert json.loads(response_for("/v1/messagesX", error).body)["error"]["code"] == "overloaded"


def test_a_failure_in_a_stream_is_an_error_event():
    """What a stream that has started writes when its request fails (the delivery's stream_error, and the Shape's
    stream on a failure after the first event)."""
    for failure, kind in ((QueueTimeout(3.0), "overloaded_error"), (WorkerDead("gone"), "overloaded_error"),
                          (RuntimeError("bug"), "api_error")):
        chunk = error_event(failure).decode()
        assert chunk.startswith("event: error\ndata: ") and chunk.endswith("\n\n")
        [data] = sse_data(chunk)
        assert data["type"] == "error" and data["error"]["type"] == kind and set(data["error"]) == {"type", "message"}
        assert "bug" not in chunk  # an unexpected error names the request id, not its inside

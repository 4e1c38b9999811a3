"""OpenAI's Responses API (`POST /v1/responses`) through the official `openai` client against a real server on the
default model: text and message input, instructions, max_output_tokens, text.format json_schema, function tools and
their outputs sent back, both streaming paths (`create(stream=True)` and the `responses.stream` helper), the errors,
and that a client leaving mid-stream frees its request. Greedy (temperature 0) answers are compared with chat
completions': the translation is the chat request itself. The translation's refusals are checked without a server."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter
from test_disconnect import _idle, _kv_in_use, _running, _steps

from inferd.api.errors import APIError
from inferd.api.responses_api import output_items, response_head, to_chat_request
from inferd.api.responses_schema import ResponsesRequest
from inferd.api.responses_stream import EventWriter
from inferd.api.tools import ToolCall
from inferd.gateway.admission import QueueTimeout

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
INSTRUCTIONS = "You are a concise assistant."
QUESTION = "Name three primary colors."
MAX = 24
EVENT = TypeAdapter(ResponseStreamEvent)  # the client's own types, validated (the client itself does not validate)


def _raw_events(chunks) -> list[dict]:
    """SSE blocks as OpenAI writes them: an `event:` line naming the type its `data:` line carries, each data
    valid as the openai client's event types."""
    events = []
    for block in b"".join(chunks).decode().split("\n\n"):
        if not block or block.startswith(":"):
            continue
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == "event: " + data["type"]
        EVENT.validate_python(data)
        events.append(data)
    return events


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _text_events(events) -> tuple[list[str], str]:
    """The event types in order, with the text deltas joined."""
    return [e.type for e in events], "".join(e.delta for e in events if e.type == "response.output_text.delta")


# ---- text -------------------------------------------------------------------------------------------------------
def test_text_input_gives_a_response_object(client, smollm2_server):
    r = client.responses.create(model=smollm2_server.model, input="The capital of France is", temperature=0,
                                max_output_tokens=MAX, metadata={"who": "test"}, store=True)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == smollm2_server.model
    assert r.status in ("completed", "incomplete") and r.error is None
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.output_text == item.content[0].text and r.output_text
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.usage.output_tokens > 0
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.store is False and r.metadata == {"who": "test"} and r.temperature == 0 and r.max_output_tokens == MAX
    assert r.text.format.type == "text" and r.tools == [] and r.parallel_tool_calls is True
    Response.model_validate(r.model_dump())


def test_same_answer_as_chat_completions(client, smollm2_server):
    """Instructions + a message list at temperature 0: the same text, and the same prompt, as the chat request."""
    r = client.responses.create(model=smollm2_server.model, instructions=INSTRUCTIONS, temperature=0,
                                max_output_tokens=MAX, input=[{"role": "user", "content": QUESTION}])
    chat = client.chat.completions.create(model=smollm2_server.model, temperature=0, max_tokens=MAX,
                                          messages=[{"role": "system", "content": INSTRUCTIONS},
                                                    {"role": "user", "content": QUESTION}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.instructions == INSTRUCTIONS
    # the same conversation written as typed items and content parts is the same prompt
    typed = client.responses.create(model=smollm2_server.model, temperature=0, max_output_tokens=MAX, input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert typed.output_text == r.output_text and typed.usage.input_tokens == r.usage.input_tokens


def test_max_output_tokens_gives_an_incomplete_response(client, smollm2_server):
    r = client.responses.create(model=smollm2_server.model, input="Write a long story about a dragon.",
                                temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete" and r.output_text


def test_text_format_json_schema(client, smollm2_server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                               "role": {"enum": ["admin", "user"]}},
              "required": ["name", "age", "role"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r = client.responses.create(model=smollm2_server.model, input="Describe a user as JSON.", temperature=0,
                                max_output_tokens=80, text={"format": fmt})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


# ---- function tools -----------------------------------------------------------------------------------------------
TOOL_CALL = dict(input="What is the weather in Paris, in celsius?", tools=[WEATHER], temperature=0,
                 tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                 max_output_tokens=60)


@pytest.fixture(scope="module")
def tool_call(client, smollm2_server):
    """A call the model must make (the named function, one call): shared by the tool tests."""
    return client.responses.create(model=smollm2_server.model, **TOOL_CALL)


def test_function_call_and_its_output_sent_back(client, smollm2_server, tool_call):
    model, first = smollm2_server.model, tool_call
    question = [{"role": "user", "content": TOOL_CALL["input"]}]
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"

    def second(output: str):
        # the next turn: the call as the client got it back, and its output
        items = question + [*first.output, {"type": "function_call_output", "call_id": call.call_id, "output": output}]
        return client.responses.create(model=model, input=items, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_output_tokens=8)

    answer = second(json.dumps({"temperature_c": 21}))
    assert answer.status in ("completed", "incomplete") and answer.output_text
    # rendered as chat renders a tool call and its result
    chat = client.chat.completions.create(model=model, tools=[CHAT_WEATHER], tool_choice="none", temperature=0,
                                          max_tokens=8, messages=question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": json.dumps({"temperature_c": 21})}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == chat.choices[0].message.content
    longer = second(json.dumps({"temperature_c": 21, "sky": "clear, with a light breeze from the west"}))
    assert longer.usage.input_tokens > answer.usage.input_tokens  # the output is in the prompt


def test_streamed_function_call(client, smollm2_server, tool_call):
    whole = tool_call
    events = list(client.responses.create(model=smollm2_server.model, stream=True, **TOOL_CALL))
    for e in events:
        EVENT.validate_python(e.to_dict())
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-2].item
    assert arguments == done.arguments == events[-3].arguments
    assert (done.name, done.arguments) == (whole.output[-1].name, whole.output[-1].arguments)
    assert events[-1].response.output[-1].call_id == done.call_id


# ---- streaming --------------------------------------------------------------------------------------------------
def test_stream_events_in_order(client, smollm2_server):
    kwargs = dict(model=smollm2_server.model, instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
                  max_output_tokens=MAX)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    for e in events:
        EVENT.validate_python(e.to_dict())
    types, text = _text_events(events)
    deltas = types.count("response.output_text.delta")
    assert deltas > 1
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type.startswith("response.output_text"))
    final = events[-1].response
    assert text == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


def test_stream_helper_final_response(client, smollm2_server):
    """The helper sends the pydantic model as a strict json_schema text.format and parses the final text."""
    with client.responses.stream(model=smollm2_server.model, input="Is Paris in France? Answer as JSON.",
                                 temperature=0, max_output_tokens=20, text_format=Verdict) as stream:
        events = list(stream)
        final = stream.get_final_response()  # needs a response.completed
    _, text = _text_events(events)
    assert final.status == "completed" and final.output_text == text
    assert isinstance(final.output_parsed, Verdict)


# ---- errors ---------------------------------------------------------------------------------------------------
def _error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    return error


def test_refusals_in_openai_shape(client, smollm2_server):
    url = smollm2_server.url + "/v1/responses"
    with httpx.Client(timeout=60) as http:
        _error(http.post(url, json={"input": [{"type": "input_image", "image_url": "x"}]}), 400, "input.0",
               "function_call_output")
        _error(http.post(url, json={"input": "hi", "tools": [{"type": "web_search"}]}), 400, "tools[0].type",
               "web_search", "function tools only")
        _error(http.post(url, json={"input": "hi", "frob": 1}), 400, "frob", "unrecognized")
        _error(http.post(url, json={"input": "hi", "max_output_tokens": 10 ** 6}), 400, "max_output_tokens")
        _error(http.post(url, json={"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                      "schema": {"type": "frob"}}}}),
               400, "text.format")
        _error(http.get(url + "/resp_123"), 404, "response_id", "stores no responses")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=smollm2_server.model, input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "stores no responses" in e.value.body["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "stream_options": {}}, "stream_options"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
])
def test_translation_refusals(body, param):
    with pytest.raises(APIError) as e:
        to_chat_request(ResponsesRequest.model_validate(body))
    assert e.value.status == 400 and e.value.param == param


def test_translation_joins_calls_to_their_turn():
    req = ResponsesRequest.model_validate({"instructions": "sys", "input": [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]}]})
    messages = [m.model_dump(exclude_none=True) for m in to_chat_request(req).messages]
    assert [(m["role"], m.get("content")) for m in messages] == [
        ("system", "sys"), ("user", "q"), ("assistant", "Let me look."), ("tool", "1"), ("tool", "2")]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert [m.get("tool_call_id") for m in messages[3:]] == ["c1", "c2"]


def test_failure_before_the_first_event_is_a_failed_response():
    """The headers went out, then the request left the queue without a worker: created, in_progress, failed."""
    prep = type("Prep", (), {"id": "chatcmpl-0123", "created": 1, "model": "m"})
    writer = EventWriter(response_head(ResponsesRequest.model_validate({"input": "x"}), prep))
    events = _raw_events(writer.failed_before_start(QueueTimeout(2.5)))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["id"] == "resp_0123" and failed["output"] == []
    assert failed["error"]["code"] == "server_error" and "(code: queue_timeout)" in failed["error"]["message"]


def test_items_in_the_order_written():
    """Reasoning (a reasoning parser's), then text, then a call: one item each, in order, as the client's types
    have them; whitespace before a call is not an answer. The same items as the non-streamed output."""
    prep = type("Prep", (), {"id": "chatcmpl-0123", "created": 1, "model": "m"})
    writer = EventWriter(response_head(ResponsesRequest.model_validate({"input": "x"}), prep))
    call = ToolCall(0, "call_1", "f")
    chunks = [*writer.reasoning("I think"), *writer.reasoning("."), *writer.text("Let me"), *writer.text(" look."),
              *writer.call(call, '{"a":', True), *writer.call(call, " 1}", False), *writer.text("\n"),
              *writer.finish("completed")]
    events = _raw_events(chunks)
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [item["type"] for item in done] == ["reasoning", "message", "function_call"]
    assert done[0]["content"][0]["text"] == "I think." and done[1]["content"][0]["text"] == "Let me look."
    assert (done[2]["call_id"], done[2]["name"], done[2]["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert [e["output_index"] for e in events if e["type"].endswith(".delta")] == [0, 0, 1, 1, 2, 2]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    call.arguments = '{"a": 1}'  # (the parser's, once the call is done)
    whole = output_items({"reasoning_content": "I think.", "content": "Let me look.", "tool_calls": [call.as_dict()]},
                         "completed")
    strip = [{k: v for k, v in item.items() if k != "id"} for item in whole]
    assert strip == [{k: v for k, v in item.items() if k != "id"} for item in done]
    # calls only: the whitespace around them is no message; text only, even empty: a message
    assert [i["type"] for i in output_items({"content": "\n", "tool_calls": [call.as_dict()]}, "completed")] == [
        "function_call"]
    assert [(i["type"], i["content"][0]["text"]) for i in output_items({"content": None}, "completed")] == [
        ("message", "")]


def test_metadata_limit():
    from pydantic import ValidationError

    from inferd.config import MAX_METADATA_ENTRIES

    ResponsesRequest.model_validate({"input": "x", "metadata": {str(i): "v" for i in range(MAX_METADATA_ENTRIES)}})
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": "x",
                                         "metadata": {str(i): "v" for i in range(MAX_METADATA_ENTRIES + 1)}})


# ---- a client that leaves ---------------------------------------------------------------------------------------
def test_stream_disconnect_frees_the_request(smollm2_server):
    """A JSON string of at least 20,000 characters cannot end in fewer than 2,000 tokens: only the client leaving
    stops it. The raw events are OpenAI's SSE: an `event:` line naming the type its data carries."""
    server = smollm2_server
    server.wait_metrics(_idle)
    fmt = {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 20000}}
    body = {"model": server.model, "input": "Write a long story.", "max_output_tokens": 2000, "temperature": 0,
            "stream": True, "text": {"format": fmt}}
    with httpx.Client(timeout=60) as http:
        short = http.post(server.url + "/v1/responses", json={**body, "stream": False, "max_output_tokens": 16})
        assert short.json()["status"] == "incomplete"  # the grammar holds it: it cannot end early by itself
        with http.stream("POST", server.url + "/v1/responses", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks, deltas = [], 0
            for chunk in r.iter_raw():
                chunks.append(chunk)
                if b"\n\n" in chunk:
                    whole = b"".join(chunks)
                    deltas = whole.count(b"event: response.output_text.delta\n")
                    if deltas >= 3:
                        break
            events = _raw_events([whole[:whole.rindex(b"\n\n") + 2]])
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            busy = server.wait_metrics(lambda m: _running(m) == 1 and _kv_in_use(m) > 0)
    idle = server.wait_metrics(_idle, timeout=20)
    assert _steps(idle) - _steps(busy) < 500
    counted = server.metrics()
    assert counted.get('inferd_requests_total{route="/v1/responses",status="200"}', 0) >= 1

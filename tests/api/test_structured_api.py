"""Structured outputs and tool calling through the HTTP API, with the official `openai` client against a real
`inferd serve` of the default model: response_format (a pydantic model through `parse`), vLLM's structured_outputs,
tools with required / named / auto choice, streamed tool-call deltas equal to the non-streamed answer, a whole tool
round trip, and bad constraints as 400s naming their parameter.

The requests of the tests that need nothing from another test are sent all at once when the module starts (`sent`),
so the engine decodes them in one batch, and the wait is about the longest of them instead of the sum of all (one
after the other they were ~30 s of a quiet 2-core machine and ~250 s of a busy one, most of it steps at batch 1).
Each test still makes its own requests with its own parameters and checks its own answers; what it checks holds for
any output its grammar allows (a batch may change which sample a seed draws: a row's float sums can differ with its
batch). The streamed test compares two greedy answers with each other token for token, so it runs alone on the
server, once the others are done."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.api.test_tool_parser import TIME, WEATHER


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int
    role: Literal["admin", "user", "guest"]
    address: Address
    hobbies: list[str] = Field(max_length=3)


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# test -> its requests, sent by `sent` at the module's start: each a function of (client, model) -> the answers
SENT_AT_ONCE: dict[str, dict] = {}


def sent_at_once(test: str, name: str | None = None):
    """Registers a request of test (under name, or the function's own)."""
    def register(request):
        SENT_AT_ONCE.setdefault(test, {})[name or request.__name__] = request
        return request
    return register


@pytest.fixture(scope="module")
def sent(client, smollm2_server, request):
    """name -> Future of the answer of each request in SENT_AT_ONCE whose test runs in this session (a test chosen
    alone with -k sends only its own), all sent at once on threads."""
    chosen = {item.originalname for item in request.session.items if item.module is request.module}
    requests = {name: fn for test, fns in SENT_AT_ONCE.items() if test in chosen for name, fn in fns.items()}
    with ThreadPoolExecutor(max(len(requests), 1)) as pool:
        yield {name: pool.submit(fn, client, smollm2_server.model) for name, fn in requests.items()}


def answer_of(sent: dict[str, Future], name: str):
    return sent[name].result(timeout=600)


@sent_at_once("test_parse_returns_a_pydantic_object")
def parsed_person(client, model):
    return client.chat.completions.parse(model=model, messages=user("Describe a user as JSON."),
                                         response_format=Person, max_tokens=160, temperature=0)


def test_parse_returns_a_pydantic_object(sent):
    done = answer_of(sent, "parsed_person")
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Person) and isinstance(msg.parsed.address, Address)


@sent_at_once("test_json_object_mode_and_sampled_json_schema")
def json_object(client, model):
    return client.chat.completions.create(model=model, messages=user("Output JSON: the name and age of a person."),
                                          response_format={"type": "json_object"}, max_tokens=96, temperature=0)


@sent_at_once("test_json_object_mode_and_sampled_json_schema")
def sampled_person(client, model):
    schema = Person.model_json_schema()  # sampled: the engine tests draw 10 of these (test_structured.py)
    return client.chat.completions.create(
        model=model, messages=user("Describe a user as JSON."), seed=11, temperature=1.0,
        max_tokens=160, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                                "strict": True}})


def test_json_object_mode_and_sampled_json_schema(sent):
    r = answer_of(sent, "json_object")
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = answer_of(sent, "sampled_person")
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), Person.model_json_schema())


def test_regex_choice_and_grammar_on_completions(client, smollm2_server):
    cases = [({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-" and t.replace("-", "").isdigit()),
             ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!"))]
    for so, holds in cases:
        r = client.completions.create(model=smollm2_server.model, prompt="My favourite thing is", max_tokens=20,
                                      n=3, seed=5, temperature=1.0, extra_body={"structured_outputs": so})
        for c in r.choices:
            assert c.finish_reason == "stop" and holds(c.text), (so, c.text)
    # vLLM's older name for the same
    r = client.completions.create(model=smollm2_server.model, prompt="Pick one:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")


TOOL_CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}}]


def tool_calls(choice):
    def request(client, model):
        return client.chat.completions.create(model=model, messages=user("Weather in Paris, in celsius?"),
                                              tools=[WEATHER, TIME], tool_choice=choice, n=2, seed=3, temperature=1.0,
                                              max_tokens=100, parallel_tool_calls=False)  # sampled: one call each
    return request


for _i, _choice in enumerate(TOOL_CHOICES):
    sent_at_once("test_required_and_named_tool_calls_validate", f"tool_calls_{_i}")(tool_calls(_choice))


@pytest.mark.parametrize("choice", TOOL_CHOICES)
def test_required_and_named_tool_calls_validate(sent, choice):
    r = answer_of(sent, f"tool_calls_{TOOL_CHOICES.index(choice)}")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        calls = c.message.tool_calls
        assert len(calls) == 1 and all(call.id.startswith("call_") and call.type == "function" for call in calls)
        if isinstance(choice, dict):
            assert [call.function.name for call in calls] == ["get_weather"]
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_call_deltas_assemble_to_the_non_streamed_answer(client, smollm2_server, sent):
    wait(sent.values())  # alone on the server: the two greedy answers must be equal token for token
    kwargs = dict(model=smollm2_server.model, messages=user("Weather in Rome and the time in UTC?"),
                  tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=90)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    content, finish, first_deltas = "", None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # OpenAI: a call's first delta has its id, type and name
                    assert d.id and d.type == "function" and d.function.name
                    first_deltas.append(d)
                    calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.id is None and not d.function.name
                    calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" == whole.finish_reason
    assert (content or None) == whole.message.content
    assert [calls[i] for i in sorted(calls)] == [{"name": t.function.name, "arguments": t.function.arguments}
                                                 for t in whole.message.tool_calls]


@sent_at_once("test_a_tool_round_trip_renders_and_runs")
def tool_round_trip(client, model):
    """The call, then the tool's result sent back twice: with the tools, and with tool_choice none (the tools are
    shown to the model but the output is plain text)."""
    messages = user("What is the weather in Paris, in celsius?")
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                           temperature=0, max_tokens=20)
    plain = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER],
                                           tool_choice="none", temperature=0, max_tokens=20)
    return final, plain


def test_a_tool_round_trip_renders_and_runs(sent):
    final, plain = answer_of(sent, "tool_round_trip")
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    # tool_choice none: plain text
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


@sent_at_once("test_auto_tool_choice_gives_text_or_valid_calls")
def auto_tool_choice(client, model):
    return client.chat.completions.create(model=model, messages=user("Weather in Oslo in celsius?"),
                                          tools=[WEATHER], n=2, seed=9, temperature=1.0, max_tokens=60)


def test_auto_tool_choice_gives_text_or_valid_calls(sent):
    r = answer_of(sent, "auto_tool_choice")
    for c in r.choices:
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        else:
            assert c.message.content is not None and c.finish_reason in ("stop", "length")


def test_logit_bias_through_the_client(client, smollm2_server):
    import httpx

    tok = httpx.post(smollm2_server.url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False})
    banana = tok.json()["tokens"][0]
    r = client.completions.create(model=smollm2_server.model, prompt="The capital of France is", max_tokens=3,
                                  temperature=0, logit_bias={str(banana): 100})
    assert r.choices[0].text == " banana" * 3


@pytest.mark.parametrize("kwargs,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}),
     "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "bogus"}}}}}], tool_choice="required"), "tools"),
])
def test_bad_constraints_are_400s_naming_the_parameter(client, smollm2_server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=smollm2_server.model, messages=user("hi"), max_tokens=4, **kwargs)
    assert e.value.body["param"] == param
    assert e.value.body["code"] == "invalid_structured_output"

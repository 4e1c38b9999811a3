"""Every error case of the API: status, OpenAI error shape, type, and where it helps, param and code. Bad input is
a 4xx, never a 500, and never leaves the worker stuck (a normal request succeeds after the barrage)."""

from __future__ import annotations

import httpx
import pytest

CTX = 256  # the tiny server's --max-model-len

MSG = [{"role": "user", "content": "hi"}]


def _post(server, path: str, body=None, content: bytes | None = None, headers: dict | None = None):
    h = {**server.headers, **(headers or {})}
    if content is not None:
        return httpx.post(server.url + path, content=content, headers={"content-type": "application/json", **h},
                          timeout=60)
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


def _assert_error(r: httpx.Response, status: int, type_: str, param: str | None = "any", code: str | None = "any"):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == type_, err
    assert isinstance(err["message"], str) and err["message"]
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


def completion(**kw):
    return {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4, **kw}


def chat(**kw):
    return {"model": "tiny-llama", "messages": MSG, "max_tokens": 4, **kw}


INVALID_400 = [
    # (path, body, param, code)
    ("/v1/completions", completion(temperature=-1), "temperature", "invalid_value"),
    ("/v1/completions", completion(temperature=2.5), "temperature", "invalid_value"),
    ("/v1/completions", completion(top_p=0), "top_p", "invalid_value"),
    ("/v1/completions", completion(n=17), "n", "invalid_value"),
    ("/v1/completions", completion(n=0), "n", "invalid_value"),
    ("/v1/completions", completion(logprobs=21), "logprobs", "invalid_value"),
    ("/v1/completions", completion(max_tokens=0), "max_tokens", "invalid_value"),
    ("/v1/completions", completion(max_tokens=-5), "max_tokens", "invalid_value"),
    ("/v1/completions", completion(max_tokens="5"), "max_tokens", "invalid_value"),
    ("/v1/completions", completion(temperature="0.5"), "temperature", "invalid_value"),
    ("/v1/completions", completion(max_tokens=1e30), "max_tokens", "invalid_value"),
    ("/v1/completions", completion(max_tokens=4.0), "max_tokens", "invalid_value"),
    ("/v1/completions", completion(max_tokens=True), "max_tokens", "invalid_value"),
    ("/v1/completions", completion(seed=2 ** 70), "seed", "invalid_value"),
    ("/v1/completions", completion(presence_penalty=3), "presence_penalty", "invalid_value"),
    ("/v1/completions", completion(stop=[""]), "stop.0", "any"),
    ("/v1/completions", completion(stop=["s"] * 17), "stop", "any"),
    ("/v1/completions", completion(prompt=[]), "any", "any"),
    ("/v1/completions", completion(prompt=[1, -2]), "any", "any"),
    ("/v1/completions", completion(prompt=None), "prompt", "any"),
    ("/v1/completions", {"model": "tiny-llama", "max_tokens": 4}, "prompt", "invalid_value"),
    ("/v1/completions", completion(frobnicate=1), "frobnicate", "unknown_parameter"),
    ("/v1/completions", completion(max_tokens=0), "max_tokens", "invalid_value"),  # (with echo: the prompt alone)
    ("/v1/completions", completion(best_of=3), "best_of", "unsupported_parameter"),
    ("/v1/completions", completion(suffix="x"), "suffix", "unsupported_parameter"),
    ("/v1/completions", completion(logit_bias={"x": 10}), "logit_bias", "any"),
    ("/v1/completions", completion(logit_bias={"1000000": 10}), "logit_bias", "any"),  # outside the vocabulary
    ("/v1/completions", completion(logit_bias={"5": 101}), "logit_bias.5", "any"),
    ("/v1/completions", completion(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias", "any"),
    ("/v1/completions", completion(structured_outputs={"regex": "[a-"}), "structured_outputs",
     "invalid_structured_output"),
    ("/v1/completions", completion(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs",
     "any"),
    ("/v1/completions", completion(structured_outputs={"grammar": "root ::= "}), "structured_outputs",
     "invalid_structured_output"),
    ("/v1/completions", completion(structured_outputs={"choice": [""]}), "structured_outputs",
     "invalid_structured_output"),
    ("/v1/completions", completion(structured_outputs={"json": {"type": "frobnicate"}}), "structured_outputs",
     "invalid_structured_output"),
    ("/v1/completions", completion(guided_regex="(", structured_outputs=None), "guided_regex",
     "invalid_structured_output"),
    ("/v1/completions", completion(guided_regex="a", structured_outputs={"regex": "b"}), "guided_regex", "any"),
    ("/v1/completions", completion(structured_outputs={"grammar": "root ::= " + '"a" | ' * 20000 + '"b"'}),
     "structured_outputs", "invalid_structured_output"),  # MAX_STRUCTURED_CHARS
    ("/v1/completions", completion(stream_options={"include_usage": True}), "stream_options", "any"),
    ("/v1/completions", completion(min_tokens=9), "min_tokens", "any"),
    ("/v1/completions", completion(prompt=["a"] * 65), "any", "any"),  # MAX_PROMPTS_PER_REQUEST
    ("/v1/completions", completion(prompt=["a"] * 9, n=16), "n", "any"),  # MAX_CHOICES_PER_REQUEST
    ("/v1/completions", completion(stop="x" * 1025), "stop", "any"),  # MAX_STOP_STRING_CHARS
    ("/v1/completions", completion(prompt=[10 ** 6]), "prompt", "any"),
    ("/v1/completions", completion(stop_token_ids=[1] * 65), "stop_token_ids", "invalid_value"),  # MAX_STOP_TOKEN_IDS
    ("/v1/completions", completion(stop_token_ids=[-1]), "stop_token_ids.0", "invalid_value"),
    ("/v1/completions", completion(stop_token_ids=[10 ** 6]), "stop_token_ids", "any"),  # outside the vocabulary
    ("/v1/completions", completion(user="u" * 257), "user", "invalid_value"),  # MAX_IDENTIFIER_CHARS
    ("/v1/completions", completion(model="m" * 257), "model", "invalid_value"),
    ("/v1/chat/completions", chat(messages=[]), "messages", "invalid_value"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role",
     "invalid_value"),
    ("/v1/chat/completions", chat(messages=[{"role": "tool", "content": "x"}]), "messages.0", "invalid_value"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), "messages.0",
     "invalid_value"),
    ("/v1/chat/completions", chat(messages=[{"content": "x"}]), "messages.0.role", "invalid_value"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                                         "image_url": {"url": "x"}}]}]),
     "any", "any"),
    ("/v1/chat/completions", chat(messages="hi"), "messages", "invalid_value"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": None}]), "messages.0", "invalid_value"),
    ("/v1/chat/completions", chat(messages=[{"role": "system", "content": None}, *MSG]), "messages.0",
     "invalid_value"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x", "name": "n" * 257}]),
     "messages.0.name", "invalid_value"),
    ("/v1/chat/completions", chat(service_tier="s" * 257), "service_tier", "invalid_value"),
    ("/v1/chat/completions", chat(safety_identifier="s" * 257), "safety_identifier", "invalid_value"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f g"}}]),
     "tools.0.function.name", "any"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nope"}}}]), "tools", "invalid_structured_output"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}] * 129), "tools",
     "any"),  # MAX_TOOLS
    ("/v1/chat/completions", chat(tool_choice="auto"), "tool_choice", "any"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                  tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice",
     "any"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
                                  response_format={"type": "json_object"}), "response_format", "any"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
     "response_format", "any"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}),
     "response_format", "invalid_structured_output"),
    ("/v1/chat/completions", chat(response_format={"type": "yaml"}), "response_format.type", "any"),
    ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs", "any"),
    ("/v1/chat/completions", chat(top_logprobs=21, logprobs=True), "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", chat(store=True), "store", "unsupported_parameter"),
    ("/v1/chat/completions", chat(modalities=["text", "audio"]), "modalities", "unsupported_parameter"),
    ("/tokenize", {"prompt": "a", "messages": MSG}, "prompt", "any"),
    ("/tokenize", {}, "prompt", "any"),
    ("/tokenize", {"model": "m" * 257, "prompt": "a"}, "model", "invalid_value"),
    ("/detokenize", {"tokens": [10 ** 6]}, "tokens", "any"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0", "any"),
]


@pytest.mark.parametrize("path,body,param,code", INVALID_400,
                         ids=[f"{p}-{i}" for i, (p, *_rest) in enumerate(INVALID_400)])
def test_invalid_parameters_are_400(tiny_server, path, body, param, code):
    _assert_error(_post(tiny_server, path, body), 400, "invalid_request_error", param, code)


def test_neutral_values_of_unsupported_parameters_are_accepted(tiny_server):
    body = chat(tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={}, store=False,
                modalities=["text"], service_tier="auto", parallel_tool_calls=True, user="u1",
                prompt_cache_key="k")
    r = _post(tiny_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    r = _post(tiny_server, "/v1/completions", completion(echo=False, best_of=1, suffix="", logit_bias=None))
    assert r.status_code == 200, r.text


def test_context_window(tiny_server):
    long_prompt = list(range(1000, 1000 + 200))
    err = _assert_error(_post(tiny_server, "/v1/completions", completion(prompt=long_prompt, max_tokens=100)), 400,
                        "invalid_request_error", "max_tokens", "context_length_exceeded")
    assert "256" in err["message"] and "300" in err["message"] and "200" in err["message"]
    assert "100" in err["message"]
    err = _assert_error(_post(tiny_server, "/v1/completions", completion(prompt=list(range(1000, 1000 + CTX)))),
                        400, "invalid_request_error", "prompt", "context_length_exceeded")
    assert "256" in err["message"]
    _assert_error(_post(tiny_server, "/v1/completions", completion(max_tokens=10 ** 30)), 400,
                  "invalid_request_error", "max_tokens", "context_length_exceeded")
    # omitted max_tokens: the rest of the context window
    r = _post(tiny_server, "/v1/completions", {"model": "tiny-llama", "prompt": long_prompt, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == CTX - 200


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"[]", b"",
                                     b"null", b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}',
                                     b'{"model": "tiny-llama", "prompt": "x", "temperature": 1e999}'])
def test_malformed_bodies_are_400(tiny_server, content):
    _assert_error(_post(tiny_server, "/v1/completions", content=content), 400, "invalid_request_error")


def test_api_key(tiny_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"},
                    {"Authorization": "Bearer"}):
        r = httpx.post(tiny_server.url + "/v1/completions", json=completion(), headers=headers, timeout=30)
        _assert_error(r, 401, "invalid_request_error", None, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(tiny_server.url + "/v1/models", timeout=30)
    assert r.status_code == 401
    for public in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert httpx.get(tiny_server.url + public, timeout=30).status_code == 200, public


def test_unknown_model_route_and_method(tiny_server):
    _assert_error(_post(tiny_server, "/v1/completions", completion(model="gpt-4")), 404, "invalid_request_error",
                  "model", "model_not_found")
    _assert_error(_post(tiny_server, "/v1/chat/completions", chat(model="gpt-4")), 404, "invalid_request_error",
                  "model", "model_not_found")
    r = httpx.get(tiny_server.url + "/v1/models/gpt-4", headers=tiny_server.headers, timeout=30)
    _assert_error(r, 404, "invalid_request_error", "model", "model_not_found")
    r = httpx.get(tiny_server.url + "/v1/nothing-here", headers=tiny_server.headers, timeout=30)
    _assert_error(r, 404, "not_found_error")
    r = httpx.get(tiny_server.url + "/v1/completions", headers=tiny_server.headers, timeout=30)
    _assert_error(r, 405, "invalid_request_error")
    r = httpx.delete(tiny_server.url + "/v1/chat/completions", headers=tiny_server.headers, timeout=30)
    _assert_error(r, 405, "invalid_request_error")


def test_body_over_the_limit_is_413(tiny_server):
    big = b'{"model": "tiny-llama", "prompt": "' + b"a" * (1 << 20) + b'"}'  # the tiny server allows 1 MiB
    _assert_error(_post(tiny_server, "/v1/completions", content=big), 413, "invalid_request_error", None,
                  "request_too_large")

    def chunks():  # no Content-Length: the limit holds on the bytes actually received
        for _ in range(5):
            yield b" " * (300 << 10)
        yield b"{}"

    r = httpx.post(tiny_server.url + "/v1/completions", content=chunks(),
                   headers={**tiny_server.headers, "content-type": "application/json"}, timeout=60)
    _assert_error(r, 413, "invalid_request_error")


def test_server_still_serves_after_bad_input(tiny_server):
    r = _post(tiny_server, "/v1/completions", completion(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    m = tiny_server.metrics()
    assert not any(k.startswith("inferd_requests_total") and 'status="5' in k for k in m), m

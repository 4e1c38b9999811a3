"""schemathesis against the live server's own /openapi.json: for generated requests, valid and invalid alike, no
5xx, and every response (status code, content type, headers, body, each event of a stream) is one the document
declares. The server is the session's `inferd serve` on the tiny Llama with --max-model-len 256.

About 50 requests in all, deterministic (derandomized Hypothesis, no example database), so a failure replays in CI.
Schema-valid requests may legitimately get a 400 (a prompt plus max_tokens over the 256-token context, an unknown
model, an unsupported parameter set to a non-neutral value), so no check demands a 2xx for them; invalid requests
must be rejected (`negative_data_rejection`). A few explicit, known-good requests per operation make sure that the
success bodies (JSON and text/event-stream, with logprobs and usage) are checked on every run, whatever the
generated ones happen to hit.

Operations are driven one by one with `APIOperation.as_strategy()` and Hypothesis' own `@given`:
`schemathesis.pytest.from_fixture` (the lazy loader for a schema that needs a fixture, here the live server) does not
work with pytest 9.2 (it reads `request.node._nodeid`, which pytest 9.2 no longer has).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]

# Hypothesis' own caches (not the example database, which is off) go under the suite's .cache, not ./.hypothesis
if not os.getenv("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(Path(__file__).resolve().parents[2] / ".cache" / "hypothesis")

MODEL = "tiny-llama"
MSG = [{"role": "user", "content": "hi"}]

# operation -> generated examples (positive and negative mixed). Operations without parameters have one request
# to make (Hypothesis stops when it has tried everything).
GENERATED = {
    "POST /v1/completions": 12,
    "POST /v1/chat/completions": 12,
    "POST /v1/messages": 6,
    "POST /v1/messages/count_tokens": 3,
    "POST /v1/responses": 2,  # its minimal example, {"input": ""}, generates to the end of the context
    "GET /v1/responses/{response_id}": 1,
    "DELETE /v1/responses/{response_id}": 1,
    "POST /tokenize": 6,
    "POST /detokenize": 5,
    "GET /v1/models": 1,
    "GET /v1/models/{model_id}": 4,
    "GET /health": 1,
    "GET /ready": 1,
    "GET /metrics": 1,
    "POST /v1/embeddings": 4,
    "POST /v1/batches": 3,
    "GET /v1/batches": 2,
    "GET /v1/batches/{batch_id}": 2,
    "POST /v1/batches/{batch_id}/cancel": 2,
    "POST /v1/files": 2,
    "GET /v1/files": 2,
    "GET /v1/files/{file_id}": 2,
    "GET /v1/files/{file_id}/content": 2,
    "DELETE /v1/files/{file_id}": 2,
}

# operation -> explicit requests ({"body": ...} or {"path_parameters": ...}) that must succeed
EXPLICIT = {
    "POST /v1/completions": [
        {"body": {"model": MODEL, "prompt": "hello", "max_tokens": 4, "n": 2, "logprobs": 2}},
        {"body": {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 3, "logprobs": 1, "stream": True,
                  "stream_options": {"include_usage": True}}},
    ],
    "POST /v1/chat/completions": [
        {"body": {"model": MODEL, "messages": MSG, "max_tokens": 4, "n": 2, "logprobs": True, "top_logprobs": 2}},
        {"body": {"model": MODEL, "messages": MSG, "max_completion_tokens": 3, "logprobs": True, "stream": True,
                  "stream_options": {"include_usage": True}}},
    ],
    "POST /v1/messages": [
        {"body": {"model": MODEL, "messages": MSG, "max_tokens": 4, "system": "Be brief."}},
        {"body": {"model": MODEL, "messages": MSG, "max_tokens": 3, "stream": True}},
    ],
    "POST /v1/messages/count_tokens": [{"body": {"model": MODEL, "messages": MSG}}],
    "POST /v1/responses": [
        {"body": {"model": MODEL, "input": MSG, "instructions": "be brief", "max_output_tokens": 4}},
        {"body": {"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}},
    ],
    "POST /tokenize": [{"body": {"model": MODEL, "prompt": "hello"}}, {"body": {"messages": MSG}}],
    "POST /detokenize": [{"body": {"model": MODEL, "tokens": [1, 2, 3]}}],
    "GET /v1/models/{model_id}": [{"path_parameters": {"model_id": MODEL}}],
}

RUN: dict[str, list[int]] = {}  # operation -> status codes of the requests made, in order


@pytest.fixture(scope="module")
def api_schema(tiny_server):
    # an explicit config, so that nothing is picked up from a schemathesis.toml that happens to be around; no
    # sanitization of the reproduction commands in failure reports: it hides `max_tokens` (and the test-only API key)
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    return schemathesis.openapi.from_url(tiny_server.url + "/openapi.json", config=config, timeout=30)


def test_every_operation_is_fuzzed(api_schema):
    """A new route in the document must get a budget here, not go untested."""
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert labels == set(GENERATED), labels ^ set(GENERATED)
    assert set(EXPLICIT) <= labels


@pytest.mark.parametrize("label", list(GENERATED))
def test_schema_conformance(api_schema, tiny_server, label):
    method, path = label.split(" ", 1)
    operation = api_schema[path][method]
    statuses = RUN.setdefault(label, [])

    strategy = st.one_of([operation.as_strategy(generation_mode=mode) for mode in GenerationMode])

    # no shrinking (every step would be a request to the server; schemathesis' report has the request to replay),
    # no example database (nothing written into the repository), no deadline (generations take seconds)
    @settings(max_examples=GENERATED[label], derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
    @given(case=strategy)
    def check(case):
        response = case.call_and_validate(headers=tiny_server.headers, checks=CHECKS, timeout=120)
        statuses.append(response.status_code)
        if case.meta is None:  # an explicit request below
            assert response.status_code == 200, response.text

    for request in EXPLICIT.get(label, []):
        media_type = {"media_type": "application/json"} if "body" in request else {}
        check = example(case=operation.Case(**request, **media_type))(check)
    check()
    assert len(statuses) >= len(EXPLICIT.get(label, [])) + 1, statuses

"""Compact JSON (vLLM's disable_any_whitespace): a compact JSON constraint leaves the model no whitespace of its own
choosing (separators ", " and ": " only), where the default one allows a little; which requests get it (the server's
--disable-any-whitespace, a `strict` json_schema, the request's structured_outputs.disable_any_whitespace). In-process:
real xgrammar over the default model's tokenizer, the API's real request parsing."""

from __future__ import annotations

import json

import pytest
import xgrammar

from inferd.api.reasoning import constraint_after_reasoning
from inferd.api.schemas import ChatCompletionRequest
from inferd.api.serving import OpenAIServing
from inferd.cli import build_parser
from inferd.engine.structured import Constraint, compile_constraint
from inferd.telemetry.metrics import Metrics

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"], "additionalProperties": False}
COMPACT = '{"a": 1, "b": "x"}'
SPACED = '{\n"a": 1, "b": "x"}'  # a newline the compact grammar has no room for


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(smollm2_tokenizer.hf))


def accepts(compiled, tokenizer, text: str) -> bool:
    return Constraint(compiled).advance(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("kind, text", [("json", json.dumps(SCHEMA)), ("json_object", "")])
def test_compact_rejects_whitespace_that_any_whitespace_accepts(compiler, smollm2_tokenizer, kind, text):
    loose = compile_constraint(compiler, kind, text)
    compact = compile_constraint(compiler, kind + "_compact", text)
    assert accepts(loose, smollm2_tokenizer, SPACED) and accepts(loose, smollm2_tokenizer, COMPACT)
    assert not accepts(compact, smollm2_tokenizer, SPACED)
    assert accepts(compact, smollm2_tokenizer, COMPACT)


def test_compact_after_reasoning(compiler, smollm2_tokenizer):
    """The constraint moved after a model's thinking (a structural tag) stays compact."""
    for kind, spaced_ok in (("json", True), ("json_compact", False)):
        tag = compile_constraint(compiler, *constraint_after_reasoning(kind, json.dumps(SCHEMA), "deepseek_r1"))
        assert accepts(tag, smollm2_tokenizer, "hm</think>" + SPACED) is spaced_ok, kind
        assert accepts(tag, smollm2_tokenizer, "hm</think>" + COMPACT), kind


@pytest.fixture(scope="module")
def servings(smollm2_tokenizer):
    """The API's request-to-constraint step, without and with --disable-any-whitespace."""
    return {flag: OpenAIServing(None, smollm2_tokenizer, "m", Metrics("m"), disable_any_whitespace=flag)
            for flag in (False, True)}


def kind_of(serving, **fields) -> str:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)
    return serving._constraint(req)[0]


def json_schema(strict: bool | None) -> dict:
    js = {"name": "thing", "schema": SCHEMA}
    if strict is not None:
        js["strict"] = strict
    return {"type": "json_schema", "json_schema": js}


def test_which_requests_get_compact_json(servings):
    plain, flagged = servings[False], servings[True]
    assert kind_of(plain, response_format=json_schema(None)) == "json"
    assert kind_of(plain, response_format=json_schema(False)) == "json"
    # strict schemas too: compact measured no better for them (docs/benchmarks.md, issue 31)
    assert kind_of(plain, response_format=json_schema(True)) == "json"
    assert kind_of(plain, response_format={"type": "json_object"}) == "json_object"
    assert kind_of(flagged, response_format={"type": "json_object"}) == "json_object_compact"
    assert kind_of(flagged, structured_outputs={"json": SCHEMA}) == "json_compact"
    assert kind_of(flagged, structured_outputs={"regex": "[a-z]+"}) == "regex"  # not JSON: as it is
    # the request's own choice wins, given with its constraint or alone beside response_format
    assert kind_of(plain, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}) == "json_compact"
    assert kind_of(flagged, structured_outputs={"json_object": True, "disable_any_whitespace": False}) == \
        "json_object"
    assert kind_of(plain, response_format=json_schema(None), structured_outputs={"disable_any_whitespace": True}) \
        == "json_compact"
    assert kind_of(flagged, response_format=json_schema(True),
                   structured_outputs={"disable_any_whitespace": False}) == "json"


def test_the_flag_parses_on_serve_and_gateway():
    parse = build_parser().parse_args
    assert parse(["serve", "--disable-any-whitespace"]).disable_any_whitespace is True
    assert parse(["serve"]).disable_any_whitespace is False
    assert parse(["gateway", "--worker", "127.0.0.1:9000", "--disable-any-whitespace"]).disable_any_whitespace

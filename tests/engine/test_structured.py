"""Structured outputs in the engine (inferd/engine/structured.py): JSON schemas, regexes, choices and grammars
constrain the tokens (real xgrammar, the default model in float32); seeded sampling, logprobs, speculative decoding
and replays keep working with them; logit_bias; compiles never stall the step."""

from __future__ import annotations

import json
import random
import re
import string

import jsonschema
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, InvalidRequestError, SamplingParams
from tests.parity import assert_same_output

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(smollm2_fp32):
    model, config, tokenizer = smollm2_fp32
    return Engine(model, config, EngineConfig(dtype="float32", kv_cache_bytes=128 << 20, record_logits=True),
                  torch.float32, tokenizer)


@pytest.fixture(scope="module")
def spec_engine(smollm2_fp32):
    model, config, tokenizer = smollm2_fp32
    return Engine(model, config, EngineConfig(dtype="float32", kv_cache_bytes=128 << 20, record_logits=True,
                                              speculative="ngram", ngram_min=1),
                  torch.float32, tokenizer)


def slow_grammar(alternatives: int, seed: int) -> str:
    """A unique grammar whose compile takes long: 3000 alternatives (48 KB) ~12 s on the 2-core machine."""
    r = random.Random(seed)
    words = [f'[^{r.choice(string.ascii_lowercase)}]* "{"".join(r.choices(string.ascii_lowercase, k=5))}"'
             for _ in range(alternatives)]
    return "root ::= (" + " | ".join(words) + ")*"


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def text_of(engine, req) -> str:
    ids = [t for t in req.output_token_ids if t not in engine.eos_token_ids]
    return engine.tokenizer.decode(ids)


SAMPLES = 10  # seeds 1000-1009 here: two of the three roles, ages 21 to 130 (the maximum), 0 to 3 tags, compact and
# spread-out JSON; 50 (the old count) took 2 to 3 times as long and reached no other path


def test_seeded_samples_at_temperature_one_parse_and_validate(engine):
    prompt = chat(engine.tokenizer, "Describe a user of our system as JSON.")
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=1000 + i, structured=("json", json.dumps(PERSON)))
              for i in range(SAMPLES)]
    reqs = engine.generate([prompt] * SAMPLES, params)
    for req in reqs:
        assert req.finish_reason.value == "stop", text_of(engine, req)
        assert req.output_token_ids[-1] in engine.eos_token_ids  # ended by the grammar's stop token
        jsonschema.validate(json.loads(text_of(engine, req)), PERSON)
    assert len({tuple(r.output_token_ids) for r in reqs}) == SAMPLES  # really sampled


def test_regex_choice_and_grammar_hold(engine):
    tok = engine.tokenizer
    prompt = chat(tok, "What is the capital of France? Answer briefly.")
    cases = [
        (("regex", r"[A-Z][a-z]{2,10}, [0-9]{4}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,10}, [0-9]{4}", t)),
        (("choice", json.dumps(["Paris", "Lyon", "Marseille"])), lambda t: t in ("Paris", "Lyon", "Marseille")),
        (("grammar", 'root ::= "The answer is " ("yes" | "no") "."'),
         lambda t: t in ("The answer is yes.", "The answer is no.")),
    ]
    bounded = ((0.0, 0), (1.0, 1), (1.0, 2), (1.5, 3))
    # JSON mode bounds nothing: hot samples of a 135M model may ramble inside a string until max_tokens
    cases = [(c, h, bounded) for c, h in cases] + [
        (("json_object", ""), lambda t: isinstance(json.loads(t), dict), ((0.0, 1), (0.3, 1), (0.7, 1)))]
    short = chat(tok, "Output JSON: the name and age of a person.")
    for structured, holds, draws in cases:
        params = [SamplingParams(max_tokens=96, temperature=t, seed=s, structured=structured) for t, s in draws]
        for req in engine.generate([short if structured[0] == "json_object" else prompt] * len(params), params):
            text = text_of(engine, req)
            assert req.finish_reason.value == "stop" and holds(text), (structured, text)


def test_logprobs_are_those_of_the_constrained_distribution(engine):
    prompt = chat(engine.tokenizer, "Is the sky blue?")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, structured=("choice", '["yes", "no"]'))
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    first = outs[0].logprobs[0]
    finite = [(t, lp) for t, lp in first.top if lp > float("-inf")]
    allowed = {t for t in range(engine.model_config.vocab_size)
               if engine.tokenizer.decode([t]) and ("yes".startswith(engine.tokenizer.decode([t]))
                                                    or "no".startswith(engine.tokenizer.decode([t])))}
    assert finite and all(t in allowed for t, _ in finite)
    assert abs(sum(torch.tensor([lp for _, lp in finite]).exp().tolist()) - 1.0) < 1e-4 or len(finite) == 5
    assert first.logprob > float("-inf")


def test_speculative_drafts_that_break_the_grammar_are_rejected_and_output_is_unchanged(engine, spec_engine):
    tok = engine.tokenizer
    # the prompt repeats a JSON object (drafts that fit) and prose (drafts the grammar refuses)
    sample = '{"name": "Ada Lovelace", "age": 36, "role": "admin", "address": {"city": "London", "zip": "12345"}, ' \
             '"tags": ["math", "poetry"]}'
    prompt = chat(tok, f"Repeat this JSON exactly: {sample} Then say: the name is Ada and the age is 36.")
    cases = [SamplingParams(max_tokens=100, temperature=1.0, seed=5, structured=("json", json.dumps(PERSON))),
             SamplingParams(max_tokens=30, temperature=0.0, structured=("regex", r"the name is [A-Za-z]+"))]
    before = (spec_engine.stats.spec_drafted, spec_engine.stats.spec_accepted)
    for params in cases:
        plain = engine.generate([prompt], params)[0]
        drafted = spec_engine.generate([prompt], params)[0]
        assert_same_output(drafted, plain, params, f"speculative {params.structured[0]}")
        jsonschema.validate(json.loads(text_of(engine, drafted)), PERSON) if params.structured[0] == "json" else None
    drafted_n = spec_engine.stats.spec_drafted - before[0]
    accepted_n = spec_engine.stats.spec_accepted - before[1]
    assert accepted_n > 0 and drafted_n > accepted_n  # drafts were verified, some kept and some refused


def test_a_replayed_constrained_request_continues_exactly(engine):
    prompt = chat(engine.tokenizer, "Describe a user of our system as JSON.")
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=4242, structured=("json", json.dumps(PERSON)))
    whole = engine.generate([prompt], params)[0]
    out = whole.output_token_ids
    for k in (len(out) // 2,):
        rid = engine.add_request(prompt + out[:k], params, num_prompt_tokens=len(prompt))
        replay = engine.requests[rid]
        while engine.has_unfinished_requests():
            engine.step()
        assert replay.output_token_ids[:k] == out[:k]
        assert_same_output(replay, whole, params, f"replay after {k} tokens")


def test_a_replay_whose_tokens_break_the_grammar_fails_alone(engine):
    prompt = chat(engine.tokenizer, "Say hi.")
    bad = engine.tokenizer.encode("hello", add_special_tokens=False)
    params = SamplingParams(max_tokens=20, temperature=0.0, structured=("regex", "[0-9]+"))
    other = engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0.0))
    rid = engine.add_request(prompt + bad, params, num_prompt_tokens=len(prompt))
    failed, outs = [], []
    while engine.has_unfinished_requests():
        outs += engine.step()
        failed += engine.take_failed()
    assert [f[0] for f in failed] == [rid] and "grammar" in failed[0][1]
    assert any(o.request_id == other and o.finished for o in outs)
    assert rid not in engine.requests and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_logit_bias(engine):
    tok = engine.tokenizer
    prompt = chat(tok, "What is the capital of France?")
    plain = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    first = plain.output_token_ids[0]
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    pushed = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0,
                                                      logit_bias=[[forced, 100.0]]))[0]
    assert pushed.output_token_ids == [forced] * 4
    banned = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0,
                                                      logit_bias=[[first, -100.0]]))[0]
    assert banned.output_token_ids[0] != first
    # before the grammar: a bias cannot bring back a token the grammar refuses
    capped = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, logit_bias=[[forced, 100.0]],
                                                      structured=("choice", '["Paris", "Rome"]')))[0]
    assert text_of(engine, capped) in ("Paris", "Rome")


def test_a_slow_compile_never_stalls_the_running_requests(engine):
    prompt = chat(engine.tokenizer, "Tell me a story.")
    running = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0))
    engine.step()
    # a unique grammar that compiles for seconds (in a compile process: grammar_compile.py)
    constrained = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                            structured=("grammar", slow_grammar(3000, seed=1))))
    done = False
    for _ in range(10):
        outs = engine.step()
        done = done or any(o.request_id == running and o.finished for o in outs)
    assert done  # the running request finished while the grammar was still compiling
    assert engine.requests[constrained].grammar_future is not None and not engine.requests[constrained].token_ids[
        engine.requests[constrained].num_prompt_tokens:]
    assert engine.abort(constrained)
    assert not engine.has_unfinished_requests()
    assert [o.finish_reason for o in engine.take_pending_outputs()] == ["abort"]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_an_aborted_request_awaiting_its_grammar_is_released(engine):
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, structured=("grammar", slow_grammar(3000, 2))))
    assert engine.has_unfinished_requests()
    assert engine.abort(rid)
    assert not engine.has_unfinished_requests()
    assert [o.finish_reason for o in engine.take_pending_outputs()] == ["abort"]


@pytest.mark.parametrize("structured,message", [
    (("json", '{"type": "nope"}'), "invalid json"),
    (("json", "{not json"), "not valid JSON"),
    (("regex", "(a"), "invalid regex"),
    (("choice", "[]"), "non-empty list"),
    (("grammar", "root ::= "), "invalid grammar"),
    (("yaml", "a: b"), "kind must be one of"),
    (("regex", "a" * (64 << 10 + 1)), "MAX_STRUCTURED_CHARS"),
])
def test_invalid_constraints_are_refused_before_scheduling(engine, structured, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, structured=structured))
    assert not engine.has_unfinished_requests()


def test_constraints_need_a_tokenizer(tiny_llama_dir):
    from inferd.models.build import load_model

    model, config, _ = load_model(str(tiny_llama_dir), dtype=torch.float32)
    bare = Engine(model, config, EngineConfig(dtype="float32", kv_cache_bytes=16 << 20), torch.float32, None)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        bare.add_request([1, 2, 3], SamplingParams(max_tokens=4, structured=("regex", "a")))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        bare.add_request([1, 2, 3], SamplingParams(max_tokens=4, logit_bias=[[10 ** 7, 1.0]]))


def test_preempted_constrained_requests_continue_exactly(engine, smollm2_fp32):
    """A pool too small for every request: constrained requests are preempted (recomputed) and still produce what
    they produce with room to spare (exactness rule), their grammar state untouched by the recompute."""
    model, config, tokenizer = smollm2_fp32
    small = Engine(model, config, EngineConfig(dtype="float32", kv_cache_bytes=9 << 20, block_size=16,
                                               record_logits=True), torch.float32, tokenizer)
    prompt = chat(tokenizer, "Describe a user of our system as JSON.")
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=900 + i, structured=("json", json.dumps(PERSON)))
              for i in range(4)]
    tight = small.generate([prompt] * 4, params)
    assert small.scheduler.num_preemptions > 0
    roomy = engine.generate([prompt] * 4, params)
    for a, b, p in zip(tight, roomy, params):
        assert_same_output(a, b, p, "preempted vs not")


def test_a_stop_string_ends_a_constrained_request(engine):
    prompt = chat(engine.tokenizer, "Describe a user of our system as JSON.")
    params = SamplingParams(max_tokens=120, temperature=0.0, stop=['"age"'], structured=("json", json.dumps(PERSON)))
    req = engine.generate([prompt], params)[0]
    assert req.finish_reason.value == "stop" and req.stop_reason == '"age"'

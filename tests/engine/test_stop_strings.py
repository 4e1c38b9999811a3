"""Stop strings and streamed text: the engine detokenizes incrementally, never emits a stop string (also when it
spans tokens), and stops the request at once."""

from __future__ import annotations

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.models.build import load_model


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    model, cfg, tok = load_model(str(tiny_llama_dir), dtype=torch.float32)
    return Engine(model, cfg, EngineConfig(kv_cache_bytes=32 << 20), torch.float32, tok)


def stream(engine, prompt_ids, params):
    rid = engine.add_request(prompt_ids, params)
    req = engine.requests[rid]
    chunks = []
    while engine.has_unfinished_requests():
        chunks += [o for o in engine.step() if o.request_id == rid]
    return req, chunks


def test_streamed_text_equals_the_decoded_output(engine):
    tok = engine.tokenizer
    req, chunks = stream(engine, tok.encode("Once upon a time"), SamplingParams(max_tokens=40, temperature=0,
                                                                                ignore_eos=True))
    assert "".join(c.new_text for c in chunks) == tok.decode(req.output_token_ids)
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"


def test_stop_string_spanning_tokens_never_leaks(engine):
    tok = engine.tokenizer
    prompt = tok.encode("The weather today")
    ref, _ = stream(engine, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    ids = ref.output_token_ids
    # a stop string that starts inside token 10's text and ends inside token 11's
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    a, b = pieces[10], pieces[12]
    assert len(b) - len(a) >= 2, "tokens 10-11 decode to too little text for this test"
    stop = b[len(a) + 1:len(b) - 1] if len(b) - len(a) >= 4 else b[len(a):]
    first = pieces[-1].find(stop)
    req, chunks = stream(engine, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                        stop=["never-appears", stop]))
    text = "".join(c.new_text for c in chunks)
    assert text == pieces[-1][:first]
    assert stop not in text
    assert req.finish_reason.value == "stop" and req.stop_reason == stop
    assert req.num_output_tokens < len(ids)  # stopped at once, not at max_tokens
    # no chunk ever carried part of the stop string beyond what the final text keeps
    assert all(not c.new_text or text.find(c.new_text) != -1 for c in chunks)
    engine.kv_cache.check_no_leaks()


def test_earliest_stop_string_wins(engine):
    tok = engine.tokenizer
    prompt = tok.encode("List of words:")
    ref, _ = stream(engine, prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    full = tok.decode(ref.output_token_ids)
    early, late = full[3:5], full[-4:-2]
    if full.find(early) >= full.find(late):
        pytest.fail("test setup: expected the early stop to occur first")
    req, chunks = stream(engine, prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                        stop=[late, early]))
    assert "".join(c.new_text for c in chunks) == full[:full.find(early)]
    assert req.stop_reason == early


def test_detokenize_off_sends_no_text_but_still_honours_stop_strings(engine, tiny_llama_dir):
    model, cfg, tok = engine.runner.model, engine.model_config, engine.tokenizer
    quiet = Engine(model, cfg, EngineConfig(kv_cache_bytes=32 << 20, detokenize=False), torch.float32, tok)
    prompt = tok.encode("The weather today")
    req, chunks = stream(quiet, prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert all(c.new_text == "" for c in chunks) and req.num_output_tokens == 20
    full = tok.decode(req.output_token_ids)
    stop = full[5:8]
    req, chunks = stream(quiet, prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))
    assert req.stop_reason == stop and "".join(c.new_text for c in chunks) == full[:full.find(stop)]

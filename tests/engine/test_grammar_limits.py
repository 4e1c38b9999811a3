"""The time budgets of a request's grammar in the engine (grammar_budget.py, grammar_compile.py), with real xgrammar,
real compile processes and the default model: an abort kills a compile that no other request waits for and keeps
one that another request shares; a request past its whole budget of mask time, or whose replay through its matcher
takes longer than that budget, ends with grammar_too_slow while the others carry on."""

from __future__ import annotations

import json
import time

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from servers import process_gone
from tests.engine.test_structured import chat, slow_grammar

HOSTILE = 'root ::= x*\nx ::= "a" | "aa" | "aaa" | x x'


def make_engine(smollm2_fp32, **budgets) -> Engine:
    model, config, tokenizer = smollm2_fp32
    return Engine(model, config, EngineConfig(dtype="float32", kv_cache_bytes=64 << 20, **budgets), torch.float32,
                  tokenizer)


def run(engine: Engine, deadline_s: float = 300) -> tuple[dict, dict]:
    """Steps until nothing is left: (request id -> its last output, request id -> (why, code) of those failed)."""
    last, failed = {}, {}
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            last[out.request_id] = out
        for request_id, why, code in engine.take_failed():
            failed[request_id] = (why, code)
    return last, failed


@pytest.fixture(scope="module")
def engine(smollm2_fp32):
    e = make_engine(smollm2_fp32, grammar_compile_timeout_s=120.0)  # the compiles here end by abort, not budget
    yield e
    e.close()


def test_an_abort_kills_the_compile_nobody_else_waits_for(engine):
    prompt = chat(engine.tokenizer, "Say something.")
    shared = ("grammar", slow_grammar(500, seed=11))  # a few seconds of compile
    alone = ("grammar", slow_grammar(3000, seed=12))
    leaving = engine.add_request(prompt, SamplingParams(max_tokens=4, structured=shared))
    staying = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, structured=shared))
    solo = engine.add_request(prompt, SamplingParams(max_tokens=4, structured=alone))
    compiler = engine.grammars.compiler()
    deadline = time.monotonic() + 60
    while len(compiler.pids()) < 2 or compiler.busy() < 2:  # both compiles running, each in its process
        assert time.monotonic() < deadline
        engine.step()
    pid_of = {s.job.key: s.proc.pid for s in compiler._slots if s.job is not None}
    assert engine.abort(leaving) and engine.abort(solo)
    deadline = time.monotonic() + 2
    while not process_gone(pid_of[alone]):  # nobody waits for it any more: killed at once
        assert time.monotonic() < deadline, "the abandoned compile still runs"
        time.sleep(0.01)
    assert not process_gone(pid_of[shared])  # still wanted: it carries on
    last, failed = run(engine)
    assert not failed and last[staying].finished and last[staying].finish_reason in ("stop", "length")
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_a_request_past_its_whole_mask_budget_ends_alone(smollm2_fp32):
    e = make_engine(smollm2_fp32, grammar_mask_budget_s=1e-4)  # 0.1 ms of grammar work in all: spent at once
    try:
        prompt = chat(e.tokenizer, "Describe a user as JSON.")
        schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}})
        greedy = e.add_request(prompt, SamplingParams(max_tokens=200, temperature=0, structured=("json", schema)))
        plain = e.add_request(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        last, failed = run(e)
        why, code = failed[greedy]
        assert code == "grammar_too_slow" and "in all, over its budget of 0.0001 s" in why
        assert last[plain].finish_reason == "length" and last[plain].num_output_tokens == 24
        assert e.kv_cache.num_free_blocks == e.kv_cache.num_blocks
    finally:
        e.close()


def test_a_replay_whose_tokens_cost_more_than_the_budget_ends_with_grammar_too_slow(smollm2_fp32):
    e = make_engine(smollm2_fp32, grammar_mask_budget_s=0.5)
    try:
        aaaa = e.tokenizer.hf.convert_tokens_to_ids("aaaa")
        prompt = chat(e.tokenizer, "Write a's.")
        # a stream replayed on this worker after 160 tokens of the ambiguous grammar: its new matcher must accept
        # them all, seconds of work (~n^4 in all), not on the step thread and not past the request's budget
        rid = e.add_request(prompt + [aaaa] * 160, SamplingParams(max_tokens=200, structured=("grammar", HOSTILE)),
                            num_prompt_tokens=len(prompt))
        plain = e.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        last, failed = run(e)
        why, code = failed[rid]
        assert code == "grammar_too_slow" and "replaying its earlier tokens" in why
        assert last[plain].finish_reason == "length"
    finally:
        e.close()


def test_the_budget_flags_reach_the_engine_and_the_workers():
    import argparse

    from inferd.cli.engine_flags import add_engine_args, engine_config
    from inferd.cli.serve import worker_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--grammar-mask-budget-ms", "20", "--grammar-mask-budget-s", "3", "--grammar-compile-timeout",
                         "2.5", "--grammar-compile-processes", "3"])
    args.heartbeat_interval, args.echo = 0.5, False
    cfg = engine_config(args)
    assert (cfg.grammar_mask_budget_ms, cfg.grammar_mask_budget_s, cfg.grammar_compile_timeout_s,
            cfg.grammar_compile_processes) == (20.0, 3.0, 2.5, 3)
    forwarded = worker_args(args, "m")  # what `inferd serve` passes to its worker processes
    assert [forwarded[forwarded.index(f) + 1] for f in ("--grammar-mask-budget-ms", "--grammar-mask-budget-s",
                                                        "--grammar-compile-timeout", "--grammar-compile-processes")] \
        == ["20.0", "3.0", "2.5", "3"]
    defaults = p.parse_args([])
    defaults.heartbeat_interval, defaults.echo = 0.5, False
    assert not [a for a in worker_args(defaults, "m") if a.startswith("--grammar")]
    for bad in (["--grammar-compile-processes", "0"], ["--grammar-mask-budget-ms", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)

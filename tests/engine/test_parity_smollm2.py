"""Greedy parity with transformers on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, fp32): staggered
arrivals, a pool so small that preemption happens, a step budget below the prompt lengths, shared prefixes.
The transformers reference (18 s to load the GGUF, ~50 ms a token) is committed, compact (tests/data/hf-reference:
tokens and the 64 largest logits of each position), keyed by model, versions and prompt; a missing one is computed."""

from __future__ import annotations

import os

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from parity import assert_greedy_parity, hf_greedy, run_staggered

PREAMBLE = ("You are a careful assistant for a small public library. Answer the patron's question in two or "
            "three sentences, in plain English, and mention one book they could borrow. Question: ")
TEXTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three facts about the moon:\n1.",
    PREAMBLE + "How do plants make food?",
    PREAMBLE + "Why is the sky blue during the day and red at sunset?",
    PREAMBLE + "What is the difference between weather and climate, and how do scientists measure each?",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who "
    "had never once left the valley. Every morning he opened his shop, wound every clock on the walls, "
    "and waited for the travellers who came over the mountain pass. One winter morning,",
]
MAX_NEW = [32, 24, 40, 28, 36, 30, 34, 40]


@pytest.fixture(scope="module")
def smol(request, smollm2_fp32, smollm2_gguf_path):
    model, cfg, tok = smollm2_fp32
    prompts = [tok.encode(t) for t in TEXTS]

    def get_hf():  # loaded only when a reference is missing from the disk cache
        return request.getfixturevalue("hf_smollm2_fp32")

    key = f"smollm2-gguf:{os.path.getsize(smollm2_gguf_path)}:fp32"
    refs = [hf_greedy(get_hf, p, n, cache_key=key, committed=True) for p, n in zip(prompts, MAX_NEW)]
    return model, cfg, tok, prompts, refs


SCENARIOS = {
    "staggered": (dict(max_num_batched_tokens=48, max_num_seqs=8), None, 2),
    "preemption": (dict(max_num_batched_tokens=96, max_num_seqs=8), 16, 1),
    "prefix": (dict(max_num_batched_tokens=512, max_num_seqs=8), None, 4),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_smollm2_greedy_parity(smol, scenario):
    model, cfg, tok, prompts, refs = smol
    kw, blocks, every = SCENARIOS[scenario]
    per_block = kv_bytes_per_block(cfg, 16, torch.float32)
    engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=per_block * (blocks or 128), record_logits=True, **kw),
                    torch.float32, tok)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
    reqs, trace = run_staggered(engine, prompts, params, every=every)
    exact = [assert_greedy_parity(r.output_token_ids, r.debug_logits, ref, f"prompt {i}")
             for i, (r, ref) in enumerate(zip(reqs, refs))]
    assert sum(exact) >= sum(MAX_NEW) // 2, exact  # near-ties are rare: most tokens are compared exactly
    engine.kv_cache.check_no_leaks()
    assert any(d > 0 and p > 0 for d, p, _ in trace)
    assert any(f > 0 and d > f for d, _, f in trace)
    if scenario == "staggered":
        assert max(len(p) for p in prompts) > kw["max_num_batched_tokens"]  # chunked prefill happened
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if scenario == "prefix":
        assert engine.kv_cache.stats.hits > 0
        assert reqs[5].num_cached_tokens >= 16 and reqs[6].num_cached_tokens >= 16

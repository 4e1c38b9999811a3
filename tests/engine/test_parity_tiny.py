"""Greedy parity with transformers on tiny random Llama (Llama 3 rope scaling, untied head) and Qwen2 (QKV bias,
tied embeddings) models, under staggered arrivals, chunked prefill, preemption and prefix sharing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from parity import assert_greedy_parity, hf_greedy, run_staggered

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.models.build import load_model

PROMPT_LENS = [3, 9, 17, 31, 47, 64, 90, 130]
MAX_NEW = [24, 30, 18, 28, 22, 32, 20, 26]
SHARED_PREFIX = 48  # the three longest prompts start with the same 48 tokens


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_llama_dir, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    model, cfg, tok = load_model(str(path), dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    for p in prompts[5:]:
        p[:SHARED_PREFIX] = prompts[5][:SHARED_PREFIX]
    refs = [hf_greedy(lambda: hf, p, n) for p, n in zip(prompts, MAX_NEW)]
    return SimpleNamespace(name=request.param, model=model, cfg=cfg, tok=tok, prompts=prompts, refs=refs)


def make_engine(t, blocks: int | None = None, **kw) -> Engine:
    from inferd.engine.runner import kv_bytes_per_block

    per_block = kv_bytes_per_block(t.cfg, 16, torch.float32)
    config = EngineConfig(kv_cache_bytes=per_block * (blocks or 256), record_logits=True, **kw)
    return Engine(t.model, t.cfg, config, torch.float32, t.tok)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def check_all(t, reqs) -> None:
    for i, (req, ref) in enumerate(zip(reqs, t.refs)):
        assert req.finish_reason.value == "length"
        assert_greedy_parity(req.output_token_ids, req.debug_logits, ref, f"{t.name} prompt {i}")


SCENARIOS = {
    # name: (engine kwargs, blocks, stagger)
    "staggered": (dict(max_num_batched_tokens=40, max_num_seqs=8), None, 2),
    "chunked": (dict(max_num_batched_tokens=16, max_num_seqs=16), None, 1),
    "preemption": (dict(max_num_batched_tokens=64, max_num_seqs=8), 14, 1),
    "prefix": (dict(max_num_batched_tokens=256, max_num_seqs=8), None, 6),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_parity(tiny, scenario):
    kw, blocks, every = SCENARIOS[scenario]
    engine = make_engine(tiny, blocks, **kw)
    reqs, trace = run_staggered(engine, tiny.prompts, [greedy(n) for n in MAX_NEW], every=every)
    check_all(tiny, reqs)
    engine.kv_cache.check_no_leaks()
    # the requests shared batches in every phase: decodes beside prefill chunks, finishes beside running work
    assert any(d > 0 and p > 0 for d, p, _ in trace), trace
    assert any(f > 0 and d > f for d, _, f in trace), trace
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if scenario == "chunked":
        assert max(PROMPT_LENS) > kw["max_num_batched_tokens"]
        assert any(p > 0 and d + p > 1 for d, p, _ in trace)
    if scenario == "prefix":
        # prompts 6 and 7 arrive after prompt 5's shared blocks are computed: 3 full blocks each
        assert engine.kv_cache.stats.hits >= 2 * (SHARED_PREFIX // 16) * 16
        assert reqs[6].num_cached_tokens == reqs[7].num_cached_tokens == SHARED_PREFIX

"""Greedy parity with transformers on tiny random Llama (Llama 3 rope scaling, untied head) and Qwen2 (QKV bias,
tied embeddings) models, under staggered arrivals, chunked prefill, preemption and prefix sharing; and the proof that
the comparison can fail: the same comparison of deliberately wrong models (a wrong RMSNorm epsilon, RoPE base, key
head order) must fail it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.models.build import build_model, load_model
from parity import assert_greedy_parity, hf_greedy, run_staggered

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
    return SimpleNamespace(name=request.param, model=model, cfg=cfg, tok=tok, prompts=prompts, refs=refs,
                           hf_state=hf.state_dict())


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


def _swap_key_heads(state: dict, cfg) -> dict:
    """Every layer's two KV heads' key projections swapped: each query head reads the other group's keys."""
    state = dict(state)
    d = cfg.head_dim
    for name in [n for n in state if n.endswith("k_proj.weight") or n.endswith("k_proj.bias")]:
        w = state[name].clone()
        w[:d], w[d:2 * d] = state[name][d:2 * d], state[name][:d]
        state[name] = w
    return state


MUTATIONS = {
    # name: (the config ours is built with, the weights)
    "rms-norm-eps": (lambda cfg: dataclasses.replace(cfg, rms_norm_eps=1e-5), None),  # transformers': 1e-6
    "rope-base": (lambda cfg: dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 1.01), None),
    "key-head-order": (None, _swap_key_heads),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_wrong_model_fails_the_rule(tiny, mutation):
    """The staggered comparison above, of a model built wrong: the rule must fail it. Under the rule as it was (an
    allowance of 10x the largest logit difference seen) the epsilon and RoPE-base mutations passed every parity
    test; now the first compared position's logits are beyond the float32 bound."""
    change_cfg, change_weights = MUTATIONS[mutation]
    cfg = change_cfg(tiny.cfg) if change_cfg else tiny.cfg
    assert cfg.num_key_value_heads == 2
    state = change_weights(tiny.hf_state, tiny.cfg) if change_weights else tiny.hf_state
    wrong = SimpleNamespace(**{**vars(tiny), "model": build_model(cfg, state, torch.float32), "cfg": cfg})
    kw, blocks, every = SCENARIOS["staggered"]
    reqs, _ = run_staggered(make_engine(wrong, blocks, **kw), tiny.prompts, [greedy(n) for n in MAX_NEW], every)
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        check_all(tiny, reqs)

"""Prompt logprobs (inferd/engine/prompt_logprobs.py) against transformers, token for token and logprob for logprob,
in float32 on the tiny random Llama: across chunked prefill, staggered arrivals beside other requests' decodes,
preemption, a prefix already in the cache, and a replay; and the proof that the comparison can fail (a wrong
RMSNorm epsilon)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from inferd.models.build import build_model, load_model
from parity import FP32, scale_of

PROMPT_LENS = [2, 19, 40, 57, 73]
TOP_N = 3


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model, cfg, tok = load_model(str(tiny_llama_dir), dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    prompts[4][:32] = prompts[3][:32]  # the last two share two blocks: the second would hit the prefix cache
    with torch.no_grad():
        refs = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]
    return dict(model=model, cfg=cfg, tok=tok, prompts=prompts, refs=refs, hf_state=hf.state_dict())


def make_engine(t, model=None, blocks: int = 256, **kw) -> Engine:
    per_block = kv_bytes_per_block(t["cfg"], 16, torch.float32)
    config = EngineConfig(kv_cache_bytes=per_block * blocks, **kw)
    return Engine(model or t["model"], t["cfg"], config, torch.float32, t["tok"])


def params(prompt_logprobs: int | None = TOP_N, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=prompt_logprobs)


def run(engine: Engine, prompts, plist, every: int = 2, num_prompt_tokens=None) -> list[list]:
    """Submits prompt k at step k * every; returns each request's outputs."""
    pending, ids, outs = list(range(len(prompts))), {}, {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            i = pending.pop(0)
            n = None if num_prompt_tokens is None else num_prompt_tokens[i]
            ids[engine.add_request(prompts[i], plist[i], num_prompt_tokens=n)] = i
        for o in engine.step():
            outs.setdefault(ids[o.request_id], []).append(o)
        step += 1
        assert step < 10_000
    return [outs[i] for i in range(len(prompts))]


def check(prompt: list[int], ref: torch.Tensor, entries, top_n: int = TOP_N, label: str = "") -> None:
    """Every position's logprob within the float32 bound of transformers' log_softmax (of the position before's
    logits), the first position None, and the top-n: the reference's most likely tokens and values. A logprob
    difference is at most twice the logits' (the target's and the normaliser's), hence the bound's 2x."""
    assert len(entries) == len(prompt), f"{label}: {len(entries)} entries for {len(prompt)} prompt tokens"
    assert entries[0] is None
    for p in range(1, len(prompt)):
        e, row = entries[p], ref[p - 1]
        tol = 2 * FP32.tolerance(scale_of(row))
        assert e.token_id == prompt[p], f"{label} position {p}"
        assert abs(e.logprob - float(row[prompt[p]])) <= tol, \
            f"{label} position {p}: {e.logprob} vs {float(row[prompt[p]])}: beyond the float32 bound"
        assert len(e.top) == top_n
        values, ids = torch.topk(row, top_n)
        for (tid, v), rid, rv in zip(e.top, ids.tolist(), values.tolist()):
            assert abs(v - rv) <= tol, f"{label} position {p}: top value beyond the float32 bound"
            assert tid == rid or abs(float(row[tid]) - rv) <= tol, f"{label} position {p}: top ids differ"


def prompt_entries(outputs) -> list:
    carrying = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outputs[0], "the first output, and it alone, carries them"
    return carrying[0].prompt_logprobs


SCENARIOS = {
    # chunks of 16 tokens: every prompt but the first spans several chunks, beside other requests' decodes
    "chunked": (dict(max_num_batched_tokens=16, max_num_seqs=8), 256, 6),
    # 9 blocks for five requests of 40 new tokens: some are preempted (recomputed) before and after their prompt
    # logprobs left
    "preemption": (dict(max_num_batched_tokens=32, max_num_seqs=8), 9, 40),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_prompt_logprobs_match_transformers(tiny, scenario):
    kw, blocks, new = SCENARIOS[scenario]
    engine = make_engine(tiny, blocks=blocks, **kw)
    outs = run(engine, tiny["prompts"], [params(max_tokens=new) for _ in PROMPT_LENS], every=1)
    for i, (prompt, ref, o) in enumerate(zip(tiny["prompts"], tiny["refs"], outs)):
        check(prompt, ref, prompt_entries(o), label=f"{scenario} prompt {i}")
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    engine.kv_cache.check_no_leaks()


def test_a_cached_prefix_is_computed_again_and_still_published(tiny):
    """The prefix cache: a request asking for prompt logprobs takes no hit (every position runs), its blocks are
    published all the same, and a request after it without prompt logprobs hits them."""
    engine = make_engine(tiny, max_num_batched_tokens=256)
    prompt, ref = tiny["prompts"][3], tiny["refs"][3]
    first = run(engine, [prompt], [params(max_tokens=1)])[0]
    again = run(engine, [prompt], [params(max_tokens=1)])[0]
    plain = run(engine, [prompt], [params(None, max_tokens=1)])[0]
    check(prompt, ref, prompt_entries(first), label="first")
    check(prompt, ref, prompt_entries(again), label="again")
    assert again[-1].num_cached_tokens == 0
    assert plain[-1].num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert plain[0].prompt_logprobs is None


def test_top_zero_and_a_replay(tiny):
    """prompt_logprobs=0: the prompt tokens' own logprobs, no top. A replay (prompt + two tokens generated before,
    num_prompt_tokens the original's) has entries for its original prompt only."""
    engine = make_engine(tiny, max_num_batched_tokens=16, max_num_seqs=8)
    prompt, ref = tiny["prompts"][2], tiny["refs"][2]
    replayed = prompt + [5, 7]
    outs = run(engine, [prompt, replayed], [params(0), params(0)], num_prompt_tokens=[None, len(prompt)])
    check(prompt, ref, prompt_entries(outs[0]), top_n=0, label="top 0")
    check(prompt, ref, prompt_entries(outs[1]), top_n=0, label="replay")


def test_a_wrong_model_fails_the_comparison(tiny):
    """The same comparison of a model built with the wrong RMSNorm epsilon must fail."""
    cfg = dataclasses.replace(tiny["cfg"], rms_norm_eps=1e-5)  # transformers': 1e-6
    wrong = build_model(cfg, tiny["hf_state"], torch.float32)
    engine = make_engine({**tiny, "cfg": cfg}, model=wrong, max_num_batched_tokens=16, max_num_seqs=8)
    outs = run(engine, tiny["prompts"][1:3], [params(), params()])
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        for prompt, ref, o in zip(tiny["prompts"][1:3], tiny["refs"][1:3], outs):
            check(prompt, ref, prompt_entries(o))

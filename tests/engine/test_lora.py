"""LoRA adapters in the engine (inferd/engine/lora.py, inferd/models/lora.py), on the tiny random Llama in float32
against transformers with each adapter merged by hand (W + scale * B A), by the exactness rule: each adapter alone,
a staggered batch mixing three adapters and the base model, more adapters than slots (eviction and reload), the
prefix cache keyed by adapter, and a mutation (a wrong scale) that the comparison must fail."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from lora_adapters import merged_hf_model, write_adapter

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.models.loader import load_model_config
from inferd.models.lora_format import read_adapter
from parity import assert_greedy_parity, hf_greedy, run_staggered

MAX_NEW = 12
PROMPT_LENS = [5, 23, 40]


@pytest.fixture(scope="module")
def lora(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    dirs = {
        "all-r8": write_adapter(root / "all-r8", tiny_llama_dir, rank=8, seed=1),
        "qv-r4": write_adapter(root / "qv-r4", tiny_llama_dir, rank=4, seed=2, modules=("q_proj", "v_proj"),
                               std=0.2),
        "mlp-rs": write_adapter(root / "mlp-rs", tiny_llama_dir, rank=8, seed=3, use_rslora=True,
                                modules=("gate_proj", "up_proj", "down_proj", "o_proj")),
    }
    cfg = load_model_config(tiny_llama_dir)
    specs = {name: read_adapter(str(d), cfg, max_rank=8, max_bytes=1 << 30) for name, d in dirs.items()}
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    refs = {None: [hf_greedy(lambda: base, p, MAX_NEW) for p in prompts]}
    # per model, a prompt that holds its own greedy output: P + its output + P, so that n-gram drafts find matches
    spec_prompts, spec_refs = {}, {}
    for name, d in [(None, None), *dirs.items()]:
        merged = base if d is None else merged_hf_model(tiny_llama_dir, d)
        if d is not None:
            refs[name] = [hf_greedy(lambda m=merged: m, p, MAX_NEW) for p in prompts]
        spec_prompts[name] = prompts[0] + refs[name][0].tokens + prompts[0]
        spec_refs[name] = hf_greedy(lambda m=merged: m, spec_prompts[name], MAX_NEW)
    return SimpleNamespace(dirs=dirs, specs=specs, prompts=prompts, refs=refs, model_dir=tiny_llama_dir,
                           spec_prompts=spec_prompts, spec_refs=spec_refs)


def engine(lora, **kw) -> Engine:
    config = dict(model=str(lora.model_dir), dtype="float32", kv_cache_bytes=16 << 20, max_model_len=256,
                  record_logits=True, enable_lora=True, max_lora_rank=8, max_num_batched_tokens=64, max_num_seqs=8)
    config.update(kw)
    return Engine.from_config(EngineConfig(**config))


def params(lora, name: str | None) -> SamplingParams:
    ref = None if name is None else [name, lora.specs[name].path, lora.specs[name].digest]
    return SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, lora=ref)


def test_each_adapter_changes_the_outputs(lora):
    """Otherwise the comparisons below would prove nothing."""
    for name in lora.dirs:
        assert any(a.tokens != b.tokens for a, b in zip(lora.refs[name], lora.refs[None])), name


def test_a_mixed_batch_matches_each_request_alone(lora):
    """Three adapters and the base model in the same steps, decodes beside prefill chunks: each request's logits are
    those of its adapter alone."""
    e = engine(lora, max_loras=3, max_num_batched_tokens=32)
    jobs = [(name, i) for i in range(len(lora.prompts)) for name in [None, *lora.dirs]]
    mixed = []
    reqs, trace = run_staggered(e, [lora.prompts[i] for _, i in jobs], [params(lora, n) for n, _ in jobs], every=1,
                                on_step=lambda: mixed.append(len({s.request.lora_slot
                                                                  for s in e.last_schedule.scheduled})))
    for (name, i), req in zip(jobs, reqs):
        assert_greedy_parity(req.output_token_ids, req.debug_logits, lora.refs[name][i], f"{name} prompt {i}")
    assert any(d > 0 and p > 0 for d, p, _ in trace)
    assert max(mixed) == 4  # a step ran the three adapters' rows and the base model's
    e.kv_cache.check_no_leaks()


def test_each_adapter_alone_through_one_slot(lora):
    """One slot for three adapters: each adapter's requests run alone (the others wait for the slot, and the base
    model's, which need none, run beside), each matching transformers on its merged weights; the adapter in the slot
    is evicted for the next, and one used before is loaded again from host memory, not from disk."""
    e = engine(lora, max_loras=1)
    names = list(lora.dirs)
    jobs = [(names[k % 3], k % len(lora.prompts)) for k in range(9)] + [(None, 1), (names[0], 1)]
    reqs, _ = run_staggered(e, [lora.prompts[i] for _, i in jobs[:10]], [params(lora, n) for n, _ in jobs[:10]],
                            every=1)
    assert (e.lora.loads, e.lora.evictions) == (3, 2)
    reqs += run_staggered(e, [lora.prompts[jobs[10][1]]], params(lora, jobs[10][0]))[0]
    for (name, i), req in zip(jobs, reqs):
        assert_greedy_parity(req.output_token_ids, req.debug_logits, lora.refs[name][i], f"{name} prompt {i}")
    assert (e.lora.loads, e.lora.evictions) == (4, 3)  # the first adapter again
    assert e.lora.disk_reads == 3  # evicted to host memory, not read from disk again
    e.kv_cache.check_no_leaks()


def test_a_step_mixes_adapters(lora):
    """One step's rows carry several adapters and the base (not one adapter per step)."""
    e = engine(lora, max_loras=4)
    for name in [None, *lora.dirs]:
        e.add_request(lora.prompts[0], params(lora, name))
    e.step()
    slots = e.lora.state
    assert len({s.request.lora_slot for s in e.last_schedule.scheduled}) == 4
    assert slots.step is None  # grouped for the step only
    while e.has_unfinished_requests():
        e.step()


def test_the_prefix_cache_is_keyed_by_adapter(lora):
    e = engine(lora, max_loras=2)
    prompt = lora.prompts[2]  # 40 tokens: two full blocks
    done = []
    for name in [None, "all-r8", "all-r8", None]:
        rid = e.add_request(prompt, params(lora, name))
        req = e.requests[rid]
        while e.has_unfinished_requests():
            e.step()
        done.append(req.num_cached_tokens)
    # the base model's blocks never serve the adapter, the adapter's serve the adapter, the base's the base
    assert done[0] == 0 and done[1] == 0 and done[2] > 0 and done[3] > 0, done


def test_a_wrong_scale_fails_the_rule(lora, tmp_path):
    """The comparison can fail: the same adapter with lora_alpha off by 5% must be beyond the float32 bound."""
    import shutil

    wrong = tmp_path / "wrong"
    shutil.copytree(lora.dirs["all-r8"], wrong)
    cfg = json.loads((wrong / "adapter_config.json").read_text())
    cfg["lora_alpha"] *= 1.05
    (wrong / "adapter_config.json").write_text(json.dumps(cfg))
    spec = read_adapter(str(wrong), load_model_config(lora.model_dir), max_rank=8, max_bytes=1 << 30)
    e = engine(lora)
    p = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, lora=["wrong", spec.path, spec.digest])
    reqs, _ = run_staggered(e, lora.prompts[:1], p)
    with pytest.raises(AssertionError, match="beyond the float32 bound"):
        assert_greedy_parity(reqs[0].output_token_ids, reqs[0].debug_logits, lora.refs["all-r8"][0], "wrong scale")


def test_a_request_for_an_adapter_on_an_engine_without_lora_is_refused(lora):
    from inferd.engine.errors import InvalidRequestError

    e = Engine.from_config(EngineConfig(model=str(lora.model_dir), dtype="float32", kv_cache_bytes=8 << 20,
                                        max_model_len=256))
    with pytest.raises(InvalidRequestError, match="no LoRA adapters"):
        e.add_request([1, 2, 3], params(lora, "all-r8"))


def test_speculative_decoding_verifies_drafts_with_the_adapter(lora):
    """n-gram drafts verified in one pass with each row's adapter: the outputs are still the adapter's."""
    e = engine(lora, speculative="ngram", num_draft=3, ngram_min=1)
    names = [None, *lora.dirs]
    reqs, _ = run_staggered(e, [lora.spec_prompts[n] for n in names], [params(lora, n) for n in names], every=1)
    for name, req in zip(names, reqs):
        assert_greedy_parity(req.output_token_ids, req.debug_logits, lora.spec_refs[name], f"{name} speculative")
    # drafts were verified beside the adapters' rows (a request's k + 1 rows all through its adapter: a request
    # counted as one row would give the next request's first row the wrong adapter)
    assert e.stats.spec_drafted > 0


def test_structured_outputs_with_an_adapter(lora):
    e = engine(lora, max_loras=2)
    choices = ["red", "green", "blue"]
    spec = lora.specs["all-r8"]
    p = SamplingParams(max_tokens=8, temperature=0, structured=("choice", json.dumps(choices)),
                       lora=["all-r8", spec.path, spec.digest])
    req = e.generate([lora.prompts[1]], p)[0]
    assert e.tokenizer.decode(req.output_token_ids) in choices
    assert e.lora.loads == 1


def test_a_request_whose_adapter_is_gone_ends_with_an_error(lora, tmp_path):
    """Its files deleted after the gateway checked them: the request ends (adapter_unavailable), it does not wait
    for an adapter that is never coming, and the others run."""
    import shutil

    gone = tmp_path / "gone"
    shutil.copytree(lora.dirs["qv-r4"], gone)
    spec = read_adapter(str(gone), load_model_config(lora.model_dir), max_rank=8, max_bytes=1 << 30)
    shutil.rmtree(gone)
    e = engine(lora)
    bad = e.add_request(lora.prompts[0], SamplingParams(max_tokens=4, lora=["gone", spec.path, spec.digest]))
    good = e.add_request(lora.prompts[0], params(lora, "all-r8"))
    done = e.requests[good]
    while e.has_unfinished_requests():
        e.step()
    failed = e.take_failed()
    assert [(rid, code) for rid, _, code in failed] == [(bad, "adapter_unavailable")]
    assert "no adapter folder" in failed[0][1]
    assert len(done.output_token_ids) == MAX_NEW
    e.kv_cache.check_no_leaks()

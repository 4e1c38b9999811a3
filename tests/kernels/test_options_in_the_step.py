"""A model whose layers have the attention options (a sliding window on layer 0, a soft-cap on layer 1, sinks on
both, partial rotary: RoPE on half of each head) runs them in the fast ops -- the fused CPU ops and the Triton
kernels (interpreted) -- where the step calls them (inferd/models/attention.py passes window, sinks and softcap as
keywords), and its engine agrees with the same engine on the references, greedy, under the exactness rule
(tests/parity.py). A tiny random Llama (2 layers, 3 query heads over 1 KV head of 32: the Triton kernels' smallest
head_dim) with the options set on its Attention modules; prompts longer than the window, chunked prefill beside
decodes."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest.py does it first; kept for running this file alone

import pytest  # noqa: E402
import torch  # noqa: E402

from inferd.config import EngineConfig  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.engine.runner import kv_bytes_per_block  # noqa: E402
from parity import PEAKED_INIT, assert_same_rows, run_staggered  # noqa: E402

WINDOW, SOFTCAP = 7, 2.0
MAX_NEW = 4


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from inferd.models.build import build_model
    from inferd.models.config import ModelConfig

    torch.manual_seed(5)
    hf_cfg = LlamaConfig(vocab_size=384, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256, eos_token_id=2,
                         bos_token_id=1, tie_word_embeddings=True, initializer_range=PEAKED_INIT)
    cfg = dataclasses.replace(ModelConfig.from_hf_dict(hf_cfg.to_dict()), partial_rotary_factor=0.5)
    model = build_model(cfg, LlamaForCausalLM(hf_cfg).eval().state_dict(), torch.float32)
    g = torch.Generator().manual_seed(6)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        assert attn.partial_rotary
        attn.window = WINDOW if i == 0 else 0
        attn.softcap = SOFTCAP if i == 1 else 0.0
        attn.sinks = torch.nn.Parameter(torch.randn(attn.n_heads, generator=g))
    return model, cfg


def _run(kernels: str, calls: list | None = None):
    model, cfg = _model()
    config = EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.float32) * 32, record_logits=True,
                          kernels=kernels, max_num_batched_tokens=16, max_num_seqs=4)
    engine = Engine(model, cfg, config, torch.float32)
    ops = engine.runner.model.ops
    if calls is not None:  # record the options each attention op is called with (the op itself runs)
        for name in ("paged_decode_attention", "paged_prefill_attention"):
            op = getattr(ops, name)
            if op is not None:
                def spy(*args, _op=op, _name=name, **kw):
                    calls.append((_name, kw.get("window"), kw.get("sinks") is not None, kw.get("softcap")))
                    return _op(*args, **kw)
                setattr(ops, name, spy)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (20, 9)]
    reqs, _ = run_staggered(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    engine.kv_cache.check_no_leaks()
    return [(list(r.output_token_ids), [x.float() for x in r.debug_logits]) for r in reqs], ops


@pytest.fixture(scope="module")
def reference_run():
    out, ops = _run("reference")
    assert ops.name == "reference"
    return out


@pytest.mark.parametrize("kernels", ["fused", "triton"])
def test_the_fast_ops_run_the_options(reference_run, kernels):
    calls = []
    ours, ops = _run(kernels, calls)
    assert ops.name == ("fused-cpu" if kernels == "fused" else "triton")
    assert ops.attention_options and ops.partial_rotary
    decode = {c[1:] for c in calls if c[0] == "paged_decode_attention"}
    assert decode == {(WINDOW, True, 0.0), (0, True, SOFTCAP)}  # each layer's options reached the fast op
    if kernels == "triton":  # the varlen prefill kernel too (on CPU the prefill runs paged.prefill_attention)
        assert {c[1:] for c in calls if c[0] == "paged_prefill_attention"} == decode
    for i, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(ours, reference_run)):
        assert tokens == ref_tokens and len(tokens) == MAX_NEW
        assert_same_rows(tokens, logits, ref_tokens, ref_logits, f"{kernels} prompt {i}")

"""Engines on the fused CPU kernels (inferd/kernels) against the same engines on the torch references (today's
path), greedy, token for token under the exactness rule (tests/parity.py): a divergence is accepted only where the
reference's top-2 logit gap shows a near-tie. Tiny random Llama and Qwen2 models in float32 and bfloat16 under
staggered arrivals, chunked prefill and preemption; the default model in bfloat16 (what `--dtype auto` serves on a
CPU with AVX-512 BF16 or AMX)."""

from __future__ import annotations

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from inferd.models.build import load_model
from parity import assert_same_rows, bound_for, decode_step_inputs, run_staggered

PROMPT_LENS = [3, 17, 47, 90, 130, 9]
MAX_NEW = 20


def _prompts(vocab: int, seed: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _run(model, cfg, tok, dtype, kernels: str, blocks: int = 256, lens: list[int] = PROMPT_LENS, **kw):
    per_block = kv_bytes_per_block(cfg, 16, dtype)
    config = EngineConfig(kv_cache_bytes=per_block * blocks, record_logits=True, kernels=kernels, **kw)
    engine = Engine(model, cfg, config, dtype, tok)  # selects the model's ops (one engine at a time here)
    assert engine.runner.model.ops.name.startswith("fused" if kernels == "fused" else "reference")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    reqs, trace = run_staggered(engine, _prompts(cfg.vocab_size, 11, lens), params, every=2)
    engine.kv_cache.check_no_leaks()
    assert any(d > 0 and p > 0 for d, p, _ in trace)  # decodes shared steps with prefill chunks
    return [(list(r.output_token_ids), [x.float() for x in r.debug_logits]) for r in reqs], engine


def assert_same_greedy(fused, ref, dtype, label):
    for i, ((ours, our_logits), (theirs, their_logits)) in enumerate(zip(fused, ref)):
        assert len(ours) == len(theirs) == MAX_NEW
        assert_same_rows(ours, our_logits, theirs, their_logits, f"{label} prompt {i}", bound_for(dtype))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_path(request, tiny_llama_dir, tiny_qwen2_dir):
    return tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", ["chunked", "preemption"])
def test_tiny_models_fused_as_reference(tiny_path, dtype, scenario):
    model, cfg, tok = load_model(str(tiny_path), dtype=dtype)
    kw = dict(max_num_batched_tokens=16, max_num_seqs=8) if scenario == "chunked" else \
        dict(max_num_batched_tokens=64, max_num_seqs=8, blocks=14)
    blocks = kw.pop("blocks", 256)
    ref, _ = _run(model, cfg, tok, dtype, "reference", blocks, **kw)
    fused, engine = _run(model, cfg, tok, dtype, "fused", blocks, **kw)
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if dtype == torch.float32:  # float32: the fused ops' rounding is float32's, far below any near-tie
        assert [t for t, _ in fused] == [t for t, _ in ref]
    assert_same_greedy(fused, ref, dtype, f"{tiny_path.name} {dtype} {scenario}")


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_gguf_path):
    return load_model(smollm2_gguf_path, dtype=torch.bfloat16)


def test_default_model_bf16_fused_as_reference(smollm2_bf16):
    model, cfg, tok = smollm2_bf16
    # fewer prompt tokens than the tiny models': on a CPU without native bf16 (AVX2 only) bf16 matmuls are emulated
    kw = dict(max_num_batched_tokens=32, max_num_seqs=8, lens=[3, 17, 47, 9])
    ref, _ = _run(model, cfg, tok, torch.bfloat16, "reference", **kw)
    fused, _ = _run(model, cfg, tok, torch.bfloat16, "fused", **kw)
    assert_same_greedy(fused, ref, torch.bfloat16, "SmolLM2 bf16")


def _stack_against_layers(model, engine, prompts):
    """decode_layers (one call) against the Python layers over the same fused ops: hidden states and KV writes."""
    import types

    ids, positions, meta = decode_step_inputs(engine, prompts)
    runner, ops = engine.runner, model.ops
    python_layers = types.SimpleNamespace(**vars(ops))
    python_layers.decode_layers = None
    assert model._decode_stack(len(prompts)) is not None  # the one-call path is taken
    with torch.inference_mode():
        kv = runner.kv.clone()
        stacked = model(ids, positions, meta, runner.kv_caches)
        kv_stacked = runner.kv.clone()
        runner.kv.copy_(kv)
        model.ops = python_layers
        try:
            layered = model(ids, positions, meta, runner.kv_caches)
        finally:
            model.ops = ops
    assert torch.equal(stacked, layered)  # the same ops in the same order: the same bits
    assert torch.equal(kv_stacked, runner.kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoder_stack_in_one_call_is_the_layers_bit_for_bit(tiny_path, dtype):
    """kernels' decode_layers: a pure decode step's 30 (here 2) layers in one C++ call, for Llama and Qwen2 (q/k/v
    biases), one row and several."""
    model, cfg, tok = load_model(str(tiny_path), dtype=dtype)
    for rows in (1, 6):
        engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, dtype) * 64), dtype, tok)
        _stack_against_layers(model, engine, _prompts(cfg.vocab_size, rows, [5 + 7 * i for i in range(rows)]))


def test_the_decoder_stack_over_int4_weights(smollm2_gguf_path):
    """The default model with --quantize int4: one row (the int4 kernel) and eight (the dense copies)."""
    from inferd.models.quantize import quantize_model

    model, cfg, tok = load_model(smollm2_gguf_path, dtype=torch.bfloat16)
    quantize_model(model, "int4")
    for rows in (1, 8):
        engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.bfloat16) * 64),
                        torch.bfloat16, tok)
        _stack_against_layers(model, engine, _prompts(cfg.vocab_size, rows, [9] * rows))


def test_what_the_stack_does_not_run_takes_the_layers(tiny_llama_dir):
    """int8 weights and batch-invariant tiles have no decode_layers entry: the model runs its Python layers."""
    from inferd.models import batch_invariant
    from inferd.models.quantize import quantize_model

    model, cfg, tok = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    assert model._decode_stack(1) is not None
    batch_invariant.enable(model, True)
    assert model._decode_stack(1) is None
    batch_invariant.enable(model, False)
    assert model._decode_stack(1) is not None
    quantize_model(model, "int8")
    assert model._decode_stack(1) is None

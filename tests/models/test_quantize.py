"""Weight-only int8 (inferd/models/quantize.py, `--quantize int8`): Int8Linear against the matmul with its dequantized
weight (both kernels, bf16 and fp32); quantize_model swaps every Linear and halves bf16's weight bytes; the engine
with quantize="int8" generates, and its next-token distributions stay close to the unquantized model's; its
tensor-parallel ranks compute, bit for bit, what one process with their half-row scales computes; int4's two kernel
paths agree; bad settings are refused. Bounds are measured (each comment gives the figures and a bug they catch)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from inferd.cli.engine_flags import add_engine_args, engine_config
from inferd.cli.serve import worker_args
from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from inferd.models.build import load_model
from inferd.models.layers import Linear
from inferd.models.quantize import (
    INT4_GROUP,
    INT4_MAX_ROWS,
    Int4Linear,
    Int8Linear,
    check_quantization,
    quantize_int4,
    quantize_int8,
    quantize_model,
    weight_bytes,
)
from parity import top2_gap
from teacher_forcing import Agreement, agreement, teacher_forced_logits

pytestmark = pytest.mark.timeout(120)


def reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """float64 x @ (w_int8 * scale)^T + b: the matmul the module stands for, without rounding."""
    w = layer.weight.double() * layer.scales.double()[:, None]
    y = x.double() @ w.T
    return y if layer.bias is None else y + layer.bias.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 16, 0])  # 1 and 5: _weight_int8pack_mm in bf16; 16 and 0: convert path
@pytest.mark.parametrize("in_features,bias", [(64, False), (160, True), (24, True)])  # 24: not a multiple of 16
def test_int8_linear_equals_dequantized_matmul(dtype, rows, in_features, bias):
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(96, in_features, generator=g) * 0.05
    b = torch.randn(96, generator=g) if bias else None
    layer = Int8Linear.from_float(w.to(dtype), b, dtype)
    assert layer.weight.dtype == torch.int8 and layer.scales.dtype == dtype and layer.scales.shape == (96,)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    expect_pack = dtype == torch.bfloat16 and in_features % 16 == 0 and 0 < rows <= 6
    assert layer.uses_int8pack(x) == expect_pack
    y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    ref = reference(x, layer)
    if rows == 0:
        return
    if dtype == torch.float32:  # fp32 accumulation of exact products: float32 rounding only
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:  # a bf16 output rounds to 8 significant bits (2^-9 relative); two roundings on the convert path
        err = (y.double() - ref).abs()
        assert (err <= 2 ** -7 * ref.abs() + 2 ** -9 * ref.abs().max()).all(), err.max()
    # leading dimensions are kept
    assert torch.equal(layer(x.reshape(1, rows, in_features)).reshape(rows, 96), y)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantize_int8_rounds_to_the_nearest_step(scale_dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    w[3] = 0  # an all-zero row gets a usable scale, not 0/0
    q, s = quantize_int8(w, scale_dtype)
    assert s.dtype == scale_dtype
    assert q.abs().max() <= 127 and s[3] == 1.0 and q[3].eq(0).all()
    assert torch.equal(q.abs().amax(1)[torch.arange(32) != 3], torch.full((31,), 127, dtype=torch.int8))
    # symmetric rounding: half a step at most, of the step that is stored (a bf16 scale is rounded to 8 bits: codes
    # chosen for the unrounded scale are up to 127 * 2^-9 = 0.25 of a step further off)
    s = s.float()
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all(), (err / s[:, None]).max()


@pytest.fixture(scope="module")
def tiny_llama_bf16(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.bfloat16)


def linear_bytes(model) -> int:
    return sum(weight_bytes(m) for m in model.modules() if isinstance(m, Linear))


def test_quantize_model_swaps_every_linear(tiny_llama_dir, tiny_qwen2_dir):
    for path in (tiny_llama_dir, tiny_qwen2_dir):
        model, cfg, _ = load_model(str(path), dtype=torch.bfloat16)
        embed = model.embed_tokens.weight.clone()
        x = torch.randn(3, cfg.hidden_size).to(torch.bfloat16)
        head_before = model.lm_head(x).float()
        bf16_linears, total_bf16 = linear_bytes(model), weight_bytes(model)
        n = quantize_model(model, "int8")
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert n == len(linears) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down per layer + lm_head
        assert all(type(m) is Int8Linear for m in linears), [type(m) for m in linears]
        assert isinstance(model.lm_head, Int8Linear)
        assert torch.equal(model.embed_tokens.weight, embed)  # a tied head was quantized as its own copy
        if cfg.attention_bias:  # Qwen2: q/k/v bias kept at full precision
            assert model.layers[0].self_attn.qkv_proj.bias.dtype == torch.bfloat16
        int8_linears = linear_bytes(model)
        params = sum(m.weight.numel() for m in linears)
        # int8 values plus a bf16 scale per output row: just over 1/2 of bf16, 1/4 of fp32
        assert 0.5 <= int8_linears / bf16_linears < 0.52
        assert 0.25 <= int8_linears / (4 * params) < 0.26
        assert weight_bytes(model) == total_bf16 - bf16_linears + int8_linears
        assert model.weight_bytes() < 0.51 * bf16_linears  # the model's own per-step count sees the int8 weights
        assert quantize_model(model, "int8") == 0  # idempotent: nothing left to quantize
        head_after = model.lm_head(x).float()
        assert (head_after - head_before).abs().max() < 0.05 * head_before.abs().max()


def test_bad_settings_are_refused(tiny_llama_dir, tiny_llama_bf16):
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        Engine.from_config(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", quantize="int3"))
    with pytest.raises(ValueError, match="--dtype bfloat16"):  # refused before loading anything
        Engine.from_config(EngineConfig(model=str(tiny_llama_dir), dtype="float32", quantize="int8"))
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(tiny_llama_bf16[0], "fp8")
    check_quantization(None, torch.float32)
    check_quantization("int8", torch.float16)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--quantize", "int3"])
    check_quantization("int4", torch.float32)  # the int4 kernel takes float32 activations too
    args = p.parse_args(["--quantize", "int8", "--dtype", "bfloat16"])
    assert engine_config(args).quantize == "int8"
    args.heartbeat_interval, args.echo = 0.5, False
    assert worker_args(args, "m")[-2:] == ["--quantize", "int8"]
    assert engine_config(p.parse_args([])).quantize is None


def test_engine_from_config_quantizes_and_generates(tiny_llama_dir):
    engine = Engine.from_config(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", quantize="int8",
                                             kv_cache_bytes=16 << 20, max_model_len=256))
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(type(m) is Int8Linear for m in linears)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (7, 30, 55)]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [r.num_output_tokens for r in reqs] == [12, 12, 12]
    again = engine.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert again[0].output_token_ids == reqs[0].output_token_ids  # greedy is deterministic
    engine.kv_cache.check_no_leaks()


QUALITY_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon, and Neil Armstrong became "
    "the first person to walk on its surface. Photosynthesis turns light, water and carbon dioxide into sugar and "
    "oxygen.\n\ndef fib(n: int) -> int:\n    \"\"\"The n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n")


def quantized_quality(gguf_path, tokenizer, mode: str) -> tuple[Engine, Agreement]:
    """SmolLM2 in bf16 (real distributions: a random tiny model's near-flat logits would make top-1 a coin toss),
    teacher-forced over a fixed text, before and after quantizing the same model in place: (the quantized engine,
    its agreement with bf16: top-1, KL(bf16 || quantized))."""
    model, cfg, _ = load_model(gguf_path, dtype=torch.bfloat16)
    config = EngineConfig(dtype="bfloat16", kv_cache_bytes=32 << 20, max_model_len=512, record_logits=True)
    ids = tokenizer.encode(QUALITY_TEXT)
    ref = teacher_forced_logits(Engine(model, cfg, config, torch.bfloat16), ids)
    quantize_model(model, mode)
    engine = Engine(model, cfg, config, torch.bfloat16)
    got = agreement(ref, teacher_forced_logits(engine, ids))
    print(f"\n{mode} against bf16: {got}")
    return engine, got


def decode_vs_prefill(engine, tokenizer) -> Agreement:
    """Greedy "The capital of France is" (must say Paris); then the logits its one-row decode steps sampled from
    against a prefill of the same tokens (another kernel path, and the KV cache read back): top-1 and KL over 15
    positions."""
    prompt = tokenizer.encode("The capital of France is")
    [req] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert "Paris" in tokenizer.decode(req.output_token_ids)
    decode = torch.stack(req.debug_logits[1:])  # rows sampled by one-token decode steps
    prefill = teacher_forced_logits(engine, req.prompt_token_ids + req.output_token_ids[:-1])[len(prompt):]
    got = agreement(prefill, decode)
    print(f"decode against prefill: {got}")
    return got


def test_int8_next_token_distributions_stay_close_to_bf16(smollm2_gguf_path, smollm2_tokenizer):
    """int8 against bf16; then the int8 decode path (_weight_int8pack_mm, one row per step) against the int8
    prefill path on the same tokens."""
    engine, got = quantized_quality(smollm2_gguf_path, smollm2_tokenizer, "int8")
    # measured over 107 positions on AMD EPYC AVX-512 BF16: top-1 0.953-0.972 (3-5 flips, at bf16 top-2 gaps of
    # 0-0.5) and mean KL 0.0066-0.0076 nats over three compute paths (fused kernels, INFERD_KERNELS=reference, an
    # AVX2 build with ONEDNN_MAX_CPU_ISA=AVX2); 0.95-0.97 and ~0.007 in earlier sessions. The bounds allow 2 flips
    # more than the worst and 1.6x its KL: the quantization noise is the same on every machine (the codes are
    # deterministic), only the bf16 summation order moves. Codes rounded toward zero (trunc for round in
    # quantize_int8) gave KL 0.022. The noise must also be there (the model was quantized at all)
    assert got.top1 >= 0.93, got
    assert 0.003 < got.mean_kl < 0.012, got
    got = decode_vs_prefill(engine, smollm2_tokenizer)
    # measured: top-1 1.0 and mean KL 0.0025-0.0032 over the three paths here, 0.86-1.0 and ~0.002 in earlier
    # sessions: bf16 rounding differs between the two kernels (the unquantized bf16 model shows the same KL between
    # its decode and prefill paths); a near-tie may flip a top-1 (0.86: 2 of 15). The KL bound is 1.9x the largest:
    # decode steps that rotate their token at position + 1 (an off-by-one in the runner's positions) gave 0.0078
    assert got.top1 >= 0.86 and got.mean_kl < 0.006, got


class TwoRankRowParallel(nn.Module):
    """What a row-parallel layer (o_proj, down_proj) computes under tensor_parallel=2 with int8 weights, in one
    process: each half of the input features times its own int8 shard (per-output-channel scales over that half
    only, as each rank quantizes its shard), and the two partial sums added (the all-reduce)."""

    def __init__(self, linear: Linear):
        super().__init__()
        w = linear.packed.to_dense() if linear.packed is not None else linear.weight
        half = w.shape[1] // 2
        self.halves = nn.ModuleList(Int8Linear.from_float(w[:, i * half:(i + 1) * half], None, w.dtype)
                                    for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return self.halves[0](x[..., :half].contiguous()) + self.halves[1](x[..., half:].contiguous())


def test_tensor_parallel_ranks_quantize_their_shards(tiny_llama_dir):
    """tensor_parallel=2: rank 0 (here) and rank 1 (a child) each quantize their shard. A column-parallel shard's
    rows keep their scales; a row-parallel shard's scales cover its half of the inputs only. So the outputs are
    those of one process whose o_proj and down_proj are quantized by halves (TwoRankRowParallel), bit for bit
    (measured: the same kernels on the same shapes, and the all-reduce of two bf16 partial sums rounds once, as
    their sum does; also with 1 or 2 threads). Against the one-process int8 model they differ by 0.5-1.0% of the
    largest logit, as much as when rank 1 did not quantize at all (0.7-1.0%): no tolerance would tell the two apart."""
    g = torch.Generator().manual_seed(3)
    prompts = [[5, 17, 99, 23, 42, 7, 300, 11]] + [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 20)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    model, cfg, tok = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    for layer in model.layers:
        layer.self_attn.o_proj = TwoRankRowParallel(layer.self_attn.o_proj)
        layer.mlp.down_proj = TwoRankRowParallel(layer.mlp.down_proj)
    quantize_model(model, "int8")
    config = EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.bfloat16) * 64, record_logits=True)
    expected = Engine(model, cfg, config, torch.bfloat16, tok).generate(prompts, params)

    engine = Engine.from_config(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", quantize="int8",
                                             kv_cache_bytes=8 << 20, max_model_len=256, record_logits=True,
                                             tensor_parallel=2))
    try:
        model = engine.runner.model
        assert all(type(m) is Int8Linear for m in model.modules() if isinstance(m, Linear))
        assert type(model.layers[0].mlp.down_proj.linear) is Int8Linear  # inside the RowParallel wrapper
        reqs = engine.generate(prompts, params)  # prefill (the convert path), then 3-row decodes (_weight_int8pack_mm)
    finally:
        engine.close()
    for i, (req, exp) in enumerate(zip(reqs, expected)):
        assert req.output_token_ids == exp.output_token_ids, i
        assert torch.equal(torch.stack(req.debug_logits), torch.stack(exp.debug_logits)), i


# ---- int4 ------------------------------------------------------------------------------------------------------


def int4_dense(layer: Int4Linear) -> torch.Tensor:
    """The float32 weight an Int4Linear stands for, from its codes' scales and zeros: (q - 8) * scale + zero."""
    # stored dequantized with the rounded scales (what the dense path multiplies), repacked for oneDNN on CPU
    return (layer.packed.to_dense() if layer.packed is not None else layer.weight).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_equals_its_dequantized_matmul(dtype, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 128, generator=g) * 0.05
    b = torch.randn(96, generator=g) if bias else None
    layer = Int4Linear.from_float(w, b, dtype)
    x = torch.randn(rows, 128, generator=g).to(dtype)
    assert layer.uses_int4pack(x) == (rows <= INT4_MAX_ROWS)
    y = layer(x).float()
    ref = x.float() @ int4_dense(layer).T + (0 if b is None else layer.bias.float())
    # the int4 kernel dequantizes and accumulates in float32; bf16 rounds its inputs and output
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (y - ref).abs().max() <= tol * ref.abs().max()
    # and the dequantized weight is within half a step of the float weight: 4-bit codes per 32 values
    step = (w.view(96, -1, INT4_GROUP).amax(-1) - w.view(96, -1, INT4_GROUP).amin(-1)) / 15
    err = (int4_dense(layer) - w).abs().view(96, -1, INT4_GROUP).amax(-1)
    assert (err <= step * 0.5 + 0.02 * step + 1e-3).all()


def test_quantize_int4_recovers_a_q4_1_grid_exactly():
    """Weights that already lie on a Q4_1 grid (the default GGUF's: q * d + m) come back with the same codes."""
    g = torch.Generator().manual_seed(9)
    d = torch.rand(8, 4, generator=g) * 0.01 + 0.001
    m = -torch.rand(8, 4, generator=g) * 0.05
    q = torch.randint(0, 16, (8, 4, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # each group spans its whole range, as Q4_1's quantizer makes it
    w = (q * d[..., None] + m[..., None]).view(8, 128)
    codes, d2, m2 = quantize_int4(w, torch.float32)
    assert torch.equal(codes.view(8, 4, 32), q.to(torch.int32))
    torch.testing.assert_close(d2, d, rtol=1e-6, atol=0)
    torch.testing.assert_close(m2, m, rtol=1e-6, atol=0)


# The int4 kernel (decode steps of up to INT4_MAX_ROWS rows: the fused decoder stack calls it with 32-value groups)
# against the dense dequantized weights (a prefill of the same tokens), peaked tiny Llama, 3 prompts x 11 decode
# steps. Their weights differ by the rounding of the kernel's zero point (m + 8 d) to bf16, and their sums by order.
# Measured (AMD EPYC AVX-512 BF16, fused kernels): largest |difference| 1.6-2.3% of the largest |logit|, mean KL
# 1.2e-4 - 1.8e-4 nats (on the near-flat tiny models of before, on three compute paths: 0.58-0.76% and 2e-7 - 3.8e-7,
# i.e. the paths moved them by ~1.3x). Bounds at ~2.2x. Zero points m + 7 d gave 33% and 16-value groups in
# quantize.py under the stack's 32 gave 36% (near-flat models; 148% on weights at 0.3).
INT4_PATHS_MAX_DIFF = 0.05  # of the largest |logit| at the position
INT4_PATHS_MAX_MEAN_KL = 4e-4
# a top-1 flip between the two paths only where the prefill's top-2 gap is within 4 bf16 steps of its largest
# logit (2^-6 of it); measured: 1 flip in 99 positions, at a gap of 1 step (0.0039)
INT4_NEAR_TIE = 2 ** -6


def test_int4_engine_generates_and_its_two_paths_agree(tiny_llama_dir):
    engine = Engine.from_config(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", quantize="int4",
                                             kv_cache_bytes=16 << 20, max_model_len=256, record_logits=True))
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert linears and all(type(m) is Int4Linear for m in linears)
    assert type(model.lm_head) is Linear  # the head keeps its precision
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (7, 30, 55)]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [r.num_output_tokens for r in reqs] == [12, 12, 12]
    engine.kv_cache.check_no_leaks()
    # the decode step's bytes are the 4-bit codes and scales: about 0.28 of bf16's
    dense = sum(m.in_features * m.out_features * 2 for m in linears)
    head = model.config.vocab_size * model.config.hidden_size * 2
    assert engine.cost.weight_bytes < 0.35 * dense + 1.1 * head

    # all three prompts prefill in the first step, then decode together: 3 rows, the int4 kernel's. A prefill of
    # each whole sequence (more rows: the dense weights) gives the logits each decode step sampled from
    for i, r in enumerate(reqs):
        decode = torch.stack(r.debug_logits[1:]).float()
        prefill = teacher_forced_logits(engine, r.prompt_token_ids + r.output_token_ids[:-1])[len(prompts[i]):]
        largest = prefill.abs().amax(-1)
        diff = ((decode - prefill).abs().amax(-1) / largest).max().item()
        got = agreement(prefill, decode)
        print(f"\nint4 kernel against dense, prompt {i}: largest difference {diff:.4f} of the largest logit; {got}")
        assert diff <= INT4_PATHS_MAX_DIFF and got.mean_kl <= INT4_PATHS_MAX_MEAN_KL, (diff, got)
        for j in range(len(prefill)):  # the tokens the decode steps chose: the prefill's, but at near-ties
            if decode[j].argmax() != prefill[j].argmax():
                assert top2_gap(prefill[j]) <= INT4_NEAR_TIE * largest[j], (i, j, top2_gap(prefill[j]))


def test_int4_next_token_distributions_stay_close_to_bf16(smollm2_gguf_path, smollm2_tokenizer):
    """The default model's layers are Q4_1 already: int4 with 32-value groups serves them (up to the scales' bf16
    rounding), so its distributions must be close to the bf16 model's; the single-row path (the int4 kernel) and
    the batched path (the dequantized weights) must agree too."""
    engine, got = quantized_quality(smollm2_gguf_path, smollm2_tokenizer, "int4")
    # measured: top-1 0.963-0.972, mean KL 0.0026-0.0032 nats over the three compute paths (the layers' Q4_1 grid
    # is recovered; the head keeps bf16). A 4-bit head gave 0.037 nats; wrong codes or scales would be far beyond.
    # Bounds: 2 flips more than the worst, 1.9x its KL
    assert got.top1 >= 0.93 and 0.001 < got.mean_kl < 0.006, got
    got = decode_vs_prefill(engine, smollm2_tokenizer)
    # measured: top-1 0.933-1.0, mean KL 0.0013-0.0016 over the three paths (0.0009-0.0016 earlier); bound 2.5x
    assert got.top1 >= 0.86 and got.mean_kl < 0.004, got

"""bf16 against other implementations: our bf16 engine generates greedily, and at every position of its output the
next-token distribution it sampled from is compared with (a) transformers in bf16 and (b) our own float32 model,
both fed the same tokens in one teacher-forced forward (a near-tie flip does not cascade into an unrelated text).
Tiny random Llama and Qwen2 models and the default model (SmolLM2 GGUF). Metrics over all positions of all
prompts: top-1 agreement, and mean and largest KL(p_ref || p_ours).

`--dtype auto` is bf16 on CPUs with AVX-512 BF16 or AMX and on every GPU, so this is what most deployments serve.
The bounds are measured (see BOUNDS); remeasure with `pytest -s -q tests/engine/test_bf16_parity.py` (each test
prints its figures)."""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from inferd.models.build import build_model, load_model
from inferd.models.loader import load_model_config, load_state_dict
from teacher_forcing import Agreement, agreement, hf_teacher_forced_logits, teacher_forced_logits

MAX_NEW = 32
TINY_PROMPT_LENS = [6, 19, 41]
SMOL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
]


class Bound(NamedTuple):
    min_top1: float
    max_mean_kl: float
    max_kl: float


# (model, reference) -> bounds, over 3 prompts x 32 generated tokens = 96 positions. Each bound sits past the values
# measured on three compute paths of one CPU (AMD EPYC, AVX-512 BF16, 2 cores, torch 2.13, 2026-12): the fused
# kernels (default), INFERD_KERNELS=reference, and the kernels built for AVX2 (-march=haswell) with
# ONEDNN_MAX_CPU_ISA=AVX2 (what an AVX2-only machine runs, bf16 emulated). An Intel AMX machine could not be
# measured: it rounds the same activations to bf16 but sums its tiles in another order, so the bounds leave ~2x
# on the mean KL and ~2.5x on the largest (one position's: it moved 2x between the paths above), and 3-4 more
# top-1 flips than measured (flips happen only at near-ties, which move with the summation order).
# A plausible bf16 bug, the kernels' float -> bf16 conversion truncating instead of rounding to nearest even
# (cpu_ops.cpp f_to_bf16_bits), gave SmolLM2 mean KL 0.0164 / 0.015 nats and largest 0.080 / 0.070 (transformers
# / fp32), the tiny models 7.5e-7 / 7.7e-7 against transformers: it fails the transformers bounds of all three
# models and SmolLM2's fp32 bound (the tiny models' near-flat fp32 comparison moves only 1.4x: 5.3e-7).
BOUNDS = {
    # The tiny random models are peaked (tests/parity.py PEAKED_INIT). Measured on the fused kernels (the three-path
    # spread above was measured on near-flat tiny models: up to 2x between paths; hence ~2.8x here)
    # measured top-1 0.969, mean KL 8.9e-5, largest 1.8e-4
    ("llama", "transformers bf16"): Bound(min_top1=0.92, max_mean_kl=2.5e-4, max_kl=6e-4),
    # measured top-1 0.958, mean 2.2e-4, largest 1.2e-3
    ("llama", "our fp32"): Bound(min_top1=0.91, max_mean_kl=6e-4, max_kl=3.5e-3),
    # measured top-1 0.990, mean 7.5e-5, largest 1.7e-4
    ("qwen2", "transformers bf16"): Bound(min_top1=0.94, max_mean_kl=2.5e-4, max_kl=6e-4),
    # measured top-1 0.958, mean 1.7e-4, largest 9.1e-4
    ("qwen2", "our fp32"): Bound(min_top1=0.91, max_mean_kl=5e-4, max_kl=2.5e-3),
    # SmolLM2: measured top-1 0.969-0.990, mean KL 0.00165-0.00206, largest 0.0073-0.0118 (the truncation bug:
    # 0.917, 0.0164, 0.080)
    ("smollm2", "transformers bf16"): Bound(min_top1=0.93, max_mean_kl=0.004, max_kl=0.03),
    # measured top-1 0.948-0.958, mean 0.00109-0.00134, largest 0.0084-0.0126 (truncation: 0.938, 0.015, 0.070);
    # for scale, transformers' own bf16 (GGUF load) against its fp32 on these tokens: top-1 0.979, mean 0.00124
    ("smollm2", "our fp32"): Bound(min_top1=0.91, max_mean_kl=0.003, max_kl=0.03),
}
# our bf16 engine really computes in bf16: its distributions are not float32's. Measured mean KL against our fp32:
# tiny models 1.7e-4 - 2.2e-4, SmolLM2 0.0011-0.0013; float32 against float32 (our engine against transformers,
# SmolLM2) gives 3e-11. 10x under the measured values
MIN_MEAN_KL_VS_FP32 = {"llama": 2e-5, "qwen2": 2e-5, "smollm2": 1e-4}


class Bf16Run(NamedTuple):
    name: str
    sequences: list[list[int]]  # prompt + the tokens our bf16 engine generated
    prompt_lens: list[int]
    logits: torch.Tensor  # [positions, vocab]: what our bf16 engine sampled each generated token from
    state_dict: dict[str, torch.Tensor]  # the bf16 weights, HF-named (transformers' bf16 model is built from them)


def greedy_bf16(name: str, path: str, tokenizer, make_prompts) -> Bf16Run:
    """Our bf16 engine's greedy outputs; make_prompts(model config) -> the prompts."""
    cfg = load_model_config(path)
    state = load_state_dict(path, cfg, torch.bfloat16)
    model = build_model(cfg, state, torch.bfloat16)  # copies the weights: state stays as loaded
    prompts = make_prompts(cfg)
    config = EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.bfloat16) * 64, record_logits=True)
    engine = Engine(model, cfg, config, torch.bfloat16, tokenizer)
    reqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    engine.kv_cache.check_no_leaks()
    for r in reqs:  # greedy: each token is the argmax of the row it was sampled from
        assert r.num_output_tokens == MAX_NEW
        assert torch.stack(r.debug_logits).argmax(-1).tolist() == r.output_token_ids
    return Bf16Run(name, [r.prompt_token_ids + r.output_token_ids for r in reqs], [len(p) for p in prompts],
                   torch.cat([torch.stack(r.debug_logits).float() for r in reqs]), state)


def generated_positions(run: Bf16Run, logits_of) -> torch.Tensor:
    """logits_of(ids) -> [len(ids), vocab]; the rows that predict each generated token (teacher forced over the
    prompt and all generated tokens but the last)."""
    rows = []
    for ids, n in zip(run.sequences, run.prompt_lens):
        rows.append(logits_of(ids[:-1])[n - 1:])
    return torch.cat(rows)


def our_fp32_logits(run: Bf16Run, model, cfg) -> torch.Tensor:
    engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.float32) * 16),
                    torch.float32)
    return generated_positions(run, lambda ids: teacher_forced_logits(engine, ids))


def check(run: Bf16Run, reference: str, ref_logits: torch.Tensor) -> Agreement:
    got = agreement(ref_logits, run.logits)
    print(f"\n{run.name} bf16 vs {reference}: {got}")
    bound = BOUNDS[(run.name, reference)]
    assert got.positions == len(run.sequences) * MAX_NEW
    assert got.top1 >= bound.min_top1, (got, bound)
    assert got.mean_kl <= bound.max_mean_kl, (got, bound)
    assert got.max_kl <= bound.max_kl, (got, bound)
    return got


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tiny_llama_dir, tiny_qwen2_dir, smollm2_tokenizer):
    """(our bf16 run, the model's folder) of a tiny random model (SmolLM2's tokenizer)."""
    path = str(tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir)
    g = torch.Generator().manual_seed(26)
    run = greedy_bf16(request.param, path, smollm2_tokenizer,
                      lambda cfg: [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
                                   for n in TINY_PROMPT_LENS])
    return run, path


def test_tiny_bf16_agrees_with_transformers_bf16(tiny):
    from transformers import AutoModelForCausalLM

    run, path = tiny
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    check(run, "transformers bf16", generated_positions(run, lambda ids: hf_teacher_forced_logits(hf, ids)))


def test_tiny_bf16_stays_close_to_our_fp32(tiny):
    run, path = tiny
    model, cfg, _ = load_model(path, dtype=torch.float32)
    got = check(run, "our fp32", our_fp32_logits(run, model, cfg))
    assert got.mean_kl > MIN_MEAN_KL_VS_FP32[run.name]


@pytest.fixture(scope="module")
def smollm2_run(smollm2_gguf_path, smollm2_tokenizer) -> Bf16Run:
    return greedy_bf16("smollm2", smollm2_gguf_path, smollm2_tokenizer,
                       lambda _: [smollm2_tokenizer.encode(t) for t in SMOL_TEXTS])


def test_smollm2_bf16_agrees_with_transformers_bf16(smollm2_run, hf_smollm2_fp32):
    """transformers' Llama in bf16 with the GGUF's weights dequantized to bf16. Not transformers' own bf16 load of
    the GGUF: that keeps the weights packed and runs every matmul in float32, casting around it (its warning says
    so), which is not a bf16 model. The weights are the ones our loader dequantized: tests/models/test_loader.py
    checks them equal, bit for bit, to transformers' dequantization; the config is transformers' reading of the
    GGUF."""
    config = copy.deepcopy(hf_smollm2_fp32.config)
    config.quantization_config = None
    hf = type(hf_smollm2_fp32).from_pretrained(None, config=config, state_dict=smollm2_run.state_dict,
                                               dtype=torch.bfloat16).eval()
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16
               for m in hf.modules() if isinstance(m, torch.nn.Linear))
    check(smollm2_run, "transformers bf16", generated_positions(smollm2_run,
                                                                lambda ids: hf_teacher_forced_logits(hf, ids)))


def test_smollm2_bf16_stays_close_to_our_fp32(smollm2_run, smollm2_fp32):
    model, cfg, _ = smollm2_fp32
    got = check(smollm2_run, "our fp32", our_fp32_logits(smollm2_run, model, cfg))
    assert got.mean_kl > MIN_MEAN_KL_VS_FP32["smollm2"]

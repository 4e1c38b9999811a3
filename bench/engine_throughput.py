"""Engine throughput: inferd's continuous batching vs transformers' static batching, side by side in one run.

The same 64 requests (prompts of 100-300 tokens, 128 output tokens each, ignore_eos, greedy) go through
  1. inferd's Engine (all requests submitted at once; the scheduler batches them),
  2. transformers `generate` in static batches of 16 (left-padded),
on the default model (SmolLM2-135M-Instruct, dequantized from its Q4_1 GGUF), for each dtype asked for. Prints
output tokens/s of each and the ratio, and inferd's batch-1 decode step time against the bandwidth floor
(weight bytes / measured copy bandwidth).

    .venv/bin/python bench/engine_throughput.py [--dtypes float32,bfloat16] [--requests 64] [--output-tokens 128]

bf16 is skipped with a note on a CPU that lacks native bf16 (AVX-512 BF16 / AMX): there torch emulates it at
~1 GFLOP/s and one run would take hours.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.config import EngineConfig, cpu_has_native_bf16  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.models.build import build_model  # noqa: E402
from inferd.models.loader import default_model_path, load_model_config, load_state_dict  # noqa: E402


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(100, 301, (n,), generator=g).tolist()
    return [torch.randint(1000, min(vocab, 40000), (k,), generator=g).tolist() for k in lens]


def copy_bandwidth() -> float:
    """Bytes/s of a large tensor copy, read + write counted (as in docs/machines.md)."""
    src = torch.ones(64 * 1024 * 1024)  # 256 MB
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best


def read_bandwidth() -> float:
    """Bytes/s of streaming reads (a matrix-vector product over 512 MB): what a batch-1 decode step can reach."""
    m = torch.ones(128 * 1024, 1024)
    v = torch.ones(1024)
    torch.mv(m, v)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.mv(m, v)
        best = min(best, time.perf_counter() - t)
    return m.numel() * m.element_size() / best


def run_inferd(model, cfg, dtype, prompts, out_tokens) -> float:
    engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=3 << 30, max_num_seqs=len(prompts),
                                             max_num_batched_tokens=512, max_model_len=1024), dtype)
    params = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    reqs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert all(r.num_output_tokens == out_tokens for r in reqs)
    return sum(r.num_output_tokens for r in reqs) / elapsed


def decode_step_ms(model, cfg, dtype, steps: int = 24, trials: int = 5) -> float:
    """Median over trials of the mean batch-1 decode step (context ~128-150): batch-1 steps vary +-20% here."""
    engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=256 << 20, max_model_len=1024), dtype)
    means = []
    for _ in range(trials):
        engine.add_request(list(range(1000, 1128)), SamplingParams(max_tokens=steps + 1, temperature=0,
                                                                   ignore_eos=True))
        engine.step()  # prefill
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        means.append((time.perf_counter() - t) / steps * 1e3)
    return sorted(means)[trials // 2]


def run_hf(path, dtype, prompts, out_tokens, batch: int = 16) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    d, f = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos: generate() falls back to it even when told None
    gen = GenerationConfig(do_sample=False, max_new_tokens=out_tokens, eos_token_id=None, pad_token_id=0)
    total, elapsed = 0, 0.0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, generation_config=gen)
        elapsed += time.perf_counter() - t
        total += (out.shape[1] - width) * len(chunk)
    return total / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true", help="measure inferd only")
    args = ap.parse_args()

    path = default_model_path()
    cfg = load_model_config(path)
    prompts = make_prompts(args.requests, cfg.vocab_size)
    bw, rbw = copy_bandwidth(), read_bandwidth()
    print(f"model {os.path.basename(path)}; {args.requests} requests, prompts 100-300 tokens "
          f"(total {sum(map(len, prompts))}), {args.output_tokens} output tokens each; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; copy bandwidth {bw / 1e9:.1f} GB/s (read+write), "
          f"streaming read {rbw / 1e9:.1f} GB/s")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if dtype == torch.bfloat16 and not cpu_has_native_bf16():
            print(f"[{name}] skipped: this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag); "
                  "torch emulates bf16 matmuls here at ~1 GFLOP/s")
            continue
        model = build_model(cfg, load_state_dict(path, cfg, dtype), dtype, max_positions=1024)
        weight_bytes = model.weight_bytes()
        step = decode_step_ms(model, cfg, dtype)
        floor, rfloor = weight_bytes / bw * 1e3, weight_bytes / rbw * 1e3
        print(f"[{name}] batch-1 decode step {step:.1f} ms; {weight_bytes / 1e6:.0f} MB of weights; "
              f"bandwidth floor {floor:.1f} ms by copy bandwidth ({floor / step:.0%} of it), "
              f"{rfloor:.1f} ms by streaming-read bandwidth ({rfloor / step:.0%})")
        ours = run_inferd(model, cfg, dtype, prompts, args.output_tokens)
        print(f"[{name}] inferd engine: {ours:.0f} output tok/s", flush=True)
        del model
        if args.skip_hf:
            continue
        theirs = run_hf(path, dtype, prompts, args.output_tokens, args.hf_batch)
        print(f"[{name}] transformers generate, static batches of {args.hf_batch}: {theirs:.0f} output tok/s")
        print(f"[{name}] ratio inferd / transformers: {ours / theirs:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

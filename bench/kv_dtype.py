"""KV cache precision (`--kv-dtype`) on the default model: quality, capacity and decode speed, side by side in one run.

Configurations (activations / KV cache): bf16 / bf16 (the default on a CPU with AVX-512 BF16 or AMX, the
baseline), bf16 / float8_e4m3fn, and unless --no-fp32: fp32 / fp32 (the reference), fp32 / bf16 and
fp32 / float8_e4m3fn. For each:
  - quality: the fixed text of bench/quantization.py (prose and Python, the same tokens for all) teacher-forced one
    token per step through the engine's runner (--chunk 1: every position is a decode that reads its whole context,
    itself included, back from the KV cache, as in generation); mean KL divergence and top-1 agreement of the
    next-token distributions against the bf16 / bf16 baseline (and against fp32 / fp32), and perplexity;
  - capacity: KV bytes per token, and how many tokens and 1,024-token sequences the default pool
    (DEFAULT_KV_CACHE_BYTES, 1 GiB) holds, by the engine's own block arithmetic;
  - decode step time at each --batches size: Engine.step() with every sequence decoding from --context tokens on;
    all configurations' engines stay alive and take turns, each cell the median over --rounds of the mean of
    --steps steps, after --warmup untimed steps.

    .venv/bin/python bench/kv_dtype.py [--batches 1,32] [--context 256] [--steps 8] [--rounds 5] [--warmup 8]
                                       [--chunk 1] [--threads N] [--no-fp32]

Timings on a shared 2-core machine are noisy (see bench/quantization.py's docstring): the CPU share other processes
took is printed; compare ratios within one run. On a CPU without native bf16 (AVX-512 BF16 or AMX) the
bf16-activation configurations get their quality and capacity figures but are not timed: emulated bf16 runs several
times slower than fp32 there, which would say nothing about the KV dtype.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from quantization import TEXT, DecodeRun, OtherLoad, compare, cpu_busy_fraction, perplexity, teacher_forced_logits  # noqa: E402

from inferd.config import DEFAULT_KV_CACHE_BYTES, EngineConfig, cpu_has_native_bf16  # noqa: E402
from inferd.engine import Engine  # noqa: E402
from inferd.engine.runner import kv_bytes_per_block  # noqa: E402
from inferd.models.build import build_model  # noqa: E402
from inferd.models.loader import default_model_path, load_model_config, load_state_dict  # noqa: E402
from inferd.models.tokenizer import load_tokenizer  # noqa: E402

BLOCK = 16
SEQ_LEN = 1024  # the sequence length of the capacity column


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32", help="decode batch sizes (comma-separated)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of every decoding sequence")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=5, help="measurements per cell (configurations take turns)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode steps of each run first")
    ap.add_argument("--chunk", type=int, default=1, help="tokens per forward in the quality pass (1: decodes)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32-activation configurations")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    native_bf16 = cpu_has_native_bf16()
    if not native_bf16:
        print("NOTE: this CPU lacks native bf16 (AVX-512 BF16 / AMX): bf16 arithmetic is emulated, so the "
              "bf16-activation configurations are not timed (their quality and capacity figures are measured)")
    busy = cpu_busy_fraction()
    note = "unknown" if busy is None else f"{busy:.0%}" + ("  <- BUSY: timings unreliable" if busy > 0.1 else "")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; CPU time taken by "
          f"other processes before the start: {note}", flush=True)
    started = time.perf_counter()

    path = default_model_path()
    cfg = load_model_config(path)
    ids = load_tokenizer(path).encode(TEXT)
    state = load_state_dict(path, cfg, torch.float32)
    configs = [("bf16", "bf16", torch.bfloat16, "auto"), ("bf16", "fp8", torch.bfloat16, "float8_e4m3fn")]
    if not args.no_fp32:
        configs += [("fp32", "fp32", torch.float32, "auto"), ("fp32", "bf16", torch.float32, "bfloat16"),
                    ("fp32", "fp8", torch.float32, "float8_e4m3fn")]
    models = {dtype: build_model(cfg, state, dtype) for dtype in {c[2] for c in configs}}
    state.clear()

    print(f"quality text: {len(ids)} tokens, {args.chunk} per forward; decode batches {batches} from context "
          f"{args.context}; every configuration's engines alive, taking turns", flush=True)
    results: dict = {}
    for act, kv, dtype, kv_name in configs:
        engine = Engine(models[dtype], cfg, EngineConfig(kv_dtype=kv_name, kv_cache_bytes=64 << 20,
                                                         max_model_len=2048), dtype)
        logits, seconds = teacher_forced_logits(engine, ids, args.chunk)
        stored = engine.runner.kv[:, :, :, :-(-len(ids) // BLOCK)].float()
        per_block = kv_bytes_per_block(cfg, BLOCK, engine.kv_dtype)
        blocks = DEFAULT_KV_CACHE_BYTES // per_block
        results[(act, kv)] = {"logits": logits, "ppl": perplexity(logits, ids), "quality_s": seconds,
                              "kv_bytes_per_token": per_block // BLOCK, "pool_tokens": blocks * BLOCK,
                              "pool_seqs": blocks // (SEQ_LEN // BLOCK),
                              "max_k": float(stored[:, 0].abs().max()), "max_v": float(stored[:, 1].abs().max())}
        print(f"  {act}/{kv}: quality pass {seconds:.1f} s", flush=True)
        del engine

    max_steps = args.steps * args.rounds + args.warmup + 8
    timed = [c for c in configs if native_bf16 or c[2] != torch.bfloat16]
    runs = {(act, kv, b): DecodeRun(models[dtype], cfg, dtype, b, args.context, max_steps, seed=b, kv_dtype=kv_name)
            for act, kv, dtype, kv_name in timed for b in batches}
    for run in runs.values():
        run.mean_step_s(args.warmup)
    times: dict = {key: [] for key in runs}
    with OtherLoad() as load:
        for _ in range(args.rounds):
            for key, run in runs.items():
                times[key].append(run.mean_step_s(args.steps))
    share = "?" if load.share is None else f"{load.share:.0%}" + ("  <- BUSY" if load.share > 0.05 else "")
    print(f"decode measured; CPU taken by other processes meanwhile: {share}", flush=True)
    for (act, kv, b), ts in times.items():
        results[(act, kv)][f"step_{b}"] = statistics.median(ts)

    base = results[("bf16", "bf16")]["logits"]
    ref = results.get(("fp32", "fp32"), {}).get("logits")
    print()
    head = f"{'act/KV':10} {'KV B/token':>10} {'1 GiB: tokens':>13} {'1k seqs':>7}"
    for b in batches:
        head += f" | {f'b{b} ms/step':>11} {'tok/s':>7}"
    head += f" | {'ppl':>6} | {'KL vs bf16/bf16':>15} {'top-1':>6}"
    if ref is not None:
        head += f" | {'KL vs fp32/fp32':>15} {'top-1':>6}"
    head += f" | {'max |k|, |v|':>13}"
    print(head)
    print("-" * len(head))
    for (act, kv), res in results.items():
        line = f"{act + '/' + kv:10} {res['kv_bytes_per_token']:>10} {res['pool_tokens']:>13,} {res['pool_seqs']:>7}"
        for b in batches:
            s = res.get(f"step_{b}")
            line += f" | {s * 1e3:>11.2f} {b / s:>7.1f}" if s else f" | {'not timed':>11} {'-':>7}"
        line += f" | {res['ppl']:>6.3f}"
        kl, top1 = compare(base, res["logits"])
        line += f" | {kl:>15.5f} {top1:>6.3f}" if (act, kv) != ("bf16", "bf16") else f" | {'-':>15} {'-':>6}"
        if ref is not None:
            kl, top1 = compare(ref, res["logits"])
            line += f" | {kl:>15.5f} {top1:>6.3f}" if (act, kv) != ("fp32", "fp32") else f" | {'-':>15} {'-':>6}"
        line += f" | {res['max_k']:>6.1f} {res['max_v']:>6.1f}"
        print(line)
    print()

    def ratios(a, b):
        x, y = results[a], results[b]
        return (f"{a[0]}/{a[1]} against {b[0]}/{b[1]}: {x['pool_tokens'] / y['pool_tokens']:.1f}x the tokens"
                + "".join(f", batch-{n} step time {x[f'step_{n}'] / y[f'step_{n}']:.2f}x" for n in batches
                          if f"step_{n}" in x and f"step_{n}" in y))
    print(ratios(("bf16", "fp8"), ("bf16", "bf16")))
    if ref is not None:
        print(ratios(("fp32", "bf16"), ("fp32", "fp32")))
        print(ratios(("fp32", "fp8"), ("fp32", "fp32")))
    print("per-round step times (ms): " + "; ".join(
        f"{act}/{kv} b{b}: " + " ".join(f"{t * 1e3:.1f}" for t in ts) for (act, kv, b), ts in times.items()))
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

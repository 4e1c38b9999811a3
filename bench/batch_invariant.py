"""The cost of `--batch-invariant`: the default model in bf16 (fp32 where the CPU has no native bf16), decode steps
at batch 1 and 32 (context 128), a 512-token prefill and a 2,048-token one in chunks of 512, each measured with and
without the mode in one run, alternating, and the ratios printed.

    .venv/bin/python bench/batch_invariant.py [--dtype bfloat16] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferd.config import EngineConfig, cpu_has_native_bf16  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.models.build import load_model  # noqa: E402
from inferd.models.loader import default_model_path  # noqa: E402

CONTEXT = 128  # prompt tokens of each decoding sequence
DECODE_STEPS = 16


def engine(loaded, dtype: torch.dtype, invariant: bool, max_batched: int) -> Engine:
    model, cfg, tok = loaded  # the engine switches the model's layers into (or out of) the mode
    config = EngineConfig(dtype=str(dtype).removeprefix("torch."), kv_cache_bytes=512 << 20,
                          batch_invariant=invariant, enable_prefix_caching=False, max_num_seqs=64,
                          max_num_batched_tokens=max_batched)
    return Engine(model, cfg, config, dtype, tok)


def decode_ms(loaded, dtype, invariant: bool, batch: int, vocab: int) -> float:
    e = engine(loaded, dtype, invariant, max(512, batch * CONTEXT))
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)
    for _ in range(batch):
        e.add_request([rng.randrange(10, vocab) for _ in range(CONTEXT)], params)
    while any(r.num_output_tokens == 0 for r in e.requests.values()):
        e.step()  # the prefills (and the first token)
    times = []
    while e.has_unfinished_requests():
        t0 = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def prefill_ms(loaded, dtype, invariant: bool, vocab: int, tokens: int = 512, chunk: int = 512) -> float:
    """The whole prompt's prefill, in steps of `chunk` tokens (later chunks attend to the earlier ones)."""
    e = engine(loaded, dtype, invariant, chunk)
    rng = random.Random(0)
    e.add_request([rng.randrange(10, vocab) for _ in range(tokens)], SamplingParams(max_tokens=1, temperature=0))
    t0 = time.perf_counter()
    while e.has_unfinished_requests():
        e.step()
    return 1000 * (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16" if cpu_has_native_bf16() else "float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    loaded = load_model(default_model_path(), dtype=dtype)
    vocab = loaded[1].vocab_size
    cases = [("decode batch 1", lambda inv: decode_ms(loaded, dtype, inv, 1, vocab)),
             ("decode batch 32", lambda inv: decode_ms(loaded, dtype, inv, 32, vocab)),
             ("prefill 512", lambda inv: prefill_ms(loaded, dtype, inv, vocab)),
             ("prefill 2048 (4x512)", lambda inv: prefill_ms(loaded, dtype, inv, vocab, tokens=2048))]
    results = {}
    for name, run in cases:
        run(False)  # warm-up
        off, on = [], []
        for _ in range(args.repeats):  # alternating: both see the same machine
            off.append(run(False))
            on.append(run(True))
        results[name] = {"default_ms": statistics.median(off), "batch_invariant_ms": statistics.median(on),
                         "ratio": statistics.median(on) / statistics.median(off)}
    print(f"--batch-invariant cost, default model, {args.dtype}, median of {args.repeats} (ms per decode step / "
          "per whole prefill)")
    print(f"{'case':<22}{'default':>10}{'invariant':>12}{'ratio':>8}")
    for name, r in results.items():
        print(f"{name:<22}{r['default_ms']:>10.1f}{r['batch_invariant_ms']:>12.1f}{r['ratio']:>8.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What prompt logprobs cost (inferd/engine/prompt_logprobs.py), on the offline engine and the default model.

A request asking for them takes no prefix-cache hit and runs its whole prompt, and its prefill rows go through the
LM head. Side by side, one prompt of --tokens tokens, each case --reps times (median), the engine alone:
  uncached          a plain request (max_tokens 1) on a prompt the cache does not hold: the whole prefill;
  cached            the same request again: a prefix-cache hit, only the last block runs;
  prompt_logprobs   the same request asking for prompt logprobs (top --top): the whole prefill plus the LM head
                    over every prompt row, whatever the cache holds.
Ratios: prompt_logprobs / uncached is the LM head's share; prompt_logprobs / cached what skipping the cache costs.

    PYTHONPATH=$PWD .venv/bin/python bench/prompt_logprobs.py [--tokens 512] [--dtype float32] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams


def timed(engine: Engine, prompt: list[int], params: SamplingParams) -> float:
    t = time.perf_counter()
    engine.generate([prompt], params)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=1)
    ap.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens")
    args = ap.parse_args()
    engine = Engine.from_config(EngineConfig(dtype=args.dtype, kv_cache_bytes=256 << 20,
                                             max_num_batched_tokens=args.budget))
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    plain = SamplingParams(max_tokens=1, temperature=0)
    asking = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=args.top)
    times: dict[str, list[float]] = {"uncached": [], "cached": [], "prompt_logprobs": []}
    timed(engine, torch.randint(0, vocab, (args.tokens,), generator=g).tolist(), asking)  # warm-up
    for _ in range(args.reps):
        prompt = torch.randint(0, vocab, (args.tokens,), generator=g).tolist()  # new: nothing of it cached
        times["uncached"].append(timed(engine, prompt, plain))
        times["cached"].append(timed(engine, prompt, plain))
        times["prompt_logprobs"].append(timed(engine, prompt, asking))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"default model, {args.dtype}, a {args.tokens}-token prompt, budget {args.budget}, top {args.top}, "
          f"median of {args.reps} (ms):")
    for k, v in med.items():
        print(f"  {k:16s} {v:8.1f}")
    print(f"prompt_logprobs / uncached: {med['prompt_logprobs'] / med['uncached']:.2f}x   "
          f"prompt_logprobs / cached: {med['prompt_logprobs'] / med['cached']:.2f}x")


if __name__ == "__main__":
    main()

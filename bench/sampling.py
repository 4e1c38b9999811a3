"""The sampler's batched draw (sample_rows) against one full sort per row (sample_row), on real logits: the default
model in bf16, teacher-forced over a text, its last 64 positions.

    .venv/bin/python bench/sampling.py [--steps]

--steps also times whole decode steps of 32 sequences on random-token prompts (flat next-token distributions: the
worst case for the batched draw), greedy against temperature 1.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.config import EngineConfig  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.engine.sampler import sample_row, sample_rows  # noqa: E402
from inferd.models.step_row import StepRow  # noqa: E402

TEXT = ("Write a long story. " * 3 + "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the "
        "Moon, and Neil Armstrong became the first person to walk on its surface. Photosynthesis turns light, water "
        "and carbon dioxide into sugar and oxygen. Once upon a time there was a")


def timed(f, n: int = 3) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1000


def engine_steps() -> None:
    for temperature in (0.0, 1.0):
        engine = Engine.from_config(EngineConfig(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=512,
                                                 max_model_len=1024, enable_prefix_caching=False, detokenize=False))
        for i in range(32):
            engine.add_request([(7 + 131 * i + 17 * j) % 49152 for j in range(60)],
                               SamplingParams(max_tokens=200, temperature=temperature, ignore_eos=True))
        for _ in range(12):  # prefill, then a few decode steps
            engine.step()
        t = time.perf_counter()
        for _ in range(10):
            engine.step()
        print(f"32 rows, random-token prompts, temperature {temperature:g}: "
              f"{(time.perf_counter() - t) / 10 * 1000:.1f} ms per decode step")
        engine.close()


def main() -> int:
    if "--steps" in sys.argv[1:]:
        engine_steps()
    engine = Engine.from_config(EngineConfig(dtype="bfloat16", kv_cache_bytes=64 << 20, max_model_len=1024))
    ids = engine.tokenizer.encode(TEXT)
    with torch.inference_mode():
        hidden, _ = engine.runner.forward([StepRow(ids, 0, list(range(-(-len(ids) // 16))), True)])
        logits = engine.runner.model.compute_logits(hidden)[-64:].float()
    rnd = random.Random(1)
    for name, kw in (("temperature 1", dict(temperature=1.0)), ("temperature 0.7, top_p 0.9",
                                                                dict(temperature=0.7, top_p=0.9))):
        params = SamplingParams(max_tokens=1, **kw)
        us = [rnd.random() for _ in range(len(logits))]
        batched = timed(lambda params=params, us=us: sample_rows(logits, [params] * len(logits), us))
        per_row = timed(lambda params=params, us=us: [sample_row(logits[r], params, us[r]) for r in range(len(logits))])
        same = sum(a == b for a, b in zip(sample_rows(logits, [params] * len(logits), us),
                                          [sample_row(logits[r], params, us[r]) for r in range(len(logits))]))
        print(f"{name}: {len(logits)} rows batched {batched:.1f} ms, one sort per row {per_row:.1f} ms "
              f"(x{per_row / batched:.0f}); same token in {same}/{len(logits)} rows (the others: exact ties)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

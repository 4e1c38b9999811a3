"""Speculative decoding by prompt lookup (`--speculative ngram`) against plain decoding, side by side in one run.

Two workloads on the default model (SmolLM2-135M-Instruct, chat template, greedy, --max-tokens each):
  - repetitive: "edit this code" requests: a Python function from this repository and an instruction to return it
    whole with a small change; the answer copies most of the prompt, the case prompt lookup is for;
  - non-repetitive: open questions whose answers do not quote the prompt; here drafts are mostly wrong or absent and
    speculation must cost little (the issue's bound: under 10%).
Each request runs alone (batch 1, the latency case speculation helps) on two engines built from one model in memory:
plain, and --speculative ngram (default --num-draft 4, n-grams 2..4). Plain and speculative runs of the same request
alternate, in --rounds rounds, so that drift of this shared machine hits both alike; a cell is the median over rounds.
For every request it checks that the outputs are equal (greedy; a divergence is reported with the top-2 logit gap
at that position, which the exactness rule allows only at a near-tie) and reports tokens/s, the speed-up, the share
of drafted tokens accepted, and tokens per step.

    .venv/bin/python bench/speculative.py [--max-tokens 128] [--rounds 3] [--num-draft 4] [--ngram-min 2]
                                          [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.config import EngineConfig, resolve_dtype  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.models.build import load_model  # noqa: E402
from inferd.models.loader import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _function(path: str, name: str) -> str:
    """The source of one top-level function of a repository file (its def line to the next top-level line)."""
    lines = (ROOT / path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {name}("))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace()), len(lines))
    return "\n".join(lines[start:end]).rstrip()


REPETITIVE = [
    ("Rename the variable `hashes` to `chain` in this function and return the whole function, nothing else.",
     ("inferd/engine/kv_cache.py", "hash_prompt_blocks")),
    ("Add a docstring line to this function and return the whole function, nothing else.",
     ("inferd/engine/runner.py", "split_by_length")),
    ("Rename `lens` to `lengths` in this function and return the whole function unchanged otherwise.",
     ("inferd/models/attention.py", "build_decode_mask")),
    ("Add type hints where missing and return the whole function.",
     ("inferd/engine/sampler.py", "sample_row")),
]
NON_REPETITIVE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains, with one sentence each.",
    "What are the advantages and disadvantages of working from home?",
]


def build_prompts(tokenizer) -> dict[str, list[list[int]]]:
    rep = [f"{instruction}\n\n```python\n{_function(*where)}\n```" for instruction, where in REPETITIVE]
    chat = lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                      add_generation_prompt=True)
    return {"repetitive": [chat(t) for t in rep], "non-repetitive": [chat(t) for t in NON_REPETITIVE]}


def run_one(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], list, int, int, int]:
    """(seconds, output tokens, recorded logits, steps, drafted, accepted) of one request alone on the engine."""
    s0 = (engine.stats.num_steps, engine.stats.spec_drafted, engine.stats.spec_accepted)
    t0 = time.perf_counter()
    [req] = engine.generate([prompt], params)
    seconds = time.perf_counter() - t0
    st = engine.stats
    return (seconds, req.output_token_ids, req.debug_logits, st.num_steps - s0[0], st.spec_drafted - s0[1],
            st.spec_accepted - s0[2])


def divergence(ours: list[int], ref: list[int], ref_logits) -> str:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = torch.topk(ref_logits[i], 2).values
            return f"diverges at {i} (top-2 gap {float(top2[0] - top2[1]):.3g})"
    return "equal" if len(ours) == len(ref) else f"lengths {len(ours)} != {len(ref)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    model, config, tokenizer = load_model(default_model_path(), dtype=dtype)
    common = dict(kv_cache_bytes=256 << 20, record_logits=True, detokenize=False)
    plain = Engine(model, config, EngineConfig(**common), dtype, tokenizer)
    spec = Engine(model, config, EngineConfig(speculative="ngram", num_draft=args.num_draft, ngram_min=args.ngram_min,
                                              ngram_max=args.ngram_max, **common), dtype, tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    prompts = build_prompts(tokenizer)
    print(f"SmolLM2-135M-Instruct, {dtype}, {torch.get_num_threads()} threads, greedy, max_tokens {args.max_tokens}, "
          f"--num-draft {args.num_draft}, n-grams {args.ngram_min}..{args.ngram_max}, {args.rounds} rounds; "
          f"prompt tokens: " + ", ".join(f"{k} {[len(p) for p in v]}" for k, v in prompts.items()))
    run_one(plain, prompts["non-repetitive"][0], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    run_one(spec, prompts["repetitive"][0], SamplingParams(max_tokens=8, temperature=0))
    totals = {}
    for workload, plist in prompts.items():
        print(f"\n{workload}:")
        print(f"{'request':>8} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} "
              f"{'accepted':>8} {'tok/step':>8}  outputs")
        sum_plain = sum_spec = 0.0
        drafted = accepted = tokens = steps = 0
        for i, prompt in enumerate(plist):
            tp, ts = [], []
            for r in range(args.rounds):
                order = [(plain, tp), (spec, ts)] if r % 2 == 0 else [(spec, ts), (plain, tp)]
                for engine, times in order:
                    res = run_one(engine, prompt, params)
                    times.append(res[0])
                    if engine is plain:
                        ref = res
                    else:
                        got = res
            n = len(ref[1])
            p_s, s_s = statistics.median(tp), statistics.median(ts)
            acc = got[5] / got[4] if got[4] else 0.0
            print(f"{i:>8} {n:>6} {n / p_s:>11.1f} {len(got[1]) / s_s:>10.1f} {p_s / s_s:>7.2f}x {acc:>8.0%} "
                  f"{len(got[1]) / got[3]:>8.2f}  {divergence(got[1], ref[1], ref[2])}")
            sum_plain += p_s
            sum_spec += s_s
            drafted += got[4]
            accepted += got[5]
            tokens += len(got[1])
            steps += got[3]
        totals[workload] = (sum_plain / sum_spec, accepted / drafted if drafted else 0.0, tokens / steps)
        print(f"{'all':>8} {'':>6} {'':>11} {'':>10} {sum_plain / sum_spec:>7.2f}x "
              f"{totals[workload][1]:>8.0%} {tokens / steps:>8.2f}  (speed-up: total plain time / total spec time)")
    print("\nsummary: " + "; ".join(f"{k}: {v[0]:.2f}x, {v[1]:.0%} of drafts accepted, {v[2]:.2f} tokens/step"
                                    for k, v in totals.items()))


if __name__ == "__main__":
    main()

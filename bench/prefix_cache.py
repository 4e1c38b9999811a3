"""Prefix caching's gain and its cost, on and off side by side in one run (EngineConfig.enable_prefix_caching;
`--no-prefix-caching` on the CLI).

  1. gain: requests that share a --system-len (default 1,000) token system prompt, each with its own short user
     part (--user-len tokens, uniform in [len/2, len*3/2]) and --output-len output tokens (greedy, ignore_eos), driven
     closed-loop at --concurrency (a new request enters as one ends): TTFT p50 / p90, output tokens/s, requests/s,
     and the prefix-cache hit rate (prompt tokens served from the cache), on against off;
  2. cost: every prompt distinct (random token ids, --distinct-len tokens: a 0% hit rate), same closed loop: output
     tokens/s on / off (vLLM reports its cost under 1%). With caching on every full block is hashed (SHA-256 chain)
     at admission and as it fills, kept in the cache after its request ends and evicted LRU when the pool runs dry
     (the pool is sized so that it does: --kv-cache-bytes). A cost under 1% drowns in this machine's noise, so the
     script also times, inside every run, the calls into the KV pool manager (lookup, admission, growth, publishing
     full blocks, freeing) on and off, and the block hashing alone per token: figures that do not depend on how
     long a whole run happened to take.

    .venv/bin/python bench/prefix_cache.py [--workloads shared,distinct] [--pairs 3] [--distinct-pairs 4]
                                           [--requests 16] [--concurrency 4] [--system-len 1000] [--dtype auto]
                                           [--threads N]

Why the offline engine and not a server. Prefix caching lives in the engine (the scheduler's admission, the KV block
pool), and what it changes is the prefill work a step does; the server adds HTTP, JSON, the API process and the
worker hop, which are the same whether caching is on or off: they would add the same time to both sides (diluting
the ratio) and add their own noise (two processes on two cores), which matters for a cost expected under 1%. The
flag is also per process: on and off through a server means two servers (two copies of the model taking turns on the
same two cores, or fighting over them) or a restart per switch (seconds of loading each time), so the runs could not
alternate closely. In one process two Engines share one set of weights and differ only in their KV pool and the
flag, so each on run sits seconds from its off run. TTFT here is from add_request() to the end of the step that
produced the request's first token: the queueing and prefill the cache removes, without the constant hops a
client would also see (bench/server_vs_offline.py measures those).

On and off alternate (ABBA: on-off, then off-on, ...) and each pair uses prompts of its own seed (the same for both
sides of a pair; another pair's system prompt is never a hit). These shared 2-core machines drift by tens of
percent over minutes and slow down several-fold while another process takes a core: ratios are taken within each
pair and the median is reported with the range; the CPU share other processes took during each run is printed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.config import EngineConfig, resolve_dtype  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.engine.kv_cache import hash_prompt_blocks  # noqa: E402
from inferd.models.build import load_model  # noqa: E402
from inferd.models.loader import default_model_path  # noqa: E402
from inferd.telemetry.roofline import OtherLoad  # noqa: E402

LOW_ID = 1000  # prompt ids from [LOW_ID, min(vocab, 40000)): clear of special and byte tokens


class KVTimer:
    """Wall time inside the KV pool manager's entry points (prefix lookup, admission, growth, publishing full
    blocks, freeing): the bookkeeping prefix caching adds to, timed inside the real run. Microseconds of Python each,
    so the other processes' share of the CPU stretches them far less than it stretches a run."""

    METHODS = ("match_prefix", "admit", "allocate", "cache_full_blocks", "free")

    def __init__(self, kv_cache):
        self.seconds = 0.0
        for name in self.METHODS:
            setattr(kv_cache, name, self._timed(getattr(kv_cache, name)))  # instance attribute over the method

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return wrapper


@dataclass
class Run:
    seconds: float
    ttfts: list[float]  # seconds, per request
    output_tokens: int
    requests: int
    hit_rate: float  # prompt tokens served from the prefix cache / prompt tokens admitted
    other_load: float | None
    kv_seconds: float  # inside the KV pool manager (KVTimer)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def req_s(self) -> float:
        return self.requests / self.seconds

    def ttft_ms(self, q: float) -> float:
        return float(torch.tensor(self.ttfts).quantile(q)) * 1000.0


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(LOW_ID, min(vocab, 40000)) for _ in range(n)]


def shared_prompts(seed: int, n: int, system_len: int, user_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(f"shared-{seed}")
    system = random_ids(rng, system_len, vocab)
    return [system + random_ids(rng, rng.randint(max(1, user_len // 2), user_len * 3 // 2), vocab)
            for _ in range(n)]


def distinct_prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(f"distinct-{seed}")
    return [random_ids(rng, length, vocab) for _ in range(n)]


def closed_loop(engine: Engine, prompts: list[list[int]], concurrency: int, output_len: int) -> Run:
    """Every prompt through the engine, at most `concurrency` in it at once (a new one enters as one ends)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    stats = engine.kv_cache.stats
    queries0, hits0, kv0 = stats.queries, stats.hits, engine.kv_timer.seconds
    pending = list(prompts)
    added: dict[str, float] = {}
    ttfts: dict[str, float] = {}
    inflight = produced = 0
    with OtherLoad() as load:
        start = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and inflight < concurrency:
                rid = engine.add_request(pending.pop(0), params)
                added[rid] = time.perf_counter()
                inflight += 1
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.new_token_ids and out.request_id not in ttfts:
                    ttfts[out.request_id] = now - added[out.request_id]
                produced += len(out.new_token_ids)
                inflight -= out.finished
        seconds = time.perf_counter() - start
    assert len(ttfts) == len(prompts) and produced == len(prompts) * output_len, (len(ttfts), produced)
    queries, hits = stats.queries - queries0, stats.hits - hits0
    return Run(seconds, list(ttfts.values()), produced, len(prompts), hits / max(1, queries), load.share,
               engine.kv_timer.seconds - kv0)


def hash_us_per_token(block_size: int, n_tokens: int = 200_000) -> float:
    """The prefix cache's hashing alone (inferd.engine.kv_cache.hash_prompt_blocks), microseconds per token, best
    of 3."""
    ids = random_ids(random.Random(0), n_tokens, 40000)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        hash_prompt_blocks(ids, block_size)
        best = min(best, time.perf_counter() - t)
    return best / n_tokens * 1e6


def _load(share: float | None) -> str:
    if share is None:
        return "other load ?"
    return f"other load {share:.0%}" + ("  <- BUSY" if share > 0.05 else "")


def alternate(engines: dict[bool, Engine], pairs: int, make_prompts, concurrency: int, output_len: int,
              show) -> list[dict[bool, Run]]:
    """ABBA pairs: on-off, off-on, ...; the prompts of pair i come from make_prompts(i), the same for both sides."""
    results = []
    for i in range(pairs):
        prompts = make_prompts(i)
        order = (True, False) if i % 2 == 0 else (False, True)
        pair = {}
        for on in order:
            pair[on] = closed_loop(engines[on], prompts, concurrency, output_len)
        show(i, order, pair)
        results.append(pair)
    return results


def _median(values):
    return statistics.median(values)


def name(on: bool) -> str:
    return "on " if on else "off"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="per engine (both have one)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=1000, help="workload 1: the shared system prompt")
    ap.add_argument("--user-len", type=int, default=40, help="workload 1: mean user part (uniform len/2..3len/2)")
    ap.add_argument("--requests", type=int, default=16, help="workload 1: requests per run")
    ap.add_argument("--pairs", type=int, default=3, help="workload 1: on/off pairs")
    ap.add_argument("--distinct-len", type=int, default=256, help="workload 2: prompt tokens, every prompt distinct")
    ap.add_argument("--distinct-requests", type=int, default=24, help="workload 2: requests per run")
    ap.add_argument("--distinct-pairs", type=int, default=4, help="workload 2: on/off pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default="shared,distinct", help="which to run: shared, distinct or both")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: torch's own); 1 keeps a neighbour on the other core from stalling "
                         "OpenMP")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = args.model or default_model_path()
    dtype = resolve_dtype(args.dtype)
    max_len = max(args.system_len + args.user_len * 3 // 2, args.distinct_len) + args.output_len + 16
    model, model_config, tokenizer = load_model(path, dtype=dtype, max_positions=max_len)
    engines = {on: Engine(model, model_config, EngineConfig(
        model=path, dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=max(args.concurrency, 1),
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len, enable_prefix_caching=on,
        detokenize=False), dtype, tokenizer) for on in (True, False)}
    for engine in engines.values():
        engine.kv_timer = KVTimer(engine.kv_cache)
    vocab = model_config.vocab_size
    pool = engines[True].kv_cache.num_blocks * engines[True].kv_cache.block_size
    print(f"model {os.path.basename(path)}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"two engines sharing the weights, each with a KV pool of {pool} tokens, step budget "
          f"{args.max_num_batched_tokens} tokens, concurrency {args.concurrency}, {args.output_len} output tokens "
          "per request (greedy, ignore_eos)", flush=True)
    for on, engine in engines.items():  # warm-up, untimed: first steps of each shape are slow
        closed_loop(engine, distinct_prompts(10_000 + on, 2, args.system_len, vocab), 2, 4)

    workloads = set(args.workloads.split(","))
    if "shared" in workloads:
        shared_prefix(args, engines, vocab)
    if "distinct" in workloads:
        distinct_cost(args, engines, vocab, pool)
    return 0


def shared_prefix(args, engines: dict[bool, Engine], vocab: int) -> None:
    # ---- 1. a shared system prompt ------------------------------------------------------------------------------
    print(f"\n1. shared {args.system_len}-token system prompt + {args.user_len // 2}-{args.user_len * 3 // 2}-token "
          f"user parts; {args.requests} requests per run, {args.pairs} pairs", flush=True)

    def show1(i, order, pair):
        for on in order:
            r = pair[on]
            print(f"  pair {i + 1} {name(on)}: TTFT p50 {r.ttft_ms(0.5):7.0f} ms p90 {r.ttft_ms(0.9):7.0f} ms, "
                  f"{r.tok_s:6.1f} output tok/s, {r.req_s:5.2f} req/s, hit rate {r.hit_rate:4.0%}, "
                  f"{r.seconds:5.1f} s, {_load(r.other_load)}", flush=True)

    shared = alternate(engines, args.pairs, lambda i: shared_prompts(args.seed + i, args.requests, args.system_len,
                                                                    args.user_len, vocab),
                       args.concurrency, args.output_len, show1)
    for on in (True, False):
        runs = [p[on] for p in shared]
        print(f"  median, caching {name(on)}: TTFT p50 {_median([r.ttft_ms(0.5) for r in runs]):.0f} ms, p90 "
              f"{_median([r.ttft_ms(0.9) for r in runs]):.0f} ms; {_median([r.tok_s for r in runs]):.1f} output "
              f"tok/s, {_median([r.req_s for r in runs]):.2f} req/s; hit rate "
              f"{_median([r.hit_rate for r in runs]):.0%}")
    for label, fn in (("TTFT p50 off / on", lambda p: p[False].ttft_ms(0.5) / p[True].ttft_ms(0.5)),
                      ("TTFT p90 off / on", lambda p: p[False].ttft_ms(0.9) / p[True].ttft_ms(0.9)),
                      ("throughput on / off", lambda p: p[True].tok_s / p[False].tok_s)):
        ratios = [fn(p) for p in shared]
        print(f"  {label}: {_median(ratios):.2f}x (pairs: {', '.join(f'{x:.2f}' for x in ratios)})")


def distinct_cost(args, engines: dict[bool, Engine], vocab: int, pool: int) -> None:
    # ---- 2. every prompt distinct: the cost --------------------------------------------------------------------
    block = engines[True].kv_cache.block_size
    print(f"\n2. every prompt distinct (0% hits): {args.distinct_len}-token prompts, {args.distinct_requests} requests "
          f"per run ({args.distinct_requests * (args.distinct_len + args.output_len)} tokens through a {pool}-token "
          f"pool), {args.distinct_pairs} pairs", flush=True)

    def show2(i, order, pair):
        for on in order:
            r = pair[on]
            print(f"  pair {i + 1} {name(on)}: {r.tok_s:6.1f} output tok/s, {r.seconds:5.2f} s, hit rate "
                  f"{r.hit_rate:4.0%}, TTFT p50 {r.ttft_ms(0.5):5.0f} ms, KV bookkeeping {r.kv_seconds * 1e3:6.1f} ms, "
                  f"{_load(r.other_load)}", flush=True)

    distinct = alternate(engines, args.distinct_pairs,
                         lambda i: distinct_prompts(args.seed + 1000 + i, args.distinct_requests, args.distinct_len,
                                                    vocab),
                         args.concurrency, args.output_len, show2)
    ratios = [p[True].tok_s / p[False].tok_s for p in distinct]
    pooled_on = sum(p[True].output_tokens for p in distinct) / sum(p[True].seconds for p in distinct)
    pooled_off = sum(p[False].output_tokens for p in distinct) / sum(p[False].seconds for p in distinct)
    print(f"  throughput on / off: median {_median(ratios):.3f}x (pairs: {', '.join(f'{x:.3f}' for x in ratios)}); "
          f"all runs pooled {pooled_on / pooled_off:.3f}x ({pooled_on:.1f} vs {pooled_off:.1f} output tok/s)")
    extra = [(p[True].kv_seconds - p[False].kv_seconds) / p[True].seconds for p in distinct]
    print(f"  KV bookkeeping, median per run: on {_median([p[True].kv_seconds for p in distinct]) * 1e3:.1f} ms, off "
          f"{_median([p[False].kv_seconds for p in distinct]) * 1e3:.1f} ms; what caching adds: median "
          f"{_median(extra):.3%} of a run (pairs: {', '.join(f'{x:.3%}' for x in extra)})")
    us = hash_us_per_token(block)
    run = _median([p[True].seconds for p in distinct])
    hashed = args.distinct_requests * (args.distinct_len + args.output_len)
    print(f"  the hashing alone (hash_prompt_blocks, SHA-256 per {block}-token block): {us:.2f} us per token; a run "
          f"hashes at most {hashed} tokens: {hashed * us / 1e3:.1f} ms of its {run:.1f} s "
          f"({hashed * us / 1e6 / run:.3%})")


if __name__ == "__main__":
    sys.exit(main())

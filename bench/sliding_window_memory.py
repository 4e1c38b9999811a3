"""KV bytes per sequence with sliding-window layers given back (inferd/engine/kv_groups.py) against keeping every
position, from the real allocator: a KVCacheManager split the way the engine splits it runs one sequence through
chunked prefill to --context tokens and a few decodes, and the blocks it holds in each group are counted.

Default shape: Gemma 3 1B (26 layers, 5 sliding per global one, window 512, 1 KV head of 256 dims, bf16 cache).
Also prints the split of a --pool-bytes pool between the groups (at --max-num-seqs, --max-num-batched-tokens) and
how many --context-token sequences fit it each way. No model weights, no device: pure block arithmetic.

    .venv/bin/python bench/sliding_window_memory.py [--context 8192] [--layers 26] [--pattern 6] [--window 512]
        [--kv-heads 1] [--head-dim 256] [--block-size 16] [--pool-bytes 4G] [--max-num-seqs 64]
        [--max-num-batched-tokens 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.cli.types import parse_bytes  # noqa: E402
from inferd.engine.kv_cache import KVCacheManager  # noqa: E402
from inferd.engine.kv_groups import kv_cache_groups, split_kv_budget  # noqa: E402
from inferd.engine.request import Request, SamplingParams  # noqa: E402
from inferd.engine.runner import kv_bytes_per_block  # noqa: E402
from inferd.models.config import ModelConfig  # noqa: E402


def gemma3_shaped(args) -> ModelConfig:
    """Gemma 3's layout: every `pattern`-th layer global, the others sliding."""
    types = ["full_attention" if (i + 1) % args.pattern == 0 else "sliding_attention" for i in range(args.layers)]
    return ModelConfig("llama", 262144, 1152, 6912, args.layers, 4, args.kv_heads, args.head_dim,
                       max_position_embeddings=32768, sliding_window=args.window, layer_types=types)


def held_bytes(cfg: ModelConfig, args, reclaim: bool) -> tuple[int, list[tuple[int, int, int]]]:
    """Bytes one sequence holds at --context tokens (after its last decode step's allocation), and per group
    (window, layers, blocks held)."""
    per_layer = kv_bytes_per_block(cfg, args.block_size, torch.bfloat16) // cfg.num_hidden_layers
    groups = split_kv_budget(kv_cache_groups(cfg, reclaim), args.pool_bytes, per_layer, args.block_size,
                             args.max_num_seqs, args.max_num_batched_tokens)
    kv = KVCacheManager([g.num_blocks - bool(g.window) for g in groups], args.block_size, False,
                        [g.window for g in groups])
    prompt = args.context - 16
    req = Request("r", list(range(prompt)), SamplingParams(max_tokens=16))
    chunk = args.max_num_batched_tokens
    assert kv.admit(req, [], min(chunk, prompt))
    req.num_computed_tokens = min(chunk, prompt)
    while req.num_computed_tokens < prompt:  # chunked prefill
        n = min(chunk, prompt - req.num_computed_tokens)
        assert kv.allocate(req, n)
        req.num_computed_tokens += n
    for _ in range(16):  # decodes up to --context
        req.token_ids.append(0)
        assert kv.allocate(req, 1)
        req.num_computed_tokens += 1
    held = kv.blocks_in_use(req)
    total = sum(n * len(g.layers) * per_layer for n, g in zip(held, groups))
    kv.free(req)
    kv.check_no_leaks()
    return total, [(g.window, len(g.layers), n, g.num_blocks) for g, n in zip(groups, held)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--pattern", type=int, default=6, help="every N-th layer attends to everything")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-bytes", type=parse_bytes, default=parse_bytes("4G"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = p.parse_args()
    cfg = gemma3_shaped(args)
    results = {}
    for reclaim in (False, True):
        total, groups = held_bytes(cfg, args, reclaim)
        results[reclaim] = total
        label = "sliding layers give back" if reclaim else "every position kept"
        print(f"{label}: {total / 2**20:.2f} MiB per sequence at {args.context} tokens")
        for window, layers, held, pool in groups:
            kind = f"window {window}" if window else "full"
            print(f"  group {kind:>11}: {layers:2d} layers, {held:4d} blocks held, pool {pool} blocks")
        print(f"  {args.context}-token sequences in a {args.pool_bytes / 2**30:g} GiB pool: "
              f"{min(pool // held for _, _, held, pool in groups)}")
    print(f"ratio: {results[False] / results[True]:.2f}x less KV per sequence")


if __name__ == "__main__":
    main()

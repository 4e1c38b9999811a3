"""The fused CPU decode attention over a long context with a sliding window against the same op without one: the
window lets the kernel skip every block before the last `window` positions, so its cost should follow the window,
not the context. SmolLM2-135M's attention shapes (9 query heads over 3 KV heads of 64, bf16, block size 16), random
cache values; the op alone, called over as many layers' caches in turn as make up `--cache-mb` of KV (so that, as in
a model's step, a layer's cache is not still in the CPU's caches from its previous call), alternating window sizes
round by round. Each row's blocks lie in order (as a fresh engine hands them out), or with `--scatter` at random
places in the cache (as after much allocation and freeing).

    .venv/bin/python bench/window_decode.py [--context 8192] [--windows 0,512] [--batches 1,8] [--calls 50]
                                            [--repeats 5] [--threads N] [--cache-mb 512]
                                            [--scatter]

Per (batch, window): the median over `repeats` rounds of each round's median time per call (one layer). Read
ratios: the machine is shared (on a loaded 2-core machine `--threads 1` keeps OpenMP's stalls out of the figures)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferd import kernels  # noqa: E402

H, KV, D, BLOCK = 9, 3, 64, 16


def case(batch: int, context: int, dtype: torch.dtype, layers: int, scatter: bool):
    """q, block tables and lengths for `batch` rows of `context` positions, and `layers` (k, v) caches."""
    g = torch.Generator().manual_seed(0)
    per_row = -(-context // BLOCK)
    caches = [(torch.randn(KV, batch * per_row, BLOCK, D, generator=g).to(dtype),
               torch.randn(KV, batch * per_row, BLOCK, D, generator=g).to(dtype)) for _ in range(layers)]
    order = torch.randperm(batch * per_row, generator=g) if scatter else torch.arange(batch * per_row)
    tables = order.to(torch.int32).view(batch, per_row)
    q = torch.randn(batch, H, D, generator=g).to(dtype)
    return q, caches, tables, torch.full((batch,), context, dtype=torch.int32)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--windows", default="0,512", help="0: no window (the whole context)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--cache-mb", type=int, default=512, help="KV bytes the calls cycle through (more than the LLC)")
    p.add_argument("--scatter", action="store_true", help="each row's blocks at random places in the cache")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = kernels.fused_cpu()
    if ops is None:
        from inferd.kernels import build

        print(f"the fused CPU kernels are not available: {build.error()}", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    windows = [int(w) for w in args.windows.split(",")]
    print(f"fused paged_decode_attention, context {args.context}, {args.dtype}, H {H} / KV {KV} x {D}, "
          f"{torch.get_num_threads()} threads, {args.cache_mb} MB of KV per window and batch, blocks "
          f"{'scattered' if args.scatter else 'in order'}")
    for batch in [int(b) for b in args.batches.split(",")]:
        layer_bytes = 2 * KV * batch * args.context * D * dtype.itemsize
        layers = max(2, -(-args.cache_mb * 2 ** 20 // layer_bytes))
        q, caches, tables, lens = case(batch, args.context, dtype, layers, args.scatter)
        rounds: dict[int, list[float]] = {w: [] for w in windows}
        for _ in range(args.repeats):
            for w in windows:  # alternating: drift hits every window alike
                times = []
                for i in range(args.calls + layers):  # the first pass over the layers warms up
                    k, v = caches[i % layers]
                    t0 = time.perf_counter()
                    ops.paged_decode_attention(q, k, v, tables, lens, D ** -0.5, window=w)
                    if i >= layers:
                        times.append(time.perf_counter() - t0)
                rounds[w].append(statistics.median(times))
        base = statistics.median(rounds[windows[0]])
        for w in windows:
            ms = statistics.median(rounds[w]) * 1e3
            print(f"batch {batch:3d}  window {w or 'none':>5}: {ms:8.3f} ms per call  x{base * 1e3 / ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-call time of the LoRA operator (kernels: the fused CPU lora_add against reference.lora_add) beside the base
projection's matmul (a packed Linear, as the model runs it), for SmolLM2-135M's four projections. Each layer has
its own weights and adapter buffers (--layers copies), so that, as in a real step, they come from memory and not
from the cache of the previous call. A decode step's rows: row i has slot i % slots (one slot's rows are not
contiguous in y).

    PYTHONPATH=$PWD .venv/bin/python bench/lora_op.py [--dtype bf16] [--rows 32] [--slots 8] [--rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inferd import kernels
from inferd.kernels import reference
from inferd.models.layers import Linear
from inferd.models.lora import LoraState, LoraTarget

HIDDEN, Q, KV, INTER = 576, 576, 192, 1536
PROJECTIONS = {"qkv_proj": (HIDDEN, [Q, KV, KV]), "o_proj": (Q, [HIDDEN]), "gate_up_proj": (HIDDEN, [INTER, INTER]),
               "down_proj": (INTER, [HIDDEN])}


def per_call_us(fn, calls: int, reps: int) -> float:
    """Median over reps of the mean time of one of `calls` calls (fn(i) runs call i), in microseconds."""
    fn(0)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(calls):
            fn(i)
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--slots", type=int, default=8, help="adapters the rows spread over (max_loras too)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ops = kernels.fused_cpu()
    assert ops is not None, "the fused CPU kernels did not build"
    g = torch.Generator().manual_seed(0)
    state = LoraState(args.slots, args.rank, ops.lora_add)
    state.ranks = [args.rank] * args.slots
    state.begin_step([i % args.slots for i in range(args.rows)], torch.device("cpu"))
    step = state.step
    print(f"{args.dtype}, {args.rows} rows over {args.slots} slots, rank {args.rank}, {args.layers} layers, "
          f"{torch.get_num_threads()} threads; per call, median of {args.reps}:")
    print(f"{'projection':<14}{'base matmul':>14}{'fused lora':>14}{'reference':>14}")
    totals = [0.0, 0.0, 0.0]
    with torch.inference_mode():
        for name, (in_f, parts) in PROJECTIONS.items():
            out = sum(parts)
            linears, targets = [], []
            for _ in range(args.layers):
                lin = Linear(in_f, out, False)
                lin.weight.data = (torch.randn(out, in_f, generator=g) * 0.02).to(dtype)
                lin.pack()
                linears.append(lin)
                t = LoraTarget(state, in_f, parts, dtype, torch.device("cpu"))
                for s in range(args.slots):
                    t.write(s, args.rank, {p: (torch.randn(args.rank, in_f, generator=g) * 0.02,
                                               torch.randn(size, args.rank, generator=g) * 0.02)
                                           for p, size in enumerate(parts)}, 2.0)
                targets.append(t)
            x = torch.randn(args.rows, in_f, generator=g).to(dtype)
            y = linears[0]._forward(x)
            L = args.layers

            def base(i):
                linears[i % L]._forward(x)

            def lora(add):
                def call(i):
                    t = targets[i % L]
                    add(y, x, step.perm, step.seg_slots, step.seg_starts, step.row_slots, t.a, t.bt, step.ranks,
                        t.parts)
                return call

            row = [per_call_us(base, 4 * L, args.reps), per_call_us(lora(ops.lora_add), 4 * L, args.reps),
                   per_call_us(lora(reference.lora_add), 4 * L, args.reps)]
            totals = [a + b for a, b in zip(totals, row)]
            print(f"{name:<14}" + "".join(f"{v:>11.1f} us" for v in row))
    print(f"{'x ' + str(args.layers) + ' layers':<14}" + "".join(f"{v * args.layers / 1e3:>11.2f} ms" for v in totals))


if __name__ == "__main__":
    main()

"""The LoRA operator's cost on CPU, two ways.

Per call (default): the fused lora_add against reference.lora_add, beside the base projection's matmul (a packed
Linear, as the model runs it), for SmolLM2-135M's four projections. Each of --layers layers has its own weights and
adapter buffers, so that, as in a real step, they come from memory and not from the previous call's cache. Row i
has slot i % slots (one slot's rows are not contiguous in y), every slot of rank --rank.

--step: one whole decode step of the default model (SmolLM2-135M) at batch --rows, the model's forward only (the
decode stack in one call), without LoRA and with every row on an adapter (models/lora.attach, random adapters).

    PYTHONPATH=$PWD .venv/bin/python bench/lora_op.py [--dtype bf16] [--rows 32] [--slots 8] [--rank 16] [--step]
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


def random_adapters(target: LoraTarget, slots: int, rank: int, g: torch.Generator) -> None:
    for s in range(slots):
        target.write(s, rank, {p: (torch.randn(rank, target.in_features, generator=g) * 0.02,
                                   torch.randn(size, rank, generator=g) * 0.02) for p, size in enumerate(target.parts)},
                     2.0)
    target.state.ranks[:slots] = [rank] * slots


def projection_row(in_f: int, parts: list[int], state: LoraState, args, dtype, ops, g) -> list[float]:
    """[base matmul, fused lora_add, reference.lora_add] per call (us) for one projection."""
    out, step, layers = sum(parts), state.step, args.layers
    linears, targets = [], []
    for _ in range(layers):
        lin = Linear(in_f, out, False)
        lin.weight.data = (torch.randn(out, in_f, generator=g) * 0.02).to(dtype)
        lin.pack()
        linears.append(lin)
        targets.append(LoraTarget(state, in_f, parts, dtype, torch.device("cpu")))
        random_adapters(targets[-1], args.slots, args.rank, g)
    x = torch.randn(args.rows, in_f, generator=g).to(dtype)
    y = linears[0]._forward(x)

    def base(i):
        linears[i % layers]._forward(x)

    def lora(add):
        def call(i):
            t = targets[i % layers]
            add(y, x, step.perm, step.seg_slots, step.seg_starts, step.row_slots, t.a, t.bt, step.ranks, t.parts)
        return call

    calls = 4 * layers
    return [per_call_us(base, calls, args.reps), per_call_us(lora(ops.lora_add), calls, args.reps),
            per_call_us(lora(reference.lora_add), calls, args.reps)]


def per_call(args, dtype, ops) -> None:
    g = torch.Generator().manual_seed(0)
    state = LoraState(args.slots, args.rank, ops.lora_add)
    state.ranks = [args.rank] * args.slots  # begin_step copies them
    state.begin_step([i % args.slots for i in range(args.rows)], torch.device("cpu"))
    print(f"{args.dtype}, {args.rows} rows over {args.slots} slots, rank {args.rank}, {args.layers} layers, "
          f"{torch.get_num_threads()} threads; per call, median of {args.reps}:")
    print(f"{'projection':<14}{'base matmul':>14}{'fused lora':>14}{'reference':>14}")
    totals = [0.0, 0.0, 0.0]
    with torch.inference_mode():
        for name, (in_f, parts) in PROJECTIONS.items():
            row = projection_row(in_f, parts, state, args, dtype, ops, g)
            totals = [a + b for a, b in zip(totals, row)]
            print(f"{name:<14}" + "".join(f"{v:>11.1f} us" for v in row))
    print(f"{'x layers':<14}" + "".join(f"{v * args.layers / 1e3:>11.2f} ms" for v in totals))


def whole_step(args, dtype) -> None:
    from inferd.config import EngineConfig
    from inferd.engine import Engine, SamplingParams
    from inferd.engine.runner import kv_bytes_per_block
    from inferd.models.build import load_model
    from inferd.models.loader import default_model_path
    from inferd.models.lora import attach, projections

    model, cfg, tok = load_model(default_model_path(), dtype=dtype)
    engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, dtype) * 1024,
                                             max_num_seqs=args.rows), dtype, tok)
    add = reference.lora_add if args.reference else model.ops.lora_add  # reference: the Python layers run LoRA steps
    state = attach(model, args.slots, args.rank, add, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for layer in range(cfg.num_hidden_layers):
        for linear in projections(model, layer).values():
            random_adapters(linear.lora, args.slots, args.rank, g)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(args.rows):
        engine.add_request([5 + (i * 7 + j) % 1000 for j in range(args.context)], params)
    while any(r.num_computed_tokens < len(r.token_ids) - 1 for r in engine.requests.values()):
        engine.step()
    runner, seen = engine.runner, {}
    prepare = runner.prepare
    runner.prepare = lambda rows: seen.setdefault("args", prepare(rows))
    engine.step()
    runner.prepare = prepare
    ids, positions, meta, _ = seen["args"]
    times = {"base": [], "lora": []}
    with torch.inference_mode():
        for _ in range(args.reps):  # alternately, so that a disturbance hits both alike
            for name, row_slots in (("base", [-1] * args.rows), ("lora", [i % args.slots for i in range(args.rows)])):
                state.begin_step(row_slots, torch.device("cpu"))
                model(ids, positions, meta, runner.kv_caches)  # (rewrites the same KV slots each time)
                t = time.perf_counter()
                for _ in range(5):
                    model(ids, positions, meta, runner.kv_caches)
                times[name].append((time.perf_counter() - t) / 5 * 1e3)
                state.end_step()
    results = {name: statistics.median(v) for name, v in times.items()}
    print(f"SmolLM2-135M {args.dtype} decode step (forward), batch {args.rows}, context {args.context}, "
          f"{args.slots} adapters of rank {args.rank} ({'reference' if args.reference else 'fused'}), "
          f"{torch.get_num_threads()} threads, median of {args.reps}: "
          f"base {results['base']:.2f} ms, with LoRA {results['lora']:.2f} ms "
          f"({results['lora'] / results['base']:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--slots", type=int, default=8, help="adapters the rows spread over (max_loras too)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--step", action="store_true", help="a whole decode step of the default model")
    p.add_argument("--context", type=int, default=128, help="--step: each sequence's prompt tokens")
    p.add_argument("--reference", action="store_true", help="--step: LoRA by reference.lora_add (no decode_layers)")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ops = kernels.fused_cpu()
    assert ops is not None, "the fused CPU kernels did not build"
    if args.step:
        whole_step(args, dtype)
    else:
        per_call(args, dtype, ops)


if __name__ == "__main__":
    main()

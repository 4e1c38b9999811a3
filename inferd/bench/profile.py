"""`inferd profile`: where this model stops being memory-bound on this device.

Sweeps decode batch size (1, 2, 4, ... up to what the KV pool holds at the context length) at a few context
lengths, and prefill length, on the engine itself (the same scheduler, runner and sampler as serving); for each
point it times engine steps and prints step time, tokens/s, bytes and FLOPs per step, MBU, MFU and the bound (memory
when the step's arithmetic intensity is under the ridge point, peak FLOP/s / peak bandwidth). It writes a roofline
plot (PNG): the attainable FLOP/s line min(peak FLOP/s, intensity x peak bandwidth) and every measured step on it.

    inferd profile [--model M] [--dtype D] [--kv-dtype K] [--contexts 128,1024] [--max-batch 64]
                   [--prefill 64,256,1024] [--steps 8] [--out DIR]

(its flags: inferd/cli/profile.py)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

DEFAULT_CONTEXTS = (128, 1024)
DEFAULT_PREFILL = (64, 256, 1024)
# mixed steps (a decode batch and one prompt chunk in the same step, as chunked prefill makes them while serving):
# decode batches x prefill chunk lengths, at the first of --contexts; what `inferd plan` models a busy worker with
DEFAULT_MIXED_BATCHES = (1, 8, 32)
DEFAULT_MIXED_PREFILL = (64, 192)


@dataclass
class Point:
    kind: str  # decode | prefill | mixed
    batch: int  # decode rows
    context: int  # decode and mixed: the context the decode rows attend; prefill: the prompt length
    step_s: float
    tokens_per_s: float
    bytes: int
    flops: int
    mbu: float
    mfu: float
    intensity: float  # FLOPs per byte
    bound: str
    prefill_tokens: int = 0  # mixed: the prompt chunk run beside the decode rows


def _point(kind: str, batch: int, context: int, seconds: list[float], nbytes: int, flops: int, tokens: int,
           peaks) -> Point:
    if not seconds:
        raise RuntimeError(f"no clean {kind} step measured at batch {batch}, context {context}")
    step_s = sorted(seconds)[len(seconds) // 2]  # median
    intensity = flops / nbytes
    return Point(kind, batch, context, step_s, tokens / step_s, nbytes, flops, nbytes / step_s / peaks.bandwidth,
                 flops / step_s / peaks.flops, intensity, "memory" if intensity < peaks.ridge else "compute")


def decode_point(engine, batch: int, context: int, steps: int, peaks) -> Point:
    """batch requests with context-token prompts, prefilled (untimed), then `steps` decode steps timed."""
    from ..engine import SamplingParams

    # early rows decode while later ones still prefill (chunked): enough max_tokens that none finishes before the
    # timed steps
    budget = engine.config.max_num_batched_tokens
    params = SamplingParams(max_tokens=steps + 4 + batch * context // budget, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        # distinct prompts: no prefix sharing between the rows
        engine.add_request([(7 + 131 * i + 17 * j) % vocab for j in range(context - 1)], params)
    while any(r.num_computed_tokens < len(r.token_ids) - 1 for r in engine.requests.values()):
        engine.step()
    seconds, nbytes, flops, tokens = [], 0, 0, 0
    for _ in range(steps):
        engine.step()
        s, prefill, decode, b, f = engine.stats.last
        if prefill or decode != batch:
            break  # a request finished: the batch changed
        seconds.append(s)
        nbytes, flops, tokens = b, f, decode
    _finish(engine)
    return _point("decode", batch, context, seconds, nbytes, flops, tokens, peaks)


def mixed_point(engine, batch: int, context: int, prefill: int, repeats: int, peaks) -> Point:
    """batch requests decoding at `context` (set up untimed, as decode_point does), then `repeats` times a new
    request of a `prefill`-token prompt: the step that runs its prompt beside the batch's decodes is timed."""
    from ..engine import SamplingParams

    budget = engine.config.max_num_batched_tokens
    params = SamplingParams(max_tokens=2 * repeats + 8 + batch * context // budget, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request([(5 + 113 * i + 19 * j) % vocab for j in range(context - 1)], params)
    while any(r.num_computed_tokens < len(r.token_ids) - 1 for r in engine.requests.values()):
        engine.step()
    seconds, nbytes, flops = [], 0, 0
    for r in range(repeats):
        request_id = engine.add_request([(13 + 89 * r + 31 * j) % vocab for j in range(prefill)],
                                        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        engine.step()
        s, pre, decode, b, f = engine.stats.last
        if pre == prefill and decode == batch:
            seconds.append(s)
            nbytes, flops = b, f
        if request_id in engine.requests:
            engine.abort(request_id)
        engine.take_pending_outputs()
    _finish(engine)
    point = _point("mixed", batch, context, seconds, nbytes, flops, batch + prefill, peaks)
    point.prefill_tokens = prefill
    return point


def prefill_point(engine, length: int, repeats: int, peaks) -> Point:
    from ..engine import SamplingParams

    vocab = engine.model_config.vocab_size
    seconds, nbytes, flops = [], 0, 0
    for r in range(repeats):
        engine.add_request([(11 + 97 * r + 29 * j) % vocab for j in range(length)],
                           SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        engine.step()
        s, prefill, decode, b, f = engine.stats.last
        seconds.append(s)
        nbytes, flops = b, f
        _finish(engine)
    return _point("prefill", 1, length, seconds, nbytes, flops, length, peaks)


def _finish(engine) -> None:
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.take_pending_outputs()


def run_profile(args) -> dict:
    import torch  # here: `inferd` builds this command's parser for every command (the API process needs no torch)

    from ..config import EngineConfig
    from ..engine import Engine
    from ..telemetry.roofline import peaks as device_peaks

    contexts = [int(c) for c in args.contexts.split(",")]
    prefills = [int(p) for p in args.prefill.split(",")]
    longest = max(contexts + prefills) + args.steps + 8 + args.max_batch * max(contexts) // max(prefills + [64])
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, device=args.device,
                          kv_cache_bytes=args.kv_cache_bytes,
                          max_num_seqs=args.max_batch, max_num_batched_tokens=max(prefills + [args.max_batch * 2]),
                          max_model_len=longest, enable_prefix_caching=False, detokenize=False)
    engine = Engine.from_config(config)
    peaks = device_peaks(torch.device(args.device), engine.dtype, args.peak_bandwidth, args.peak_flops,
                         recalibrate=getattr(args, "recalibrate", False))
    points: list[Point] = []
    for context in contexts:
        batch = 1
        fits = engine.kv_cache.num_blocks // engine.kv_cache.blocks_needed(context + args.steps + 2)
        while batch <= min(args.max_batch, fits):
            points.append(decode_point(engine, batch, context, args.steps, peaks))
            _show(points[-1])
            batch *= 2
    for length in prefills:
        points.append(prefill_point(engine, length, max(2, args.steps // 2), peaks))
        _show(points[-1])
    mixed = [int(b) for b in args.mixed_batches.split(",") if b.strip()] if args.mixed_batches else []
    for batch in mixed:
        if batch > min(args.max_batch, engine.kv_cache.num_blocks // engine.kv_cache.blocks_needed(
                contexts[0] + args.steps + 16)):
            continue
        for length in (int(p) for p in args.mixed_prefill.split(",")):
            if batch + length <= engine.config.max_num_batched_tokens:
                points.append(mixed_point(engine, batch, contexts[0], length, max(3, args.steps // 2), peaks))
                _show(points[-1])
    engine.close()
    return {"model": os.path.basename(args.model or "SmolLM2-135M-Instruct"), "dtype": str(engine.dtype),
            "kv_dtype": str(engine.kv_dtype),
            "device": args.device, "threads": torch.get_num_threads(), "weight_bytes": engine.cost.weight_bytes,
            "peaks": {"bandwidth": peaks.bandwidth, "flops": peaks.flops, "ridge": peaks.ridge,
                      "source": peaks.source}, "points": [asdict(p) for p in points]}


def _show(p: Point) -> None:
    extra = f" + {p.prefill_tokens} prompt tokens" if p.kind == "mixed" else ""
    print(f"  {p.kind:7s} batch {p.batch:3d} context {p.context:5d}{extra}: {p.step_s * 1000:8.2f} ms/step "
          f"{p.tokens_per_s:9.1f} tok/s  MBU {p.mbu:6.1%}  MFU {p.mfu:6.1%}  {p.bound}", flush=True)


def answer(result: dict) -> str:
    """The question a user asks: from which decode batch size on is a step compute-bound, and where does MFU pass
    half of its best?"""
    lines = []
    decode = [p for p in result["points"] if p["kind"] == "decode"]
    for context in sorted({p["context"] for p in decode}):
        rows = [p for p in decode if p["context"] == context]
        compute = next((p["batch"] for p in rows if p["bound"] == "compute"), None)
        best = max(p["mfu"] for p in rows)
        half = next(p["batch"] for p in rows if p["mfu"] >= best / 2)
        where = f"from batch {compute}" if compute else f"never up to batch {rows[-1]['batch']}"
        lines.append(f"context {context}: compute-bound {where}; MFU passes half its best ({best:.1%}) at batch "
                     f"{half}; batch-1 MBU {rows[0]['mbu']:.1%}")
    over = [p for p in result["points"] if max(p["mbu"], p["mfu"]) > 1.0]
    if over:  # no step beats the device's peak: these are too low (a calibration on a busy machine, another CPU)
        lines.append(f"WARNING: {len(over)} points above 100% MBU or MFU: the peaks "
                     f"({result['peaks']['source']}) are too low; run again with --recalibrate on a quiet machine, "
                     "or give --peak-bandwidth/--peak-flops")
    return "\n".join(lines)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    pk = result["peaks"]
    kv = result.get("kv_dtype", result["dtype"])
    dtypes = result["dtype"] if kv == result["dtype"] else f"{result['dtype']} (KV {kv})"
    table = Table(title=f"{result['model']} {dtypes} on {result['device']} ({result['threads']} threads): "
                        f"peaks {pk['bandwidth'] / 1e9:.1f} GB/s, {pk['flops'] / 1e9:.1f} GFLOP/s ({pk['source']}), "
                        f"ridge {pk['ridge']:.1f} FLOP/byte")
    for name in ("kind", "batch", "context", "ms/step", "tok/s", "MB/step", "GFLOP/step", "FLOP/byte", "MBU", "MFU",
                 "bound"):
        table.add_column(name, justify="right")
    for p in result["points"]:
        table.add_row(p["kind"], str(p["batch"]), str(p["context"]), f"{p['step_s'] * 1000:.2f}",
                      f"{p['tokens_per_s']:.1f}", f"{p['bytes'] / 1e6:.1f}", f"{p['flops'] / 1e9:.2f}",
                      f"{p['intensity']:.1f}", f"{p['mbu']:.1%}", f"{p['mfu']:.1%}", p["bound"])
    Console(width=150).print(table)
    print(answer(result))


def plot_roofline(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pk = result["peaks"]
    points = result["points"]
    lo = min(p["intensity"] for p in points) / 2
    hi = max(max(p["intensity"] for p in points) * 2, pk["ridge"] * 4)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(xs, [min(pk["flops"], x * pk["bandwidth"]) / 1e9 for x in xs], color="black", label="roofline")
    ax.axvline(pk["ridge"], color="gray", linestyle=":", label=f"ridge {pk['ridge']:.1f} FLOP/byte")
    markers = {"decode": "o", "prefill": "s"}
    for kind in ("decode", "prefill"):
        for context in sorted({p["context"] for p in points if p["kind"] == kind}):
            rows = [p for p in points if p["kind"] == kind and p["context"] == context]
            if kind == "prefill":
                rows = [p for p in points if p["kind"] == "prefill"]
            label = f"decode, context {context}" if kind == "decode" else "prefill"
            ax.plot([p["intensity"] for p in rows], [p["flops"] / p["step_s"] / 1e9 for p in rows],
                    marker=markers[kind], linestyle="-", label=label)
            for p in rows:
                ax.annotate(str(p["batch"] if kind == "decode" else p["context"]),
                            (p["intensity"], p["flops"] / p["step_s"] / 1e9), textcoords="offset points",
                            xytext=(4, 4), fontsize=7)
            if kind == "prefill":
                break
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte read)")
    ax.set_ylabel("GFLOP/s achieved")
    ax.set_title(f"{result['model']} {result['dtype']} on {result['device']}: decode batch sizes and prefill lengths")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_profile(args) -> int:
    started = time.perf_counter()
    result = run_profile(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    try:
        plot_roofline(result, os.path.join(args.out, "roofline.png"))
        print(f"wrote {args.out}/roofline.png and {args.out}/profile.json ({time.perf_counter() - started:.0f} s)")
    except ImportError:
        print(f"wrote {args.out}/profile.json; no plot: matplotlib is not installed")
    return 0

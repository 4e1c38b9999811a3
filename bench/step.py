"""The model step side by side: the torch references (the step before issue 14), the fused CPU kernels, and the fused
kernels over int4 weights (`--quantize int4`), measured in one run, alternating, on the default model. The variants
"layers" and "layers+int4" are the fused ops called layer by layer from Python, without decode_layers (the whole
decoder stack of a decode step in one C++ call), for its side-by-side measurement.

    .venv/bin/python bench/step.py [--dtype bfloat16] [--context 128] [--batches 1,64] [--prefill 512]
                                   [--steps 12] [--repeats 3] [--json docs/step.json]

Per point: the median step time over `repeats` alternating rounds (each the median of `steps` steps), tok/s, MBU
(weight + KV bytes the step reads, as `inferd profile` counts them, int4 weights counted as their 4-bit codes and
scales) and MFU against the calibrated peaks (inferd/telemetry/roofline.py), and each variant's ratio to the
references. Reads ratios: the machine is shared."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferd import kernels  # noqa: E402
from inferd.bench.profile import decode_point, prefill_point  # noqa: E402
from inferd.config import EngineConfig  # noqa: E402
from inferd.engine import Engine  # noqa: E402
from inferd.models.build import load_model  # noqa: E402
from inferd.models.loader import default_model_path  # noqa: E402
from inferd.models.quantize import quantize_model  # noqa: E402
from inferd.telemetry.roofline import peaks as device_peaks  # noqa: E402


def make_engine(model, cfg, tok, dtype, args, kernel_mode: str) -> Engine:
    longest = args.context + args.steps * args.repeats + 64 + max(args.batches) * args.context // args.prefill
    config = EngineConfig(dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(args.batches),
                          max_num_batched_tokens=max(args.prefill, 2 * max(args.batches)),
                          max_model_len=max(longest, args.prefill + 16), enable_prefix_caching=False,
                          detokenize=False, kernels=kernel_mode)
    return Engine(model, cfg, config, dtype, tok)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="reference,fused,fused+int4",
                   help="of reference, layers, fused, layers+int4, fused+int4")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    path = default_model_path()
    model, cfg, tok = load_model(path, dtype=dtype)
    variants = args.variants.split(",")
    engines = {}
    m4 = None
    for v in variants:
        if v.endswith("+int4"):
            if m4 is None:
                m4, _, _ = load_model(path, dtype=dtype)
                quantize_model(m4, "int4")
            engines[v] = make_engine(m4, cfg, tok, dtype, args, "fused")
        else:
            engines[v] = make_engine(model, cfg, tok, dtype, args, "reference" if v == "reference" else "fused")

    def ops_for(v: str, kv_dtype: torch.dtype):
        """The variant's ops: "layers" are the fused ops called layer by layer from Python (no decode_layers)."""
        ops = kernels.select("cpu", dtype, kv_dtype, "reference" if v == "reference" else "fused")
        if v.startswith("layers"):
            ops = types.SimpleNamespace(**vars(ops))
            ops.decode_layers = None
        return ops

    peaks = device_peaks(torch.device("cpu"), dtype)
    points = [("decode", b) for b in args.batches] + [("prefill", args.prefill)]
    results: dict[str, dict[str, list]] = {v: {f"{k} {n}": [] for k, n in points} for v in variants}
    for r in range(args.repeats):
        for v in variants:
            e = engines[v]
            # engines share a model: its ops are set to the variant's own before each of its points
            e.runner.model.ops = ops_for(v, e.kv_dtype)
            for kind, n in points:
                pt = decode_point(e, n, args.context, args.steps, peaks) if kind == "decode" else \
                    prefill_point(e, n, max(2, args.steps // 4), peaks)
                results[v][f"{kind} {n}"].append(pt)
                print(f"round {r + 1} {v:11s} {kind} {n}: {pt.step_s * 1000:.2f} ms", flush=True)
    table = {}
    print(f"\nSmolLM2-135M {args.dtype}, {torch.get_num_threads()} threads, peaks {peaks.bandwidth / 1e9:.1f} GB/s "
          f"{peaks.flops / 1e9:.0f} GFLOP/s; context {args.context}; medians of {args.repeats} rounds")
    print(f"{'point':14s} " + " ".join(f"{v:>34s}" for v in variants))
    for kind, n in points:
        key = f"{kind} {n}"
        base = statistics.median(p.step_s for p in results[variants[0]][key])
        cells = []
        for v in variants:
            pts = sorted(results[v][key], key=lambda p: p.step_s)
            mid = pts[len(pts) // 2]
            table.setdefault(key, {})[v] = {"ms": mid.step_s * 1000, "tok_s": mid.tokens_per_s, "mbu": mid.mbu,
                                            "mfu": mid.mfu, "vs_first": base / mid.step_s}
            cells.append(f"{mid.step_s * 1000:7.2f} ms {mid.tokens_per_s:7.0f} t/s MBU {mid.mbu:4.0%} "
                         f"x{base / mid.step_s:4.2f}")
        print(f"{key:14s} " + " ".join(f"{c:>34s}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "context": args.context,
                                               "threads": torch.get_num_threads(),
                                               "peaks": {"bandwidth": peaks.bandwidth, "flops": peaks.flops},
                                               "points": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

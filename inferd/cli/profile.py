"""`inferd profile`'s flags: the model and device to profile, the sweeps, the device's peaks. The profile itself:
inferd/bench/profile.py."""

from __future__ import annotations

import argparse

from ..config import KV_DTYPES
from .types import parse_bytes


def register(sub) -> None:
    pr = sub.add_parser("profile", help="roofline profile of the model on this device: decode batch x context and "
                        "prefill sweeps, MBU/MFU, memory- or compute-bound, a roofline PNG")
    add_profile_arguments(pr)
    pr.set_defaults(func=cmd_profile)


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.profile import DEFAULT_CONTEXTS, DEFAULT_MIXED_BATCHES, DEFAULT_MIXED_PREFILL, DEFAULT_PREFILL

    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="the KV cache's storage dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=1 << 30)
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)), help="decode context lengths")
    p.add_argument("--max-batch", type=int, default=64, help="largest decode batch (powers of 2 up to it)")
    p.add_argument("--prefill", default=",".join(map(str, DEFAULT_PREFILL)), help="prefill lengths")
    p.add_argument("--mixed-batches", default=",".join(map(str, DEFAULT_MIXED_BATCHES)),
                   help="decode batches of the mixed steps (a batch decoding beside one prompt chunk); '' for none")
    p.add_argument("--mixed-prefill", default=",".join(map(str, DEFAULT_MIXED_PREFILL)),
                   help="prompt chunk lengths of the mixed steps")
    p.add_argument("--steps", type=int, default=8, help="timed steps per point (the median is reported)")
    p.add_argument("--peak-bandwidth", type=float, default=None, help="bytes/s (default: calibrated, cached)")
    p.add_argument("--peak-flops", type=float, default=None, help="FLOP/s (default: calibrated, cached)")
    p.add_argument("--out", default="profile", help="folder for profile.json and roofline.png")
    p.add_argument("--recalibrate", action="store_true", help="measure the device's peaks again (and cache them, "
                   "unless other processes took over a quarter of the CPU meanwhile)")


def cmd_profile(args: argparse.Namespace) -> int:
    from ..bench.profile import cmd_profile as run

    return run(args)

"""torch.compile of the model step, measured beside the eager step (issue 14's "measure again at batch 1"): the
default model's forward (30 layers over the fused ops, plus the head) at one decode step of `--batch` rows,
eager against Inductor variants, in one run, alternating. The fused ops are opaque to Inductor (custom ops with
fake kernels, inferd/kernels/fake.py): what Inductor can add is the glue around them and a C++ wrapper instead of
Python dispatch.

    .venv/bin/python bench/compile_step.py [--batch 1] [--context 128] [--quantize int4] [--iters 50] [--repeats 3]

Variants: eager; compiled (default Inductor); compiled with freezing and the C++ wrapper. Per variant: compile
seconds (first call), the median forward time, ratio to eager, and how many recompiles a second step shape
caused after warm-up (dynamo's counters). Prints a table and JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferd import kernels  # noqa: E402
from inferd.config import EngineConfig  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.kernels import fake  # noqa: E402
from inferd.models.build import load_model  # noqa: E402
from inferd.models.layers import Linear  # noqa: E402
from inferd.models.loader import default_model_path  # noqa: E402
from inferd.models.quantize import quantize_model  # noqa: E402


def capture_step(engine: Engine):
    """(input_ids, positions, meta) of the engine's next step, which still runs."""
    runner = engine.runner
    seen = {}
    original = runner.prepare

    def prepare(rows):
        out = original(rows)
        seen["args"] = out
        return out

    runner.prepare = prepare
    engine.step()
    runner.prepare = original
    input_ids, positions, meta, _ = seen["args"]
    return input_ids, positions, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--quantize", default=None, choices=[None, "int4", "int8"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-write", default="eager", choices=["eager", "traced"],
                   help="the RoPE + KV write op outside the compiled graphs (a graph break per layer) or traced")
    p.add_argument("--variants", default="eager,inductor,inductor+freezing+cpp_wrapper")
    args = p.parse_args()

    dtype = torch.bfloat16
    model, cfg, tok = load_model(default_model_path(), dtype=dtype)
    if args.quantize:
        quantize_model(model, args.quantize)
    config = EngineConfig(dtype="bfloat16", max_num_seqs=max(args.batch, 2), max_model_len=args.context + 512,
                          enable_prefix_caching=False, detokenize=False, kernels="fused")
    engine = Engine(model, cfg, config, dtype, tok)
    assert kernels.fused_cpu() is not None and fake.register()
    for i in range(args.batch):
        engine.add_request([(7 + 131 * i + 17 * j) % cfg.vocab_size for j in range(args.context - 1)],
                           SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    while any(r.num_computed_tokens < len(r.token_ids) - 1 for r in engine.requests.values()):
        engine.step()
    input_ids, positions, meta = capture_step(engine)
    assert meta.num_decode_tokens == args.batch and not meta.prefills, "not a pure decode step"
    kv = engine.runner.kv_caches
    model = engine.runner.model

    # Inductor cannot lower calls on oneDNN's packed weights (an opaque layout): the compiled variants run a second
    # copy of the model with plain weights (freezing packs them again, its own way)
    plain, _, _ = load_model(default_model_path(), dtype=dtype)
    for m in plain.modules():
        if type(m) is Linear and m.packed is not None:
            m.weight = torch.nn.Parameter(m.packed.to_dense(), requires_grad=False)
            m.packed = None
    if args.quantize:
        quantize_model(plain, args.quantize)
    import types
    plain.ops = types.SimpleNamespace(**vars(model.ops))
    if args.kv_write == "eager":
        # the KV write mutates the whole cache: traced, functionalization copies each layer's cache every call
        plain.ops.rope_kv_write = torch.compiler.disable(model.ops.rope_kv_write)

    def step(forward, owner=model):
        return owner.compute_logits(forward(input_ids, positions, meta, kv))

    import torch._dynamo as dynamo
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    forwards, compile_s, recompiles = {}, {}, {}
    with torch.inference_mode():
        reference = step(model.forward)
        for name in args.variants.split(","):
            if name == "eager":
                forwards[name] = model.forward
                continue
            dynamo.reset()
            inductor_config.freezing = "freezing" in name
            inductor_config.cpp_wrapper = "cpp_wrapper" in name
            compiled = torch.compile(plain.forward, dynamic=False)
            t = time.perf_counter()
            out = step(compiled, plain)
            compile_s[name] = time.perf_counter() - t
            before = counters["stats"]["unique_graphs"]
            step(compiled, plain)  # the same shape again: no recompile expected
            recompiles[name] = counters["stats"]["unique_graphs"] - before
            diff = (out - reference).abs().max().item()
            print(f"{name}: compiled in {compile_s[name]:.1f} s; max |logit diff| vs eager {diff:.3g}", flush=True)
            forwards[name] = compiled
        owners = {name: model if name == "eager" else plain for name in forwards}
        times = {name: [] for name in forwards}
        for _ in range(args.repeats):
            for name, f in forwards.items():
                for _ in range(5):
                    step(f, owners[name])
                ts = []
                for _ in range(args.iters):
                    t = time.perf_counter()
                    step(f, owners[name])
                    ts.append(time.perf_counter() - t)
                times[name].append(statistics.median(ts))
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    base = med.get("eager")
    print(f"\nbatch {args.batch}, context {args.context}, bf16{', ' + args.quantize if args.quantize else ''}: "
          f"model forward + head, median of {args.repeats} rounds x {args.iters} calls")
    print("| variant | ms | vs eager | compile s | graphs added by a repeat call |")
    print("|---|---:|---:|---:|---:|")
    for name, ms in med.items():
        ratio = f"{base / ms:.2f}x" if base else "-"
        print(f"| {name} | {ms:.2f} | {ratio} | {compile_s.get(name, 0):.0f} | {recompiles.get(name, '-')} |")
    print(json.dumps({"batch": args.batch, "context": args.context, "quantize": args.quantize, "ms": med,
                      "compile_s": compile_s, "recompiles": recompiles}))


if __name__ == "__main__":
    main()

"""Weight-only int8 (`--quantize int8`) against bf16 and fp32 on the default model, side by side in one run.

On SmolLM2-135M-Instruct (dequantized from its Q4_1 GGUF) built three times (fp32, bf16, bf16 with int8 weights):
  - weight bytes (what one decode step reads, and the whole model as stored),
  - decode step time and tokens/s at each batch size: Engine.step() with every sequence decoding, contexts from
    --context tokens on; each cell is the median over --rounds of the mean of --steps steps, after --warmup untimed
    steps. By default one configuration is built and measured at a time (its batch sizes taking turns) and freed
    before the next, as a server process holds one model; --interleave keeps all three alive and takes turns,
  - prefill: one teacher-forced forward over the fixed text below (through the engine's runner and KV cache),
  - quality: the next-token distributions at every position of that text (English prose and Python code, the same
    input tokens for all three): mean KL divergence and top-1 agreement of int8 against bf16 (and of each against
    fp32), and the text's perplexity under each.

    .venv/bin/python bench/quantization.py [--batches 1,16] [--context 128] [--steps 32] [--rounds 7] [--warmup 64]
                                        [--interleave]

Timings collapse when another process takes a core (2 threads of OpenMP then wait on each other; seen here: 80x
slower matmuls): the CPU share other processes take is printed before and during the measurements; run it on a quiet
machine. Even then, on the shared VM this was written on, step times drifted by up to 2x within one run with no
other process running (the host's memory bandwidth is shared): read the per-round times, and compare the ratios of
several runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.config import EngineConfig, cpu_has_native_bf16, resolve_kv_dtype  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.engine.runner import kv_bytes_per_block  # noqa: E402
from inferd.models.build import build_model  # noqa: E402
from inferd.models.loader import default_model_path, load_model_config, load_state_dict  # noqa: E402
from inferd.models.quantize import quantize_model, weight_bytes  # noqa: E402
from inferd.models.step_row import StepRow  # noqa: E402
from inferd.models.tokenizer import load_tokenizer  # noqa: E402
from inferd.telemetry.roofline import OtherLoad  # noqa: E402,F401  (bench/kv_dtype.py, prefix_cache.py import it here)

TEXT = """The history of the printing press begins in the middle of the fifteenth century, when Johannes Gutenberg \
combined a screw press, oil-based ink and movable metal type into a system that could produce books far faster than \
any scribe. Within fifty years, presses were running in more than two hundred European cities, and millions of \
volumes had been printed. The consequences reached well beyond the workshop: cheaper books spread literacy, \
standardized spelling, and allowed scientists to share precise diagrams and tables with colleagues they would never \
meet. Historians still argue about how quickly these changes happened, but few doubt that the press reshaped how \
knowledge was stored and exchanged.

Rivers shape the land they cross. A young river cuts a narrow valley with steep sides; as it ages, it meanders \
across a wide plain, depositing silt on the inside of each bend and eroding the outside, until a loop is cut off and \
left behind as an oxbow lake.

```python
import heapq


def dijkstra(graph: dict[str, list[tuple[str, float]]], source: str) -> dict[str, float]:
    \"\"\"Shortest distances from source to every reachable node (non-negative edge weights).\"\"\"
    dist = {source: 0.0}
    queue = [(0.0, source)]
    while queue:
        d, node = heapq.heappop(queue)
        if d > dist.get(node, float("inf")):
            continue
        for neighbor, weight in graph.get(node, []):
            candidate = d + weight
            if candidate < dist.get(neighbor, float("inf")):
                dist[neighbor] = candidate
                heapq.heappush(queue, (candidate, neighbor))
    return dist


if __name__ == "__main__":
    roads = {"a": [("b", 7), ("c", 9), ("f", 14)], "b": [("c", 10), ("d", 15)], "c": [("d", 11), ("f", 2)]}
    print(dijkstra(roads, "a"))
```
"""


def cpu_busy_fraction(seconds: float = 1.0) -> float | None:
    """Share of all CPUs busy over the next `seconds` (other processes: this one sleeps), from /proc/stat."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, total
    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def teacher_forced_logits(engine: Engine, ids: list[int], chunk: int | None = None) -> tuple[torch.Tensor, float]:
    """(float32 logits at every position of ids, seconds of the forwards) through the runner of an idle engine:
    one prefill, or chunk tokens per forward (a chunk of 1 is a decode, attending to its context as stored in the
    cache: bench/kv_dtype.py)."""
    blocks = list(range(-(-len(ids) // engine.config.block_size)))
    chunk = chunk or len(ids)
    out = []
    with torch.inference_mode():
        t = time.perf_counter()
        for s in range(0, len(ids), chunk):
            hidden, _ = engine.runner.forward([StepRow(ids[s:s + chunk], s, blocks, 1)])
            out.append(engine.runner.model.compute_logits(hidden))
        return torch.cat(out), time.perf_counter() - t


def compare(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || other) in nats, top-1 agreement) over positions."""
    ref, other = ref_logits.log_softmax(-1), logits.log_softmax(-1)
    kl = (ref.exp() * (ref - other)).sum(-1)
    return kl.mean().item(), (ref.argmax(-1) == other.argmax(-1)).float().mean().item()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = logits[:-1].log_softmax(-1)
    target = torch.tensor(ids[1:])
    return torch.exp(-logp[torch.arange(len(target)), target].mean()).item()


class DecodeRun:
    """An engine with `batch` sequences past their prompts: every step() is `batch` decodes (bench/kv_dtype.py too:
    kv_dtype is the cache's, `--kv-dtype`)."""

    def __init__(self, model, cfg, dtype, batch: int, context: int, max_steps: int, seed: int, kv_dtype: str = "auto"):
        need = batch * (context + max_steps + 32)
        per_block = kv_bytes_per_block(cfg, 16, resolve_kv_dtype(kv_dtype, dtype))
        kv_bytes = (need // 16 + 2 * batch + 8) * per_block
        self.engine = Engine(model, cfg, EngineConfig(kv_dtype=kv_dtype, kv_cache_bytes=kv_bytes, max_num_seqs=batch,
                                                      max_num_batched_tokens=512, max_model_len=2048,
                                                      enable_prefix_caching=False, detokenize=False), dtype)
        self.batch = batch
        g = torch.Generator().manual_seed(seed)
        params = SamplingParams(max_tokens=max_steps + 16, temperature=0, ignore_eos=True)
        for _ in range(batch):
            self.engine.add_request(torch.randint(1000, 40000, (context,), generator=g).tolist(), params)
        while True:  # prefill (in chunks of the token budget), then one step where all rows decode
            self.engine.step()
            sched = self.engine.last_schedule
            if sched.num_decodes == batch and sched.num_tokens == batch:
                break

    def mean_step_s(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        assert self.engine.last_schedule.num_decodes == self.batch
        return (time.perf_counter() - t) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16", help="decode batch sizes (comma-separated)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of every decoding sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--rounds", type=int, default=7, help="measurements per cell (batch sizes take turns)")
    ap.add_argument("--warmup", type=int, default=64, help="untimed decode steps of each run first")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 reference")
    ap.add_argument("--interleave", action="store_true",
                    help="keep all three models and their engines alive and measure them in turns (default: one "
                         "configuration at a time, as a server process holds one model)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not cpu_has_native_bf16():
        print("this CPU lacks native bf16 (AVX-512 BF16 / AMX): bf16 and int8 would be emulated; not run")
        return 1
    busy = cpu_busy_fraction()
    note = "unknown" if busy is None else f"{busy:.0%}" + ("  <- BUSY: timings unreliable" if busy > 0.1 else "")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; CPU time taken by "
          f"other processes before the start: {note}", flush=True)

    path = default_model_path()
    cfg = load_model_config(path)
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode(TEXT)
    state = load_state_dict(path, cfg, torch.float32)
    names = ([] if args.no_fp32 else ["fp32"]) + ["bf16", "int8"]
    dtypes = {name: torch.float32 if name == "fp32" else torch.bfloat16 for name in names}
    results: dict = {}
    times: dict = {}
    max_steps = args.steps * args.rounds + args.warmup + 8

    def build(name: str):
        model = build_model(cfg, state, dtypes[name])
        if name == "int8":
            quantize_model(model, "int8")
        engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=2048), dtypes[name])
        logits, _ = teacher_forced_logits(engine, ids)  # also the warm-up
        results[name] = {"step_bytes": model.weight_bytes(), "all_bytes": weight_bytes(model), "logits": logits,
                         "ppl": perplexity(logits, ids),
                         "prefill_s": min(teacher_forced_logits(engine, ids)[1] for _ in range(3))}
        return model

    def decode_rounds(runs: dict) -> None:
        for run in runs.values():
            run.mean_step_s(args.warmup)
        for key in runs:
            times[key] = []
        with OtherLoad() as load:
            for _ in range(args.rounds):
                for key, run in runs.items():
                    times[key].append(run.mean_step_s(args.steps))
        note = "?" if load.share is None else f"{load.share:.0%}" + ("  <- BUSY" if load.share > 0.05 else "")
        print(f"measured {', '.join(f'{n} batch {b}' for n, b in runs)}; CPU taken by others meanwhile: {note}",
              flush=True)

    print(f"quality text: {len(ids)} tokens; decode batches {batches} from context {args.context}; "
          f"{'all configurations interleaved' if args.interleave else 'one configuration at a time'}", flush=True)
    if args.interleave:
        models = {name: build(name) for name in names}
        decode_rounds({(name, b): DecodeRun(models[name], cfg, dtypes[name], b, args.context, max_steps, seed=b)
                       for name in names for b in batches})
    else:
        for name in names:
            model = build(name)
            decode_rounds({(name, b): DecodeRun(model, cfg, dtypes[name], b, args.context, max_steps, seed=b)
                           for b in batches})
            del model
            gc.collect()
    state.clear()  # the fp32 weights
    for (name, b), ts in times.items():
        results[name][f"step_{b}"] = statistics.median(ts)

    ref = results["bf16"]["logits"]
    fp32 = results.get("fp32", {}).get("logits")
    print()
    head = f"{'':5} {'weights/step':>12} {'whole model':>11}"
    for b in batches:
        head += f" | {f'batch {b}: ms/step':>17} {'tok/s':>7}"
    head += f" | {f'prefill {len(ids)}':>11} | {'ppl':>6} | {'KL vs bf16':>10} {'top-1':>6}"
    if fp32 is not None:
        head += f" | {'KL vs fp32':>10} {'top-1':>6}"
    print(head)
    print("-" * len(head))
    for name in names:
        res = results[name]
        line = f"{name:5} {res['step_bytes'] / 1e6:>9.1f} MB {res['all_bytes'] / 1e6:>8.1f} MB"
        for b in batches:
            s = res[f"step_{b}"]
            line += f" | {s * 1e3:>17.2f} {b / s:>7.1f}"
        line += f" | {res['prefill_s'] * 1e3:>8.1f} ms | {res['ppl']:>6.3f}"
        kl, top1 = compare(ref, res["logits"])
        line += f" | {kl:>10.5f} {top1:>6.3f}" if name != "bf16" else f" | {'-':>10} {'-':>6}"
        if fp32 is not None:
            kl, top1 = compare(fp32, res["logits"])
            line += f" | {kl:>10.5f} {top1:>6.3f}" if name != "fp32" else f" | {'-':>10} {'-':>6}"
        print(line)
    i8, bf = results["int8"], results["bf16"]
    print(f"\nint8 / bf16: weight bytes per step {i8['step_bytes'] / bf['step_bytes']:.3f}, whole model "
          f"{i8['all_bytes'] / bf['all_bytes']:.3f}; "
          + ", ".join(f"batch-{b} step time {i8[f'step_{b}'] / bf[f'step_{b}']:.2f}x" for b in batches)
          + f"; prefill time {i8['prefill_s'] / bf['prefill_s']:.2f}x")
    print("per-round step times (ms): " + "; ".join(
        f"{name} b{b}: " + " ".join(f"{t * 1e3:.1f}" for t in ts) for (name, b), ts in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

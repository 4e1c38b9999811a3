"""Tensor parallelism's cost: decode step time with one process (TP=1) and with two (TP=2), side by side in one run,
and the time rank 0 spends in torch.distributed.all_reduce (two per layer) during a TP=2 step.

The model has random weights in a given shape, saved once as a HF folder (safetensors, SmolLM2's tokenizer):
  smollm2  SmolLM2-135M's shape (hidden 576, 30 layers, MLP 1536, vocab 49,152, tied) except its heads: SmolLM2 has
           9 query heads of 64 and 3 KV heads, which 2 does not divide; here 6 query heads of 96 and 2 KV heads:
           the same q/k/v widths (576/192/192), the same 3 query heads per KV head.
  1b       TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632), SmolLM2's vocab.
Both runs get the same cores: TP=1 one process with all torch threads, TP=2 two processes with half each.
For scale, the latency of a bare all-reduce of one step's [batch, hidden] activations between two processes (no
model, 300 in a row) is measured too.

    .venv/bin/python bench/tp_comm.py [--shape smollm2|1b] [--dtype auto] [--batch 1,16] [--context 128] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.config import EngineConfig, resolve_dtype  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.models.config import ModelConfig  # noqa: E402
from inferd.models.loader import default_model_path, expected_weight_shapes  # noqa: E402

SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=96, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, head_dim=64, tie_word_embeddings=False),
}


def save_random_model(shape: str, folder: str) -> None:
    """config.json + model.safetensors with random weights, and SmolLM2's tokenizer (from its GGUF, cached)."""
    from safetensors.torch import save_file

    from inferd.models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    hf = dict(model_type="llama", vocab_size=len(tok.hf), max_position_embeddings=2048, rms_norm_eps=1e-5,
              rope_theta=10000.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_ids[0], **SHAPES[shape])
    cfg = ModelConfig.from_hf_dict(hf)
    g = torch.Generator().manual_seed(0)
    state = {name: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
             for name, s in expected_weight_shapes(cfg).items()}
    save_file(state, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    tok.hf.save_pretrained(folder)


class AllReduceTimer:
    """Wraps torch.distributed.all_reduce in this process (rank 0): calls and seconds."""

    def __init__(self):
        self.calls, self.seconds = 0, 0.0
        self._real = dist.all_reduce

    def __enter__(self):
        def timed(*args, **kw):
            t = time.perf_counter()
            out = self._real(*args, **kw)
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return out

        dist.all_reduce = timed
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def bare_all_reduce(rank: int, port: int, hidden: int, batches: list[int], dtype: torch.dtype,
                    n: int = 300) -> dict[int, float]:
    """Median seconds of one all-reduce of [batch, hidden] between this process and a peer (rank 1: this script
    with --peer PORT), one torch thread each, as in a TP=2 engine on 2 cores."""
    from inferd.engine.tensor_parallel import new_process_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    peer = None
    if rank == 0:
        peer = subprocess.Popen([sys.executable, __file__, "--peer", str(store.port), "--batch",
                                 ",".join(map(str, batches)), "--dtype", str(dtype).removeprefix("torch."),
                                 "--hidden", str(hidden)])
    group = new_process_group(store, rank, 2, torch.device("cpu"))
    out = {}
    for b in batches:
        x = torch.randn(b, hidden).to(dtype)
        times = []
        for i in range(n + 30):
            t = time.perf_counter()
            dist.all_reduce(x, group=group)
            if i >= 30:
                times.append(time.perf_counter() - t)
        out[b] = statistics.median(times)
    if peer is not None:
        peer.wait()
    return out


def decode_steps(engine: Engine, batch: int, context: int, steps: int, warmup: int) -> tuple[list[float], list]:
    """Seconds of each of `steps` decode steps (after `warmup`) at `batch` sequences of ~context tokens; with the
    all-reduce (calls, seconds) of each step."""
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(1000, 40000, (context,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=warmup + steps + 64, temperature=0, ignore_eos=True))
    while True:  # prefill (not measured)
        engine.step()
        if engine.last_schedule.num_decodes == batch:
            break
    for _ in range(warmup):
        engine.step()
    times, comm = [], []
    with AllReduceTimer() as timer:
        for _ in range(steps):
            c0, s0 = timer.calls, timer.seconds
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
            comm.append((timer.calls - c0, timer.seconds - s0))
            assert engine.last_schedule.num_decodes == batch
    while engine.has_unfinished_requests():
        engine.step()
    return times, comm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,16", help="decode batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=30, help="measured decode steps per batch size")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)  # rank 1 of the bare all-reduce
    ap.add_argument("--hidden", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    dtype = resolve_dtype(args.dtype)
    hidden = SHAPES[args.shape]["hidden_size"]
    if args.peer is not None:
        bare_all_reduce(1, args.peer, args.hidden, batches, dtype)
        return 0
    cores = torch.get_num_threads()
    print(f"shape {args.shape} {SHAPES[args.shape]}, dtype {str(dtype).removeprefix('torch.')}, context "
          f"{args.context}, {args.steps} steps (median), {cores} torch threads in all")
    results = {}
    with tempfile.TemporaryDirectory(prefix="inferd-tp-bench-") as folder:
        t = time.perf_counter()
        save_random_model(args.shape, folder)
        print(f"random weights saved in {time.perf_counter() - t:.1f} s")
        for tp in (1, 2):
            config = EngineConfig(model=folder, dtype=args.dtype, kv_cache_bytes=256 << 20, max_num_seqs=max(batches),
                                  max_num_batched_tokens=max(512, args.context), tensor_parallel=tp,
                                  detokenize=False)
            t = time.perf_counter()
            engine = Engine.from_config(config)
            print(f"TP={tp}: engine started in {time.perf_counter() - t:.1f} s "
                  f"({torch.get_num_threads()} torch threads per process)")
            try:
                for b in batches:
                    results[tp, b] = decode_steps(engine, b, args.context, args.steps, args.warmup)
            finally:
                engine.close()
    bare = bare_all_reduce(0, 0, hidden, batches, dtype)

    layers = SHAPES[args.shape]["num_hidden_layers"]
    print()
    print("| batch | TP=1 ms/step | TP=2 ms/step | TP=2 / TP=1 | TP=2 all-reduce ms/step (calls) | all-reduce share "
          "| TP=2 less all-reduce | us per all-reduce in a step | us per bare all-reduce |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in batches:
        one = statistics.median(results[1, b][0]) * 1e3
        two_times, comm = results[2, b]
        two = statistics.median(two_times) * 1e3
        calls = statistics.median(c for c, _ in comm)
        assert calls == 2 * layers, (calls, layers)
        ar = statistics.median(s for _, s in comm) * 1e3
        print(f"| {b} | {one:.1f} | {two:.1f} | {two / one:.2f}x | {ar:.1f} ({calls:.0f}) | {ar / two:.0%} "
              f"| {two - ar:.1f} | {ar / calls * 1e3:.0f} | {bare[b] * 1e6:.0f} |")
    print("\nall-reduce time is measured on rank 0: it includes waiting for rank 1 to reach the same point; a bare "
          f"all-reduce is one of [batch, {hidden}] {str(dtype).removeprefix('torch.')} between two processes, no model")
    return 0


if __name__ == "__main__":
    sys.exit(main())

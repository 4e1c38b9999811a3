"""LoRA adapters' cost, side by side in one run, on the default model (SmolLM2-135M):

    .venv/bin/python bench/lora.py [--dtype bfloat16] [--only step|served] [--rank 16] [--adapters 8]

- step: one decode step at batch 32, its rows spread over 8 adapters of rank 16 on every projection
  (q/k/v/o/gate/up/down), against the same batch on the base model alone (the same engine, requests without an
  adapter); and the same with adapters on q and v only (PEFT's default targets). Median of --steps steps, each batch
  at the same context lengths. Target (issue 30): at most 1.3x on a CPU.
- served: output tokens/s of 32 streams (4 per adapter, greedy, --max-tokens each) with the 8 adapters in one
  engine, against one merged model per adapter in the same memory: the memory of one model holds one merged model,
  so each adapter's 4 streams run on their own merged model, one model after the other; the time of building each
  merged model (W + scale B A, then the engine's own packing) is counted, as a server swapping models would pay it.

Random adapters (std 0.02) written in PEFT's format into a temporary folder. Engines in-process (no HTTP)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from inferd.config import EngineConfig  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.models.loader import default_model_path, load_model_config  # noqa: E402
from inferd.models.lora_format import read_adapter  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, cfg, rank: int, seed: int, modules=ALL) -> Path:
    import json

    from safetensors.torch import save_file

    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for m in modules:
            out, inp = shapes[m]
            group = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{m}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.02
            tensors[prefix + ".lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(modules)}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def refs(folders: list[Path], cfg, rank: int) -> list[list[str]]:
    out = []
    for i, f in enumerate(folders):
        spec = read_adapter(str(f), cfg, rank, 1 << 31)
        out.append([f"adapter-{i}", spec.path, spec.digest])
    return out


def engine(dtype: str, rank: int, adapters: int, **kw) -> Engine:
    return Engine.from_config(EngineConfig(dtype=dtype, kv_cache_bytes=512 << 20, max_num_seqs=64,
                                           max_num_batched_tokens=2048, enable_lora=True, max_loras=adapters,
                                           max_lora_rank=rank, **kw))


def decode_step_ms(e: Engine, loras: list, batch: int, steps: int, prompt_len: int = 64) -> float:
    """Median decode step (ms) of `batch` sequences, row i with adapter loras[i % len] (None: the base)."""
    g = torch.Generator().manual_seed(3)
    for i in range(batch):
        prompt = torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
        e.add_request(prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True,
                                             lora=loras[i % len(loras)]))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in e.requests.values()):
        e.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t)
        assert e.last_schedule.num_decodes == batch
    for rid in list(e.requests):
        e.abort(rid)
    e.step()
    return statistics.median(times) * 1e3


def bench_step(args, cfg, folders_all, folders_qv) -> None:
    print(f"decode step, batch {args.batch}, {args.adapters} adapters of rank {args.rank}, {args.dtype} "
          f"(median of {args.steps} steps)")
    plain = Engine.from_config(EngineConfig(dtype=args.dtype, kv_cache_bytes=512 << 20, max_num_seqs=64,
                                            max_num_batched_tokens=2048))
    off = min(decode_step_ms(plain, [None], args.batch, args.steps) for _ in range(2))
    del plain
    on = engine(args.dtype, args.rank, args.adapters)
    base_on = min(decode_step_ms(on, [None], args.batch, args.steps) for _ in range(2))
    del on
    print(f"  the base alone: --enable-lora off {off:7.2f} ms | on {base_on:7.2f} ms | ratio {base_on / off:.2f}x")
    for label, folders in (("all 7 projections", folders_all), ("q and v only", folders_qv)):
        e = engine(args.dtype, args.rank, args.adapters)
        loras = refs(folders, cfg, args.rank)
        decode_step_ms(e, loras, args.batch, 3)  # warm-up: loads every adapter into its slot
        base = decode_step_ms(e, [None], args.batch, args.steps)
        mixed = decode_step_ms(e, loras, args.batch, args.steps)
        base2 = decode_step_ms(e, [None], args.batch, args.steps)
        b = min(base, base2)
        print(f"  {label:<18}: base {b:7.2f} ms | {args.adapters} adapters {mixed:7.2f} ms | ratio {mixed / b:.2f}x "
              f"(kernel: {e.runner.model.ops.name}, lora_add: {getattr(e.lora.state.add, '__module__', '?')})")


def bench_served(args, cfg, folders) -> None:
    from inferd.models.build import build_model
    from inferd.models.loader import load_state_dict
    from inferd.models.tokenizer import load_tokenizer

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (32,), generator=g).tolist() for _ in range(4 * args.adapters)]
    loras = refs(folders, cfg, args.rank)

    def params(lora):
        return SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, lora=lora)

    e = engine(args.dtype, args.rank, args.adapters)
    e.generate(prompts[:2], params(loras[0]))  # warm-up
    t = time.perf_counter()
    outs = e.generate(prompts, [params(loras[i % args.adapters]) for i in range(len(prompts))])
    lora_s = time.perf_counter() - t
    tokens = sum(len(r.output_token_ids) for r in outs)
    print(f"served: {len(prompts)} streams x {args.max_tokens} tokens over {args.adapters} adapters, {args.dtype}")
    print(f"  LoRA, one engine:          {tokens / lora_s:8.1f} tok/s ({lora_s:.2f} s)")
    del e

    from safetensors.torch import load_file

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    path = default_model_path()
    state = load_state_dict(path, cfg, torch.float32)
    tokenizer = load_tokenizer(path)
    swap_s = serve_s = 0.0
    merged_tokens = 0
    for i, folder in enumerate(folders):
        t = time.perf_counter()
        merged = dict(state)
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        for key, a in tensors.items():
            if ".lora_A." in key:
                name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
                merged[name] = merged[name] + 2.0 * (tensors[key.replace(".lora_A.", ".lora_B.")] @ a)
        model = build_model(cfg, merged, dtype)
        m = Engine(model, cfg, EngineConfig(dtype=args.dtype, kv_cache_bytes=512 << 20, max_num_seqs=64,
                                            max_num_batched_tokens=2048), dtype, tokenizer)
        swap_s += time.perf_counter() - t
        t = time.perf_counter()
        mine = [prompts[j] for j in range(len(prompts)) if j % args.adapters == i]
        outs = m.generate(mine, params(None))
        serve_s += time.perf_counter() - t
        merged_tokens += sum(len(r.output_token_ids) for r in outs)
        del m, model, merged
    total = swap_s + serve_s
    print(f"  merged, one model at a time: {merged_tokens / total:8.1f} tok/s ({total:.2f} s: {swap_s:.2f} s building "
          f"models, {serve_s:.2f} s serving; serving alone {merged_tokens / serve_s:.1f} tok/s)")
    print(f"  LoRA / merged: {(tokens / lora_s) / (merged_tokens / total):.2f}x (serving alone: "
          f"{(tokens / lora_s) / (merged_tokens / serve_s):.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--only", choices=["step", "served"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    cfg = load_model_config(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        folders_all = [write_adapter(Path(tmp) / f"all{i}", cfg, args.rank, i) for i in range(args.adapters)]
        folders_qv = [write_adapter(Path(tmp) / f"qv{i}", cfg, args.rank, 100 + i, ("q_proj", "v_proj"))
                      for i in range(args.adapters)]
        if args.only in (None, "step"):
            bench_step(args, cfg, folders_all, folders_qv)
        if args.only in (None, "served"):
            bench_served(args, cfg, folders_all)


if __name__ == "__main__":
    main()

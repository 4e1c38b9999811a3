"""The GPU check of issues 6 and 15, in one short run (bench/gpu_check.sh calls this): on one CUDA device, in bf16,

  0. the device's peaks, calibrated (inferd/telemetry/roofline.py: a 2 GiB copy, an 8192^3 matmul);
  1. transformers' `generate` on the model's weights (greedy, never stopping early; batch sizes 1 and 64 by default);
  2. inferd on the same weights and requests, three engines: the default kernels (Triton attention on CUDA) with CUDA
     graphs, the same eagerly, and the torch attention references with graphs: output tokens/s, the median decode
     step and its MBU against the calibrated bandwidth, the ratios; the graphs' capture time and memory; greedy
     parity of graphs against eager and of the kernels against the torch references (the exactness rule of
     tests/parity.py: a divergence only at a near-tie);
  3. `inferd profile` (inferd/bench/profile.py) on a short ladder of decode batches and prefill lengths: MBU, MFU and
     the bound of each step, the roofline plot when matplotlib is there;

on random weights in three shapes, SmolLM2-135M's, a 1B-class Llama's (Llama-3.2-1B's) and an 8B one's
(Llama-3-8B's), built with transformers,
saved with save_pretrained to a temporary folder and loaded by inferd's own loader: no checkpoint has to travel to
the GPU machine (whose image has torch and transformers, but no gguf, pydantic or FastAPI: only inferd.engine,
inferd.models and inferd.bench.profile's engine side are imported). Results go to --out: gpu_check.json, rewritten
after every stage (`"complete": false` until the end, so a run cut short keeps what it measured), summary.txt, and
PNG plots when matplotlib is installed.

--dry-run runs the same code on the CPU with tiny shapes in seconds (fp32; CUDA graphs are never captured there: the
flag is ignored off CUDA), so that the script itself is tested (tests/bench/test_gpu_check.py).

    PYTHONPATH=. python bench/gpu_check.py [--dry-run] [--out DIR] [--batches 1,64] [--prompt-tokens 128]
                                           [--new-tokens 128] [--models smollm2-135m,llama-1b] [--no-profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(1, os.path.join(REPO, "tests"))  # parity.py: the exactness rule

from inferd.config import EngineConfig  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402

# transformers LlamaConfig fields of each shape; the dry run's are tiny stand-ins with the same structure
SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
DRY_SHAPES = {
    "smollm2-135m": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama-1b": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    "llama-8b": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=False),
}
MAX_POSITIONS = 4096  # the models' context (the profile's longest step is ~2,100 tokens)
PARITY_BATCH, PARITY_TOKENS = 4, 32  # greedy parity of graphs against eager: requests x new tokens


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the model: random weights in a real model's shape, saved as a HF folder -------------------------------------
def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id ("<t17>"): enough for inferd's loader, which wants one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>", eos_token="<t2>"
                            ).save_pretrained(path)


def build_hf_model(shape: dict, max_positions: int, dtype: torch.dtype, device: torch.device, path: str, seed: int):
    """transformers' Llama with random weights (its own init), in dtype on device, saved to path with a tokenizer.
    Returns the model (the `generate` side of the comparison: the very weights inferd loads from path)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, **shape)
    with torch.device(device):  # initialised where it runs: a 1B model's init on a CPU takes a while
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    save_word_tokenizer(path, shape["vocab_size"])
    return model


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


# ---- inferd's engine ----------------------------------------------------------------------------------------------
def kv_bytes_for(shape: dict, tokens: int, dtype: torch.dtype, block_size: int = 16) -> int:
    """A KV pool for `tokens` tokens, with room to spare (whole blocks per sequence, the graphs' scratch block)."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype.itemsize
    return per_token * (2 * tokens + 64 * block_size)


def engine_config(args, path: str, kv_bytes: int, max_batch: int, cuda_graphs: bool,
                  kernels: str = "auto") -> EngineConfig:
    return EngineConfig(model=path, dtype=args.dtype, device=args.device, kv_cache_bytes=kv_bytes, kernels=kernels,
                        max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch),
                        max_model_len=args.prompt_tokens + max(args.new_tokens, PARITY_TOKENS) + 16,
                        enable_prefix_caching=False, detokenize=False, cuda_graphs=cuda_graphs,
                        # a dry run on a CPU, where graphs cannot be captured: the graphs' static-shape decode path
                        # runs uncaptured, so the parity check still compares it with the eager path
                        static_decode=cuda_graphs and args.dry_run)


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int, record_logits: bool = False) -> dict:
    """All prompts at once, greedy, never stopping early; wall time from submission to the last token."""
    device = engine.runner.device
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    sync(device)
    started = time.perf_counter()
    reqs = [engine.requests[engine.add_request(p, params)] for p in prompts]
    if record_logits:
        for r in reqs:
            r.debug_logits = []
    decode_steps, decode_bytes = [], 0
    while engine.has_unfinished_requests():
        engine.step()
        seconds, prefill, decode, nbytes, _ = engine.stats.last
        if prefill == 0 and decode == len(prompts):  # a decode step of the whole batch
            decode_steps.append(seconds)
            decode_bytes = nbytes  # weights + the KV the step reads (inferd/telemetry/roofline.py counts them)
    sync(device)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.output_token_ids) for r in reqs)
    point = {"batch": len(prompts), "prompt_tokens": len(prompts[0]), "requested_tokens": len(prompts) * new_tokens,
             "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
             "decode_steps": len(decode_steps),
             "decode_step_ms": 1000 * statistics.median(decode_steps) if decode_steps else None,
             "decode_step_bytes": decode_bytes}
    if record_logits:
        point["requests"] = reqs
    return point


def engine_side(args, path: str, shape: dict, cuda_graphs: bool, batches: list[int], kernels: str = "auto",
                peak_bandwidth: float | None = None) -> dict:
    """One engine (graphs or eager; the default kernels or the torch references) over the batches; MBU of each
    batch's decode step against peak_bandwidth."""
    dtype = getattr(torch, args.dtype)
    max_batch = max(batches + [PARITY_BATCH])
    kv_bytes = kv_bytes_for(shape, max_batch * (args.prompt_tokens + max(args.new_tokens, PARITY_TOKENS)), dtype)
    started = time.perf_counter()
    engine = Engine.from_config(engine_config(args, path, kv_bytes, max_batch, cuda_graphs, kernels))
    load_s = time.perf_counter() - started
    graphs = engine.runner.decode_graphs
    out = {"cuda_graphs_flag": cuda_graphs, "kernels": engine.runner.model.ops.name, "load_s": load_s,
           "graphs_captured": len(graphs.graphs) if graphs else 0,
           "capture_s": graphs.capture_seconds if graphs else 0.0,
           "capture_bytes": graphs.capture_bytes if graphs else 0, "kv_blocks": engine.kv_cache.num_blocks}
    vocab = shape["vocab_size"]
    run_engine(engine, make_prompts(2, 8, vocab, 0), 4)  # warm-up: kernels, allocator, the sampler
    out["points"] = [run_engine(engine, make_prompts(b, args.prompt_tokens, vocab, 100 + b), args.new_tokens)
                     for b in batches]
    for p in out["points"]:
        p["decode_mbu"] = (p["decode_step_bytes"] / (p["decode_step_ms"] / 1000) / peak_bandwidth
                           if peak_bandwidth and p["decode_step_ms"] else None)
    parity = run_engine(engine, make_prompts(PARITY_BATCH, args.prompt_tokens, vocab, 7), PARITY_TOKENS,
                        record_logits=True)
    out["parity_requests"] = [(r.output_token_ids, [x.float().cpu() for x in r.debug_logits])
                              for r in parity.pop("requests")]
    out["graph_steps"] = sum(graphs.steps.values()) if graphs else 0
    out["graph_padded_rows"] = graphs.padded_rows if graphs else 0
    engine.close()
    del engine, graphs
    free_memory(torch.device(args.device))
    return out


def parity_check(ours: list, reference: list) -> dict:
    """Greedy tokens of the graphs engine against the eager one, by the exactness rule (tests/parity.py)."""
    import numpy as np

    from parity import Reference, assert_greedy_parity

    result = {"requests": len(ours), "tokens": 0, "matched": 0, "ok": True, "failures": [], "max_logit_diff": 0.0}
    for i, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(ours, reference)):
        ref = Reference(ref_tokens, np.stack([x.numpy() for x in ref_logits]))
        result["tokens"] += len(tokens)
        try:
            matched = assert_greedy_parity(tokens, logits, ref, f"request {i}")
        except AssertionError as e:
            result["ok"] = False
            result["failures"].append(str(e))
            continue
        result["matched"] += matched
        for a, b in zip(logits[:matched], ref_logits):
            result["max_logit_diff"] = max(result["max_logit_diff"], float((a - b).abs().max()))
    return result


# ---- transformers' generate -----------------------------------------------------------------------------------
@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> dict:
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                           pad_token_id=0)
    model.generation_config.eos_token_id = None  # generate() falls back to it even when told None
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    sync(device)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    sync(device)
    seconds = time.perf_counter() - started
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"batch": len(prompts), "prompt_tokens": len(prompts[0]), "requested_tokens": len(prompts) * new_tokens,
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


# ---- one model, then the profile ------------------------------------------------------------------------------
def check_model(args, name: str, shape: dict, workdir: str, result: dict, save, peak_bandwidth: float | None) -> dict:
    """Fills result (already in the report) stage by stage, calling save() after each: a failure or a timeout
    later in the run keeps what was measured so far."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    path = os.path.join(workdir, name)
    started = time.perf_counter()
    hf = build_hf_model(shape, MAX_POSITIONS, dtype, device, path, seed=1)
    result.update({"name": name, "shape": shape, "parameters": sum(p.numel() for p in hf.parameters()),
                   "build_and_save_s": time.perf_counter() - started})
    print(f"[{name}] built and saved ({result['parameters'] / 1e6:.1f} M parameters) in "
          f"{result['build_and_save_s']:.1f} s", flush=True)
    hf_points = []
    run_hf(hf, make_prompts(1, 8, shape["vocab_size"], 0), 4, device)  # warm-up
    for b in batches:
        hf_points.append(run_hf(hf, make_prompts(b, args.prompt_tokens, shape["vocab_size"], 100 + b),
                                args.new_tokens, device))
        print(f"[{name}] transformers generate, batch {b}: {hf_points[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    result["hf_generate"] = {"points": hf_points}
    save()
    del hf
    free_memory(device)
    parity_requests = {}
    # the default kernels (Triton attention on CUDA) with graphs and eagerly, then the torch references with graphs:
    # the same requests, so that both the graphs and the kernels are checked against a path they do not use
    for label, flag, kernels in (("cuda_graphs", True, args.kernels), ("eager", False, args.kernels),
                                 ("torch_attention", True, "reference")):
        result[label] = engine_side(args, path, shape, flag, batches, kernels, peak_bandwidth)
        parity_requests[label] = result[label].pop("parity_requests")
        for p in result[label]["points"]:
            step = f"{p['decode_step_ms']:.2f} ms/decode step" if p["decode_step_ms"] is not None else "no decode step"
            mbu = f", MBU {p['decode_mbu']:.1%}" if p["decode_mbu"] is not None else ""
            print(f"[{name}] inferd {label} ({result[label]['kernels']}, graphs captured: "
                  f"{result[label]['graphs_captured']}), batch {p['batch']}: {p['tokens_per_s']:.1f} tok/s, "
                  f"{step}{mbu}", flush=True)
        save()
    result["parity_graphs_vs_eager"] = parity_check(parity_requests["cuda_graphs"], parity_requests["eager"])
    result["parity_kernels_vs_torch"] = parity_check(parity_requests["cuda_graphs"],
                                                     parity_requests["torch_attention"])
    ratios = {}
    for g, e, t, h in zip(result["cuda_graphs"]["points"], result["eager"]["points"],
                          result["torch_attention"]["points"], hf_points):
        ratios[str(g["batch"])] = {
            "graphs_over_eager_tokens_per_s": g["tokens_per_s"] / e["tokens_per_s"],
            "eager_over_graphs_decode_step": (e["decode_step_ms"] / g["decode_step_ms"]
                                              if g["decode_step_ms"] and e["decode_step_ms"] else None),
            "graphs_over_hf_tokens_per_s": g["tokens_per_s"] / h["tokens_per_s"],
            "eager_over_hf_tokens_per_s": e["tokens_per_s"] / h["tokens_per_s"],
            "kernels_over_torch_tokens_per_s": g["tokens_per_s"] / t["tokens_per_s"]}
    result["ratios"] = ratios
    save()
    return result


def check_profile(args, workdir: str) -> dict:
    """`inferd profile` (run_profile, the engine side of it) on --profile-model (kept on disk for it)."""
    from inferd.bench.profile import answer, plot_roofline, run_profile
    from inferd.cli.profile import add_profile_arguments

    name = args.profile_model
    parser = argparse.ArgumentParser()
    add_profile_arguments(parser)  # the command's own options and defaults
    result = run_profile(parser.parse_args([
        "--model", os.path.join(workdir, name), "--dtype", args.dtype, "--device", args.device,
        "--kv-cache-bytes", str(args.profile_kv_bytes), "--contexts", args.profile_contexts,
        "--max-batch", str(args.profile_max_batch), "--prefill", args.profile_prefill,
        "--steps", str(args.profile_steps)]))
    result["model"] = f"{name} (random weights)"
    result["answer"] = answer(result)
    try:
        plot_roofline(result, os.path.join(args.out, "roofline.png"))
        result["plot"] = "roofline.png"
    except ImportError:
        result["plot"] = None
    return result


# ---- output ---------------------------------------------------------------------------------------------------
def _ms(point: dict) -> str:
    return "-" if point["decode_step_ms"] is None else f"{point['decode_step_ms']:.2f}"


def summary_lines(report: dict) -> list[str]:
    settings = report["settings"]
    dry = " (DRY RUN: tiny shapes on the CPU, timings meaningless)" if report["dry_run"] else ""
    lines = [f"gpu_check on {report['device_name']} ({report['device']}), {report['dtype']}, torch {report['torch']}, "
             f"transformers {report['transformers']}{dry}",
             f"requests: prompts of {settings['prompt_tokens']} tokens, {settings['new_tokens']} new tokens each, "
             "greedy; tok/s = output tokens / wall time of the whole batch; ms/step = median decode step"]
    if report.get("peaks"):
        pk = report["peaks"]
        lines.append(f"calibrated peaks: {pk['bandwidth'] / 1e9:.1f} GB/s, {pk['flops'] / 1e12:.2f} TFLOP/s "
                     f"({pk['source']}); MBU = bytes a decode step reads / its time / that bandwidth")
    for m in report["models"]:
        if "torch_attention" not in m:
            lines.append(f"{m['name']}: not finished (stages done: {', '.join(k for k in m if k != 'name')})")
            continue
        g, e, t = m["cuda_graphs"], m["eager"], m["torch_attention"]
        lines.append(f"{m['name']} ({m['parameters'] / 1e6:.1f} M parameters, random weights): "
                     f"{g['graphs_captured']} CUDA graphs captured in {g['capture_s']:.2f} s "
                     f"({g['capture_bytes'] / 2**20:.0f} MiB), {g['graph_steps']} steps replayed; kernels "
                     f"{g['kernels']} against {t['kernels']}")
        for gp, ep, tp, hp in zip(g["points"], e["points"], t["points"], m["hf_generate"]["points"]):
            mbu = f" MBU {gp['decode_mbu']:.1%}" if gp.get("decode_mbu") is not None else ""
            lines.append(f"  batch {gp['batch']:3d}: graphs {gp['tokens_per_s']:9.1f} tok/s "
                         f"{_ms(gp):>7s} ms/step{mbu} | "
                         f"eager {ep['tokens_per_s']:9.1f} tok/s {_ms(ep):>7s} ms/step | "
                         f"torch attention {tp['tokens_per_s']:9.1f} tok/s | "
                         f"transformers {hp['tokens_per_s']:9.1f} tok/s | graphs/eager "
                         f"{gp['tokens_per_s'] / ep['tokens_per_s']:.2f}x, kernels/torch "
                         f"{gp['tokens_per_s'] / tp['tokens_per_s']:.2f}x, graphs/transformers "
                         f"{gp['tokens_per_s'] / hp['tokens_per_s']:.2f}x")
        for key, what in (("parity_graphs_vs_eager", "graphs against eager"),
                          ("parity_kernels_vs_torch", "kernels against torch attention")):
            par = m[key]
            lines.append(f"  greedy parity, {what}: {'ok' if par['ok'] else 'FAILED'} ({par['matched']} of "
                         f"{par['tokens']} tokens compared before a near-tie; max logit diff "
                         f"{par['max_logit_diff']:.3g})")
    prof = report.get("profile")
    if prof:
        peaks = prof["peaks"]
        lines.append(f"profile ({prof['model']}): peaks {peaks['bandwidth'] / 1e9:.1f} GB/s, "
                     f"{peaks['flops'] / 1e9:.1f} GFLOP/s ({peaks['source']})")
        for p in prof["points"]:
            lines.append(f"  {p['kind']:7s} batch {p['batch']:3d} context {p['context']:5d}: "
                         f"{p['step_s'] * 1000:8.2f} ms/step {p['tokens_per_s']:10.1f} tok/s MBU {p['mbu']:6.1%} "
                         f"MFU {p['mfu']:6.1%} {p['bound']}")
        lines.append(prof["answer"])
    if "seconds" in report:
        lines.append(f"total {report['seconds']:.1f} s")
    return lines


def plot_throughput(report: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in report["models"] if "torch_attention" in m]
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        batches = [p["batch"] for p in m["cuda_graphs"]["points"]]
        xs = range(len(batches))
        for k, (label, points) in enumerate((("inferd, CUDA graphs", m["cuda_graphs"]["points"]),
                                             ("inferd, eager", m["eager"]["points"]),
                                             ("transformers generate", m["hf_generate"]["points"]))):
            ax.bar([x + (k - 1) * 0.27 for x in xs], [p["tokens_per_s"] for p in points], width=0.27, label=label)
        ax.set_xticks(list(xs), [f"batch {b}" for b in batches])
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{m['name']} ({report['dtype']}, {report['device_name']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny shapes: checks the script in seconds")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, ".cache", "gpu_check"))
    p.add_argument("--device", default=None, help="default cuda (the dry run: cpu)")
    p.add_argument("--dtype", default=None, help="default bfloat16 (the dry run: float32)")
    p.add_argument("--models", default="smollm2-135m,llama-1b,llama-8b")
    p.add_argument("--profile-model", default=None, help="the model `inferd profile` runs on (default llama-1b if "
                   "checked, else the last)")
    p.add_argument("--kernels", default="auto", help="the engines' --kernels (the torch_attention engine: reference)")
    p.add_argument("--batches", default=None, help="default 1,64 (the dry run: 1,4)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 128 (the dry run: 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (the dry run: 8)")
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args(argv)
    dry = args.dry_run
    models = args.models.split(",")
    args.profile_model = args.profile_model or ("llama-1b" if "llama-1b" in models else models[-1])
    args.device = args.device or ("cpu" if dry else "cuda")
    args.dtype = args.dtype or ("float32" if dry else "bfloat16")
    args.batches = args.batches or ("1,4" if dry else "1,64")
    args.prompt_tokens = args.prompt_tokens or (16 if dry else 128)
    args.new_tokens = args.new_tokens or (8 if dry else 128)
    # the profile's short ladder
    args.profile_contexts = "16,32" if dry else "128,1024"
    args.profile_max_batch = 4 if dry else 64
    args.profile_prefill = "16,32" if dry else "128,512,2048"
    args.profile_steps = 2 if dry else 6
    args.profile_kv_bytes = (8 << 20) if dry else (8 << 30)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here (bench/gpu_check.sh --dry-run runs on a CPU)", file=sys.stderr)
        return 2
    import transformers

    if args.dry_run:
        torch.set_num_threads(1)  # a format check on a shared CPU: threads spinning against neighbours only hurt
    started = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    report = {"dry_run": args.dry_run, "device": args.device,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "torch": torch.__version__, "transformers": transformers.__version__,
              "threads": torch.get_num_threads(),
              "settings": {"batches": [int(b) for b in args.batches.split(",")], "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens, "parity": [PARITY_BATCH, PARITY_TOKENS]},
              "models": []}

    def save() -> None:
        """The report as it stands, written atomically: a run cut short keeps every stage that finished."""
        tmp = os.path.join(args.out, "gpu_check.json.tmp")
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, os.path.join(args.out, "gpu_check.json"))

    report["complete"] = False
    from inferd.telemetry.roofline import peaks

    p = peaks(device, getattr(torch, args.dtype))
    report["peaks"] = {"bandwidth": p.bandwidth, "flops": p.flops, "source": p.source}
    print(f"[peaks] {p.bandwidth / 1e9:.1f} GB/s, {p.flops / 1e12:.2f} TFLOP/s in {args.dtype} ({p.source})",
          flush=True)
    save()
    with tempfile.TemporaryDirectory(prefix="inferd-gpu-check-") as workdir:
        for name in args.models.split(","):
            report["models"].append({"name": name})
            check_model(args, name, shapes[name], workdir, report["models"][-1], save, p.bandwidth)
            if name != args.profile_model:
                shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)  # an 8B model's 16 GB of disk
        if not args.no_profile:
            print("[profile] inferd profile on", args.profile_model, flush=True)
            report["profile"] = check_profile(args, workdir)
            save()
    report["seconds"] = time.perf_counter() - started
    report["plots"] = [name for name, ok in (("throughput.png", plot_throughput(report, os.path.join(
        args.out, "throughput.png"))),) if ok] + ([report["profile"]["plot"]] if report.get("profile", {}).get("plot")
                                                  else [])
    report["complete"] = True
    save()
    text = "\n".join(summary_lines(report)) + "\n"
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    print(f"wrote {args.out}/gpu_check.json and summary.txt" + (f" ({', '.join(report['plots'])})"
                                                              if report["plots"] else " (no plots: no matplotlib)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

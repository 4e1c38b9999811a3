"""Batch-1 decode MBU of a Qwen3-shaped model against a Llama of the same size (SmolLM2-135M's shape), side by side
in one run: random weights of each architecture saved with `save_pretrained`, each measured by `inferd profile` (one
process each, the same calibrated peaks), the ratios printed. What differs is only the family's own work: Qwen3's
q/k RMSNorm per head, which also keeps its layers out of the fused whole-stack decode op (`Attention.plain`).

    .venv/bin/python bench/family_mbu.py [--dtype bfloat16] [--context 128] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# SmolLM2-135M's shape
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
             rms_norm_eps=1e-5)


def save(family: str, path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, {"llama": "LlamaConfig", "qwen3": "Qwen3Config"}[family])(**SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    from inferd.models.loader import default_model_path
    from inferd.models.tokenizer import load_tokenizer

    load_tokenizer(default_model_path()).hf.save_pretrained(path)  # SmolLM2's (the vocabulary is its size)


def profile(path: Path, out: Path, args) -> dict:
    subprocess.run([sys.executable, "-m", "inferd", "profile", "--model", str(path), "--dtype", args.dtype,
                    "--contexts", str(args.context), "--max-batch", "1", "--prefill", "64", "--mixed-batches", "",
                    "--steps", str(args.steps), "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    data = json.loads((out / "profile.json").read_text())
    [point] = [p for p in data["points"] if p["kind"] == "decode" and p["batch"] == 1]
    return point


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for family in ("llama", "qwen3"):
            folder = Path(tmp) / family
            save(family, folder)
            results[family] = profile(folder, Path(tmp) / f"{family}-profile", args)
        for family, r in results.items():
            print(f"{family:6s} batch 1, context {args.context}, {args.dtype}: {r['step_s'] * 1e3:7.2f} ms/step "
                  f"{r['bytes'] / 1e6:7.1f} MB/step  MBU {r['mbu']:.1%}")
        print(f"qwen3 / llama: step time x{results['qwen3']['step_s'] / results['llama']['step_s']:.2f}, "
              f"MBU x{results['qwen3']['mbu'] / results['llama']['mbu']:.2f}")


if __name__ == "__main__":
    main()

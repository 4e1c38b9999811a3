"""Process CPU time per decode step of a tiny 2-layer Llama (random weights, no sliding layers): the step's own
Python and host cost, which a change to scheduling, the KV cache manager or the runner's step preparation moves.
Run it on two trees alternately (PYTHONPATH=TREE) and compare; process time is less disturbed by other processes
than wall time, not immune to them.

    PYTHONPATH=$PWD .venv/bin/python bench/decode_step_cpu.py [--steps 200] [--kernels auto] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.models.build import build_model
from inferd.models.config import ModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=128)
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    model = build_model(cfg, LlamaForCausalLM(hf_cfg).eval().state_dict(), torch.float32)
    engine = Engine(model, cfg, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=args.batch, detokenize=False,
                                             enable_prefix_caching=False, kernels=args.kernels), torch.float32)
    params = SamplingParams(max_tokens=args.steps + 100, ignore_eos=True, temperature=0.0)
    for i in range(args.batch):
        engine.add_request([3 + (i * 7 + j) % 500 for j in range(args.context)], params)
    while any(r.num_computed_tokens < args.context for r in engine.requests.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(args.steps):
        t = time.process_time()
        engine.step()
        times.append(time.process_time() - t)
    print(f"kernels={args.kernels} batch {args.batch}: CPU per decode step median "
          f"{statistics.median(times) * 1e3:.3f} ms, mean {statistics.mean(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()

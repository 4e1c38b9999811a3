"""One MoE block's step (inferd/models/moe.py) at batch 1 and 64, computed three ways on random weights:

  by-expert  SparseMoE.forward, the engine's path: (token, expert) pairs sorted by expert, one gate/up and one down
             matmul per active expert over all its tokens, weighted index_add_ back;
  per-token  each token through its k experts one at a time (2 GEMVs per (token, expert) pair): the naive loop;
  dense      a dense gated MLP with the same active parameters (intermediate k * I): what the step would cost if
             only the chosen experts' weights existed (the floor the MoE overhead is measured against).

All three multiply through oneDNN-packed weights on CPU (SparseMoE.pack, layers.Linear.pack: what the engine runs;
--no-pack for plain F.linear) in the same dtype, over the same routing; by-expert's and per-token's outputs are
checked equal (float32 bound) before timing. Shapes (per layer):
  mixtral  hidden 1024, 8 experts of width 3584, top-2 (Mixtral-8x7B's 4096/14336 scaled by 1/4)
  qwen3    hidden 1024, 64 experts of width 384, top-8 (Qwen3-30B-A3B's 2048/768/128 experts scaled by 1/2)
--layers stacks that many blocks (own weights each, a residual add between) so that no layer's weights stay cached.

    .venv/bin/python bench/moe_step.py [--shape mixtral|qwen3] [--dtype float32|bfloat16] [--batch 1,64]
                                       [--layers 2] [--reps 7] [--no-pack]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from inferd.models.layers import Linear  # noqa: E402
from inferd.models.moe import MoESpec, SparseMoE  # noqa: E402

SHAPES = {"mixtral": dict(family="mixtral", hidden_size=1024, intermediate_size=3584, num_experts=8, top_k=2),
          "qwen3": dict(family="qwen3_moe", hidden_size=1024, intermediate_size=384, num_experts=64, top_k=8,
                        norm_topk_prob=True)}


def build(spec: MoESpec, layers: int, dtype: torch.dtype, pack: bool, seed: int = 0) -> list[SparseMoE]:
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(layers):
        moe = SparseMoE(spec)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        moe.to(dtype)
        if pack:
            moe.pack()
        blocks.append(moe)
    return blocks


def per_token(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts one by one (same routing, same activation)."""
    weights, ids = moe.route(x)
    out = torch.zeros_like(x)
    ex = moe.experts
    for t in range(x.shape[0]):
        row = x[t:t + 1]
        for j in range(moe.spec.top_k):
            e = int(ids[t, j])
            gate, up = ex.gate_up_mm(e, row).chunk(2, dim=-1)
            y = ex.down_mm(e, F.silu(gate) * up)
            out[t] += (y[0] * weights[t, j]).to(x.dtype)
    return out


def dense_mlp(spec: MoESpec, dtype: torch.dtype, pack: bool):
    """A gated MLP of width k * I: the active parameters of one token's experts."""
    width = spec.top_k * spec.intermediate_size
    g = torch.Generator().manual_seed(1)
    gate_up, down = Linear(spec.hidden_size, 2 * width, False), Linear(width, spec.hidden_size, False)
    for m in (gate_up, down):
        m.load(torch.randn(m.weight.shape, generator=g) * 0.02)
        m.to(dtype)
        if pack:
            m.pack()

    def forward(x):
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(F.silu(gate) * up)
    return forward


def stack(fns, x):
    for fn in fns:
        x = x + fn(x)
    return x


def timed(fn, reps: int) -> float:
    """The best of reps runs, in ms: on a machine shared with other work the median measures the neighbours (batch 1
    here: best 1.9 ms, median 14-20 ms, for both paths alike)."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mixtral")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-pack", action="store_true", help="F.linear over the plain weights (no oneDNN repacking)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    spec = MoESpec(**SHAPES[args.shape])
    pack = not args.no_pack
    blocks = build(spec, args.layers, dtype, pack)
    dense = [dense_mlp(spec, dtype, pack) for _ in range(args.layers)]
    per_layer = blocks[0].weight_bytes_touched(range(spec.num_experts))
    print(f"{args.shape}: hidden {spec.hidden_size}, {spec.num_experts} experts of width {spec.intermediate_size}, "
          f"top-{spec.top_k}, {args.layers} layers, {args.dtype} ({per_layer / 1e6:.0f} MB of weights per layer), "
          f"{torch.get_num_threads()} threads, {'oneDNN-packed' if pack else 'plain F.linear'}")
    print(f"{'batch':>5} {'experts hit':>11} {'by-expert ms':>12} {'per-token ms':>12} {'dense ms':>9} "
          f"{'per-token/by-expert':>19} {'by-expert/dense':>15}")
    token_loop = [lambda h, m=m: per_token(m, h) for m in blocks]
    with torch.inference_mode():
        for batch in (int(b) for b in args.batch.split(",")):
            x = torch.randn(batch, spec.hidden_size, generator=torch.Generator().manual_seed(batch)).to(dtype)
            a, b = stack(blocks, x), stack(token_loop, x)
            scale = max(1.0, float(a.abs().max()))
            tol = (1e-5 if dtype == torch.float32 else 4e-2) * scale
            assert float((a - b).abs().max()) <= tol, "by-expert and per-token disagree"
            hit = sum(int((m.last_expert_counts > 0).sum()) for m in blocks) / len(blocks)
            t_exp = timed(lambda x=x: stack(blocks, x), args.reps)
            t_tok = timed(lambda x=x: stack(token_loop, x), args.reps)
            t_dense = timed(lambda x=x: stack(dense, x), args.reps)
            print(f"{batch:>5} {hit:>11.1f} {t_exp:>12.2f} {t_tok:>12.2f} {t_dense:>9.2f} {t_tok / t_exp:>19.2f} "
                  f"{t_exp / t_dense:>15.2f}")


if __name__ == "__main__":
    main()

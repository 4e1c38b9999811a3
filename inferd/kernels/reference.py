"""Plain torch references of the fused operators (what tests compare the fast paths against, and what runs where
no fused implementation exists: another device, an unsupported dtype, INFERD_KERNELS=reference).

Each computes what the step computed before the fused kernels existed, op for op, so the reference path is
today's behaviour.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged import (
    attend,
    build_decode_mask,
    decode_attention,
    gather_blocks,
    window_allowed,
    write_kv,
)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, in residual's dtype) when x is given; returns weight * rmsnorm(residual)."""
    if x is not None:
        residual.add_(x)
    dtype = residual.dtype
    r32 = residual.to(torch.float32)
    r32 = r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * r32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                  num_kv_heads: int) -> None:
    """qkv [T, (H + 2 KV) D]: rotates its q and k heads in place (positions index the cos/sin tables) and writes k
    and v to their cache slots (cast to the cache's dtype). Tables narrower than D (partial rotary, Phi) rotate
    each head's first cos.shape[-1] dims and leave the rest."""
    T = qkv.shape[0]
    d = k_cache.shape[-1]
    c, s = cos[positions], sin[positions]
    qk = qkv[:, :(num_heads + num_kv_heads) * d].view(T, num_heads + num_kv_heads, d)
    rot = qk[..., :c.shape[-1]]
    rot.copy_(apply_rotary(rot, c, s))
    k = qkv[:, num_heads * d:(num_heads + num_kv_heads) * d].view(T, num_kv_heads, d)
    v = qkv[:, (num_heads + num_kv_heads) * d:].view(T, num_kv_heads, d)
    write_kv(k_cache, v_cache, k, v, slot_mapping)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int = 0,
                           sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q [B, H, D]; caches [KV, blocks, block_size, D]; block_tables int32 [B, max_blocks]; context_lens int32 [B]
    -> [B, H, D]. Gathers each sequence's blocks (dequantized to q's dtype), masks past its length, and attends.
    window (a sliding layer's last `window` positions), sinks (per-head logits in the softmax's denominator) and
    softcap (scores soft-capped): the layer's attention options, as paged.attend computes them."""
    bs = k_cache.shape[2]
    lens = [int(n) for n in context_lens.tolist()]
    max_blocks = max(-(-n // bs) for n in lens)
    idx = block_tables[:, :max_blocks].to(torch.long).reshape(-1)
    mask = build_decode_mask(lens, max_blocks, bs, q.dtype).to(q.device)
    return decode_attention(q, k_cache, v_cache, idx, mask, scale, window, sinks, softcap)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
                            context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, window: int = 0,
                            sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """The varlen prefill contract (triton_prefill.paged_prefill_attention's), one sequence at a time: q [N, H, D],
    the chunks' rows in order (cu_seqlens int32 [S + 1]); each chunk attends causally to its context read back from
    the cache (context_lens int32 [S], its own new keys included; block_tables int32 [S, max_blocks]). -> [N, H, D]."""
    bs = k_cache.shape[2]
    n_kv, d = k_cache.shape[0], k_cache.shape[-1]
    cu, lens = cu_seqlens.tolist(), context_lens.tolist()
    out = torch.empty_like(q)
    for i, ctx in enumerate(lens):
        lo, hi = cu[i], cu[i + 1]
        ids = block_tables[i, :-(-ctx // bs)].to(torch.long)
        keys = gather_blocks(k_cache, ids, q.dtype).view(n_kv, -1, d)[:, :ctx].unsqueeze(1)
        values = gather_blocks(v_cache, ids, q.dtype).view(n_kv, -1, d)[:, :ctx].unsqueeze(1)
        rows = torch.arange(ctx - (hi - lo), ctx, device=q.device).unsqueeze(1)
        cols = torch.arange(ctx, device=q.device).unsqueeze(0)
        allowed = window_allowed(rows, cols, window).unsqueeze(0)
        out[lo:hi] = attend(q[lo:hi].unsqueeze(0), keys, values, allowed, scale, sinks, softcap).squeeze(0)
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, perm: torch.Tensor, seg_slots: list[int], seg_starts: list[int],
             row_slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, ranks: list[int], parts: list[int]) -> None:
    """y [T, out] += the LoRA deltas of x [T, in]'s rows, each through its own adapter (models/lora.py's layout):
    rows perm[seg_starts[i]:seg_starts[i+1]] use slot seg_slots[i]; rows not in perm (the base model's) are left
    as they are. Slot s of rank r = ranks[s] holds, for each part p of the output (parts: the fused projection's
    pieces, e.g. q, k, v: sizes summing to out, part p starting at column off_p), A_p in a[s, p*r:(p+1)*r] ([r, in])
    and scale * B_p^T in bt[s, r*off_p : r*(off_p + size_p)] (row-major [r, size_p]). row_slots [T] (-1: base) says
    the same per row; it is the form a per-row (Triton) kernel reads. Per slot, not per request: a segmented matmul
    (Punica's SGMV). The deltas are computed in y's dtype and added in one index_add."""
    if perm.numel() == 0:
        return
    xs = x.index_select(0, perm)
    delta = torch.empty(perm.numel(), y.shape[1], dtype=y.dtype, device=y.device)
    n_parts = len(parts)
    for i, s in enumerate(seg_slots):
        lo, hi, r = seg_starts[i], seg_starts[i + 1], ranks[s]
        xa = xs[lo:hi] @ a[s, :n_parts * r].t()  # the shrink: [rows, P r]
        off = 0
        for p, size in enumerate(parts):  # the expand, part by part: [rows, r] @ [r, size]
            delta[lo:hi, off:off + size] = xa[:, p * r:(p + 1) * r] @ bt[s, r * off:r * (off + size)].view(r, size)
            off += size
    y.index_add_(0, perm, delta)

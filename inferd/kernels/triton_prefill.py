"""Variable-length paged prefill attention in Triton: one launch computes attention for the query chunks of every
sequence of a chunked-prefill step, reading keys and values where they lie in the paged KV cache.

What the engine hands over, and why it looks like this:

- The step's new K/V were written into the cache (rope_kv_write) before attention runs, so a chunk's own keys are
  read back from the cache like its context: one code path for a first chunk, a later chunk and a prefix-cache hit.
- Sequence s contributes rows cu_seqlens_q[s] .. cu_seqlens_q[s+1]-1 of q (n_s queries) and attends over
  context_lens[s] = num_cached_s + n_s positions; query i of the chunk sits at absolute position num_cached_s + i
  and sees keys [0, num_cached_s + i]. The mask is computed from positions inside the kernel; none is materialized.
- Position p of sequence s lives at slot block_tables[s, p // block_size] * block_size + p % block_size of a cache
  shaped [num_kv_heads, num_blocks, block_size, head_dim] (inferd/kernels/paged.py documents the layout).

The kernel is flash-attention style: a program owns BLOCK_M query rows of one sequence and one query head, walks
the key positions in tiles of BLOCK_N up to its last row's causal limit (gathering each key's slot through the
block table, so BLOCK_N need not equal the cache's block size), and keeps an online softmax (running max and sum) in
float32; the output accumulates in float32 and is stored in q's dtype.

Program mapping. grid = (T // BLOCK_M + S, H). Program p of axis 0 belongs to the sequence s with the largest
first_tile(s) = cu_seqlens_q[s] // BLOCK_M + s not above p (found by a binary search over cu_seqlens_q inside the
kernel, log2(S) scalar loads), and owns that sequence's rows (p - first_tile(s)) * BLOCK_M onwards. Sequence s is
given first_tile(s+1) - first_tile(s) = cu[s+1] // BLOCK_M - cu[s] // BLOCK_M + 1 >= ceil(n_s / BLOCK_M) programs,
so every row is covered; the at most S surplus programs see an empty tile and return at once. We chose this over
a host-side program -> (seq, tile) table because the grid then depends on shapes alone (T from q, S from
cu_seqlens_q): no device -> host copy of cu_seqlens_q (a sync on a GPU), no extra small launches per layer to build
the table, and the launch can be captured in a CUDA graph. The in-kernel search costs a handful of scalar loads per
program against a K/V loop of hundreds of vector loads.

Float8 (e4m3fn) caches are read as their bytes (a uint8 view made on the host, so no float8 pointer type is needed)
and decoded to float32 with integer operations in the kernel, exactly for every finite code, subnormals included,
then cast to q's dtype (exact for fp32, fp16 and bf16: e4m3 has 3 mantissa bits and exponents -9..8), which is
what the reference (paged.gather_blocks) computes in.

Attention options (as the decode kernel; reference.paged_prefill_attention is the contract): with a window a row
sees keys (q_pos - window, q_pos], so the key loop starts at the program's first row's window; a later row of the
tile may see nothing in the first key tiles, where its running max stays -inf (m_safe keeps -inf - -inf out of the
update). The soft-cap applies before the mask; a head's sink starts the running max and sum.

GQA: program (p, h) reads KV head h // (H // KV); head groups of 1, 3 (SmolLM2: H=9, KV=3) and 8 are tested.

The module imports without triton (AVAILABLE is False then) so the engine can import it on any machine; only a
call fails.
"""

from __future__ import annotations

import torch

# triton, or None where it does not import (AVAILABLE, IMPORT_ERROR): one guard, in the decode kernel's module
# what both paged attention kernels take, and their argument checks (one copy, in the decode kernel's module)
from .triton_decode import (  # noqa: F401  # noqa: E402,F401
    AVAILABLE,
    HEAD_DIMS,
    IMPORT_ERROR,
    KV_DTYPES,
    LOG2E,
    Q_DTYPES,
    check_options,
    check_paged_args,
    pow2,
    tl,
    triton,
)

if AVAILABLE:

    # the float8 decoder and the soft-cap's tanh the decode kernel uses (one copy: exact for every finite code,
    # tested there and here)
    from .triton_decode import fp8e4m3fn_to_fp32, tanh_f32

    @triton.jit(do_not_specialize=["num_seqs"])  # S == 1 must not turn the search bound into a constant
    def _paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, ctx_ptr, bt_ptr, sinks_ptr,
        num_seqs, sm_scale_log2, sm_scale, window, softcap,
        stride_qt, stride_qh, stride_qd,
        stride_ot, stride_oh, stride_od,
        stride_kh, stride_kb, stride_kp, stride_kd,
        stride_vh, stride_vb, stride_vp, stride_vd,
        stride_bt,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        KV_FP8: tl.constexpr, IEEE_DOT: tl.constexpr, HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP

        # the sequence this program belongs to: the last s with cu[s] // BLOCK_M + s <= pid (strictly increasing in s)
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first = tl.load(cu_ptr + mid) // BLOCK_M + mid
            lo = tl.where(first <= pid, mid + 1, lo)
            hi = tl.where(first <= pid, hi, mid)
        seq = lo - 1
        q_start = tl.load(cu_ptr + seq)
        n = tl.load(cu_ptr + seq + 1) - q_start
        m0 = (pid - (q_start // BLOCK_M + seq)) * BLOCK_M
        if m0 < n:
            ctx = tl.load(ctx_ptr + seq)
            num_cached = ctx - n

            offs_m = m0 + tl.arange(0, BLOCK_M)  # row within the chunk
            offs_d = tl.arange(0, HEAD_DIM)
            row_ok = offs_m < n
            q_rows = (q_start + offs_m).to(tl.int64)
            q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                        mask=row_ok[:, None], other=0.0)
            q_pos = num_cached + offs_m  # absolute position of each query

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            if HAS_SINKS:  # the head's sink logit (log2 units) starts the running max and sum; it takes no value
                m_i = l_i + tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
                l_i = l_i + 1.0
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

            # keys up to the last real row's causal limit; never past the context. A sliding window (window > 0):
            # each row sees keys (q_pos - window, q_pos], so keys before the first row's window are never read
            end = num_cached + tl.minimum(m0 + BLOCK_M, n)
            lo = tl.where(window > 0, tl.maximum(num_cached + m0 - window + 1, 0), 0)
            floor = tl.where(window > 0, q_pos - window, -1)  # [BLOCK_M]: each row sees keys above it
            k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
            v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
            bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
            for start_n in range(lo, end, BLOCK_N):
                k_pos = start_n + tl.arange(0, BLOCK_N)
                k_ok = k_pos < end
                block = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
                in_block = k_pos % BLOCK_SIZE
                k_off = block * stride_kb + in_block * stride_kp  # [BLOCK_N]
                v_off = block * stride_vb + in_block * stride_vp
                # K transposed ([HEAD_DIM, BLOCK_N]) so the score tile is a plain q @ kT
                k = tl.load(k_base + k_off[None, :] + offs_d[:, None] * stride_kd, mask=k_ok[None, :], other=0)
                v = tl.load(v_base + v_off[:, None] + offs_d[None, :] * stride_vd, mask=k_ok[:, None], other=0)
                if KV_FP8:
                    k = fp8e4m3fn_to_fp32(k)
                    v = fp8e4m3fn_to_fp32(v)
                k = k.to(q.dtype)
                v = v.to(q.dtype)

                if IEEE_DOT:  # float32 activations: no TF32 rounding of the scores on the GPU
                    s = tl.dot(q, k, input_precision="ieee")
                else:
                    s = tl.dot(q, k)
                if SOFTCAP:  # soft-capped before the mask, in natural units, then to log2 units
                    s = tanh_f32((s * sm_scale) / softcap) * (softcap * 1.4426950408889634)
                else:
                    s = s * sm_scale_log2
                visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > floor[:, None]) & k_ok[None, :]
                s = tl.where(visible, s, float("-inf"))

                # without a window key 0 is visible to every row, so m_new is finite from the first tile on; with
                # one, a row may see nothing in a tile before its window: m_safe keeps -inf - -inf (NaN) out
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                if IEEE_DOT:
                    acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc += tl.dot(p.to(v.dtype), v)
                m_i = m_new

            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l == 0 only for a padding row past a window
            tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def default_tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a head_dim: 64 x 64 tiles, narrower key tiles at head_dim 128 so the float32 K/V
    tiles and the accumulator stay within a program's registers. Untuned starting points (no benchmark yet)."""
    return (64, 32) if head_dim >= 128 else (64, 64)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, window: int = 0, sinks: torch.Tensor | None = None, softcap: float = 0.0,
                            *, out: torch.Tensor | None = None, block_m: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """Causal attention of every sequence's query chunk over its context in the paged cache -> [T, H, D] in q's dtype
    (written into `out` when given).

    q: [T, H, D] (fp32/fp16/bf16; any row and head strides, e.g. a view into the fused qkv rows); k_cache, v_cache: [KV,
    num_blocks, block_size, D] (fp32/fp16/bf16/float8_e4m3fn), holding every position of every sequence up to
    context_lens - 1, the chunk's own included; cu_seqlens_q: int32 [S+1] (0, n_0, n_0+n_1, ...); context_lens:
    int32 [S] = num_cached + n per sequence; block_tables: int32 [S, max_blocks]; scale: the softmax scale (usually
    D ** -0.5); window, sinks ([H], any float dtype), softcap: the layer's attention options, as paged.attend
    computes them (reference.paged_prefill_attention's contract). block_m / block_n override the tile sizes (powers
    of two >= 16, the smallest tl.dot operand on a GPU); tests use small ones to cover several tiles per sequence.
    """
    if not AVAILABLE:
        raise RuntimeError(f"triton is not available: {IMPORT_ERROR}")
    T, H, D, KV, block_size = check_paged_args(q, k_cache, v_cache, "T")
    S = context_lens.shape[0]
    if cu_seqlens_q.shape != (S + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != S:
        raise ValueError(f"expected cu_seqlens_q [S+1], context_lens [S], block_tables [S, max_blocks], got "
                         f"{tuple(cu_seqlens_q.shape)}, {tuple(context_lens.shape)}, {tuple(block_tables.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    check_options(window, sinks, softcap, q)
    bm, bn = default_tiles(D)
    bm, bn = block_m or bm, block_n or bn
    if not (pow2(bm) and pow2(bn) and bm >= 16 and bn >= 16):
        raise ValueError(f"tile sizes must be powers of two >= 16, got BLOCK_M={bm}, BLOCK_N={bn}")
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    elif out.shape != (T, H, D) or out.dtype != q.dtype:
        raise ValueError(f"out must be [{T}, {H}, {D}] {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if T == 0 or S == 0:
        return out

    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    kc = k_cache.view(torch.uint8) if kv_fp8 else k_cache  # the bytes: decoded in the kernel
    vc = v_cache.view(torch.uint8) if kv_fp8 else v_cache
    grid = (T // bm + S, H)  # see the module docstring: shapes only, no device -> host sync
    _paged_prefill_kernel[grid](
        q, kc, vc, out, cu_seqlens_q, context_lens, block_tables, q if sinks is None else sinks,
        S, float(scale) * LOG2E, float(scale), int(window), float(softcap or 1.0),
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        block_tables.stride(0),
        GROUP=H // KV, BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn,
        KV_FP8=kv_fp8, IEEE_DOT=q.dtype == torch.float32, HAS_SINKS=sinks is not None, SOFTCAP=softcap > 0,
    )
    return out

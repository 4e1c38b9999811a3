"""Paged decode attention in Triton, split-K ("flash-decoding"): one query token per sequence attends to its whole
context where it lies in the paged KV cache, with no gathered copy and no mask tensor.

What the engine hands over (the contract of reference.paged_decode_attention, which the tests compare against):
row b attends to positions [0, context_lens[b]); position p lives at slot block_tables[b, p // block_size] *
block_size + p % block_size of a cache shaped [num_kv_heads, num_blocks, block_size, head_dim]
(inferd/kernels/paged.py documents the layout). The mask is computed from the row's length inside the kernel.

Why this shape of kernel:

- GQA grouping. A decode step is memory bound: every K/V byte of every context is read once per step, and the
  arithmetic per byte is tiny. So a program owns one KV head of one row and computes all `group = H // KV` query
  heads that share it: each K/V tile is read once per group instead of once per query head. The group is the M
  dimension of two tl.dot calls (q @ K^T, p @ V), padded to a power of two >= 16 (the smallest dot operand a GPU
  takes); the padding rows load zeros and are never stored. group 1 (multi-head) wastes most of that dot, which
  costs nothing measurable in a kernel bound by the K/V loads.
- Tiles. The context is walked in tiles of BLOCK_N positions, each position's slot gathered through the block
  table, so BLOCK_N is independent of the cache's block size (a tile spans several blocks, or part of one). An
  online softmax (running max and sum, float32, on exp2 with scale * log2(e) folded into the scores) keeps one pass.
- Split-K. With a small batch, B * KV programs cannot fill a GPU (SmolLM2 at batch 1: 3 programs). The context of
  each row is therefore cut into num_splits contiguous ranges (grid (B, KV, num_splits)), each a whole number of
  tiles, sized from that row's own length so a row's splits share its work evenly. Each program writes its partial
  (running max m, sum l, unnormalized output acc) to float32 scratch; a second small kernel merges the splits of a
  row by log-sum-exp (out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s) and stores q's dtype.
  A split past its row's length (a short row in a batch split for a long one) writes m = -inf, l = 0, acc = 0, which
  the merge weighs by exactly 0 (it never evaluates -inf - -inf). num_splits == 1 skips the scratch and the second
  launch: the one program normalizes and stores the output itself.
- The launch depends on shapes only (B, KV, the block table's width, num_splits): no device -> host read of
  context_lens (a sync on a GPU), so a CUDA graph can capture it. The num_splits heuristic (default_num_splits)
  uses the block table's width as the bound on the longest row for that reason.

Attention options (paged.attend's semantics, reference.paged_decode_attention's contract): a sliding window
(window > 0) moves the row's first position to max(0, len - window), and the splits share the tiles from there (the
ones before are never read; the num_splits heuristic bounds a row by the window); a soft-cap computes
softcap * tanh(scale * q.k / softcap) (tanh_f32: exp2 only, the interpreter has no libdevice) before the mask;
sinks (one logit per query head) start split 0's running max and sum (m = sink, l = 1, no value), so the merge
counts each sink once whatever the number of splits.

Float8 (e4m3fn) caches are read as their bytes (a uint8 view made on the host, so no float8 pointer type is needed)
and decoded to float32 with integer operations in the kernel, exactly for every finite code, subnormals included,
then cast to q's dtype (exact in fp32, fp16 and bf16: e4m3 has 3 mantissa bits and exponents -9..8) -- what the
reference (paged.gather_blocks) computes in. The two NaN codes (0x7F, 0xFF) decode as +-480; write_kv never stores
them from finite input.

Arithmetic: the scores and the output accumulate in float32 (tl.dot with a float32 accumulator; exact IEEE products
for float32 activations, no TF32), the softmax is float32, and the result is cast to q's dtype once at the end. For
fp16/bf16 activations the probabilities are rounded to q's dtype for the p @ V dot, as flash attention does.

Robustness without host checks: a context length past the block table's width is clamped to it (the kernel never
reads past a table row); a context length of 0 (outside the contract) yields zeros rather than NaN. Block ids are
not checked against the cache (the fused CPU op and the references are where bad tables are caught).

The module imports without triton (AVAILABLE is False then) so the engine can import it on any machine; only a call
fails. On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 when this module is imported:
@triton.jit reads it at decoration time), which is how tests/kernels/test_triton_decode.py checks them.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
    IMPORT_ERROR: str | None = None
except Exception as e:  # ImportError, or a broken install: the engine must still import this module
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    AVAILABLE = False
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
HEAD_DIMS = (32, 64, 128)
LOG2E = 1.4426950408889634  # the softmax runs on exp2: scores are pre-multiplied by scale * log2(e)
SM_COUNT_GUESS = 132  # an H100 SXM's SMs: the heuristic aims at ~2 programs per SM without asking the device
PROGRAMS_PER_SM = 2
MAX_SPLITS = 64  # bounds the scratch ([B, H, splits, D] float32) and the merge's tile


if AVAILABLE:

    @triton.jit
    def fp8e4m3fn_to_fp32(bits):
        """bits: a uint8 tile of float8_e4m3fn codes -> their float32 values, exactly, with integer ops only.

        A code is sign (bit 7), exponent e (bits 3-6, bias 7), mantissa m (bits 0-2). Normal codes (e > 0) are
        2^(e-7) * (1 + m/8): float32 bits sign << 31 | (e + 120) << 23 | m << 20, i.e. the 7 low bits shifted up by
        20 with 120 (= 127 - 7, the bias difference) added to the exponent field. Subnormal codes (e == 0) are
        m * 2^-9, computed from the small integer m rather than by building a float32 denormal, so a device that
        flushes denormals cannot change them."""
        b = bits.to(tl.uint32)
        magnitude = b & 0x7F
        sign = (b & 0x80) << 24
        normal = (sign | ((magnitude << 20) + (120 << 23))).to(tl.float32, bitcast=True)
        subnormal = (b & 0x7).to(tl.float32) * 0.001953125  # 2^-9: exact, m has 3 bits
        subnormal = tl.where(sign != 0, -subnormal, subnormal)
        return tl.where(magnitude >= 8, normal, subnormal)

    @triton.jit
    def tanh_f32(x):
        """tanh of a float32 tile from exp2 only (the interpreter has no libdevice): Cephes' tanhf, an odd polynomial
        below |x| = 0.625 (where 1 - 2 / (e^2x + 1) would cancel) and 1 - 2 / (e^2|x| + 1) above, a few ulp from
        torch's tanh; the same formula as cpu_ops.cpp's tanh_f32. For the soft-cap: softcap * tanh(s / softcap)."""
        a = tl.abs(x)
        z = x * x
        small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
                 - 3.33332819422e-1) * z * x + x
        big = 1.0 - 2.0 / (tl.exp2(a * 2.8853900817779268) + 1.0)  # e^(2|x|) = 2^(2 log2(e) |x|)
        return tl.where(a < 0.625, small, tl.where(x < 0, -big, big))

    @triton.jit
    def _fp8e4m3fn_to_fp32_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        """1-D decode of float8 bytes, through the same helper the attention kernel uses (tests check every code)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        bits = tl.load(src_ptr + offs, mask=ok, other=0)
        tl.store(dst_ptr + offs, fp8e4m3fn_to_fp32(bits), mask=ok)

    @triton.jit
    def _paged_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, bt_ptr, ctx_ptr, sinks_ptr,
        num_heads, num_splits, table_width, sm_scale_log2, sm_scale, window, softcap,
        stride_qb, stride_qh, stride_qd,
        stride_ob, stride_oh, stride_od,
        stride_kh, stride_kb, stride_kp, stride_kd,
        stride_vh, stride_vb, stride_vp, stride_vd,
        stride_bt, stride_btn, stride_ctx,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, IEEE_DOT: tl.constexpr, DIRECT: tl.constexpr,
        HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
    ):
        """Program (row b, KV head, split): the GROUP query heads of that KV head over the split's context range.
        DIRECT (num_splits == 1): store the normalized output; else store the partial (acc, m, l) to scratch laid
        out [B, H, num_splits, D] (acc) and [B, H, num_splits, 2] (m, l). The attention options (paged.attend):
        window > 0 keeps the row's last `window` positions (the splits share those tiles; none before is read);
        SOFTCAP: scores softcap * tanh(scale * q.k / softcap); HAS_SINKS: split 0 starts its running max and sum
        from the head's sink logit (m = sink, l = 1, no value), so the merge counts it once."""
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        ctx = tl.load(ctx_ptr + b * stride_ctx)
        ctx = tl.minimum(ctx, table_width * BLOCK_SIZE)  # never read past the row of the block table
        lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # the first position the row sees
        # this row's tiles (from lo) shared evenly by the splits; each split a whole number of tiles
        num_tiles = tl.cdiv(ctx - lo, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        start = lo + split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, ctx)  # <= start for a split past the row: no tiles

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        g_ok = offs_g < GROUP
        heads = kv_head * GROUP + offs_g  # the query heads of this KV head
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_ok[:, None], other=0.0)  # [GROUP_PAD, D]; padding rows are 0 (finite scores)

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        if HAS_SINKS:  # in log2 units, like the scores; padding rows get 0 (never stored)
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_i = tl.where(split == 0, sink, m_i)
            l_i = tl.where(split == 0, l_i + 1.0, l_i)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

        k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        for start_n in range(start, end, BLOCK_N):
            pos = start_n + tl.arange(0, BLOCK_N)
            pos_ok = pos < end  # position start_n < end is always valid: every tile has a finite score per row
            block = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_btn, mask=pos_ok, other=0).to(tl.int64)
            in_block = pos % BLOCK_SIZE
            k = tl.load(k_base + (block * stride_kb + in_block * stride_kp)[:, None] + offs_d[None, :] * stride_kd,
                        mask=pos_ok[:, None], other=0)  # [BLOCK_N, D]
            v = tl.load(v_base + (block * stride_vb + in_block * stride_vp)[:, None] + offs_d[None, :] * stride_vd,
                        mask=pos_ok[:, None], other=0)
            if KV_FP8:
                k = fp8e4m3fn_to_fp32(k)
                v = fp8e4m3fn_to_fp32(v)
            k = k.to(q.dtype)
            v = v.to(q.dtype)

            if IEEE_DOT:  # float32 activations: exact products, no TF32 rounding of the scores on a GPU
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if SOFTCAP:  # soft-capped before the mask, in natural units, then to log2 units
                s = tanh_f32((s * sm_scale) / softcap) * (softcap * 1.4426950408889634)
            else:
                s = s * sm_scale_log2
            s = tl.where(pos_ok[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_N]

            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the tile's first position is valid
            alpha = tl.exp2(m_i - m_new)  # exp2(-inf) = 0 on the first tile
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if IEEE_DOT:
                acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc += tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if DIRECT:
            l_safe = tl.where(l_i > 0, l_i, 1.0)  # l == 0 only for an empty context (outside the contract): zeros
            o = acc / l_safe[:, None]
            tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                     o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:
            part = (b.to(tl.int64) * num_heads + heads) * num_splits + split  # [GROUP_PAD]
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=g_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_ok)

    @triton.jit
    def _merge_splits_kernel(
        part_acc_ptr, part_ml_ptr, out_ptr,
        num_heads, num_splits,
        stride_ob, stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        """Program (row b, query head h): the log-sum-exp merge of that head's num_splits partials."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        s_ok = offs_s < num_splits
        part = (b.to(tl.int64) * num_heads + h) * num_splits + offs_s  # [SPLITS_PAD]
        m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
        l_part = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)

        m_max = tl.max(m, 0)  # finite whenever the row has a position (split 0 then holds one)
        # an empty split (m = -inf) weighs exactly 0; tl.where keeps -inf - -inf (NaN) out of an empty row
        w = tl.where(m > float("-inf"), tl.exp2(m - tl.where(m_max > float("-inf"), m_max, 0.0)), 0.0)
        l_sum = tl.sum(w * l_part, 0)
        o = tl.sum(w[:, None] * acc, 0) / tl.where(l_sum > 0, l_sum, 1.0)  # [HEAD_DIM]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d * stride_od,
                 o.to(out_ptr.dtype.element_ty))


def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: str) -> tuple[int, int, int, int, int]:
    """The checks both paged attention kernels make of q [rows, H, D] and the caches (ValueError, or RuntimeError
    without triton); returns (rows, H, D, KV, block_size)."""
    if not AVAILABLE:
        raise RuntimeError(f"triton is not available: {IMPORT_ERROR}")
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [{rows}, H, D] and caches [KV, blocks, block_size, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    n, H, D = q.shape
    KV, _, block_size, Dk = k_cache.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim {D} not supported (choose one of {HEAD_DIMS})")
    if Dk != D:
        raise ValueError(f"q has head_dim {D}, the cache {Dk}")
    if H % KV:
        raise ValueError(f"{H} query heads are not a multiple of {KV} KV heads")
    if not pow2(block_size):
        raise ValueError(f"block_size {block_size} is not a power of two")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported (choose one of {Q_DTYPES})")
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtypes {k_cache.dtype}/{v_cache.dtype} not supported (one of {KV_DTYPES})")
    return n, H, D, KV, block_size


def pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def default_block_n(block_size: int, head_dim: int) -> int:
    """Context positions per tile: 64 (32 at head_dim 128, so the K/V tiles stay within a program's registers),
    and never less than one KV block. Untuned starting points (no GPU benchmark yet)."""
    return max(block_size, 32 if head_dim >= 128 else 64)


def default_num_splits(batch: int, num_kv_heads: int, max_tiles: int) -> int:
    """Splits per row so that batch * num_kv_heads * splits programs reach ~PROGRAMS_PER_SM x SM_COUNT_GUESS (enough
    to keep every SM of a large GPU busy while hiding load latency), capped by max_tiles (the longest possible row's
    number of tiles: more splits would be empty for every row) and MAX_SPLITS; at least 1. A large batch gets 1: its
    rows alone fill the device, and the merge launch is skipped."""
    target = PROGRAMS_PER_SM * SM_COUNT_GUESS
    splits = -(-target // max(1, batch * num_kv_heads))
    return max(1, min(splits, max_tiles, MAX_SPLITS))


def dequantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """A float8_e4m3fn tensor -> float32, decoded by the kernels' own converter (what tests check code by code)."""
    if not AVAILABLE:
        raise RuntimeError(f"triton is not available: {IMPORT_ERROR}")
    if x.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a float8_e4m3fn tensor, got {x.dtype}")
    src = x.contiguous().view(torch.uint8).reshape(-1)
    dst = torch.empty(src.shape, dtype=torch.float32, device=x.device)
    n = src.numel()
    if n:
        block = 1024
        _fp8e4m3fn_to_fp32_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block)
    return dst.view(x.shape)


def check_options(window: int, sinks: torch.Tensor | None, softcap: float, q: torch.Tensor) -> None:
    """The attention options both paged attention kernels take (paged.attend's): ValueError when malformed."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: the whole context), got {window}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no soft-cap), got {softcap}")
    if sinks is not None:
        if sinks.shape != (q.shape[1],) or not sinks.dtype.is_floating_point or sinks.device != q.device:
            raise ValueError(f"sinks must be a floating [{q.shape[1]}] tensor on {q.device}, got "
                             f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int = 0,
                           sinks: torch.Tensor | None = None, softcap: float = 0.0, *,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           block_n: int | None = None) -> torch.Tensor:
    """One query token per row attending to its context in the paged cache -> [B, H, D] in q's dtype (written into
    `out` when given, any strides).

    q: [B, H, D] (fp32/fp16/bf16; any row and head strides, e.g. a view into the fused qkv rows);
    k_cache, v_cache: [KV, num_blocks, block_size, D] (fp32/fp16/bf16/float8_e4m3fn, any strides; block_size a power
    of two); block_tables: int32 [B, max_blocks] (padding entries are never read); context_lens: int32 [B], each
    >= 1 and <= max_blocks * block_size; scale: multiplies q . k (usually D ** -0.5).
    window, sinks ([H], any float dtype), softcap: the layer's attention options, as paged.attend computes them (a
    sliding window's tiles are the only ones read).
    num_splits: context splits per row (None: default_num_splits); block_n: positions per tile (a power of two >= 16,
    the smallest tl.dot operand on a GPU; None: default_block_n) -- tests use small ones to cover several tiles.
    """
    B, H, D, KV, block_size = check_paged_args(q, k_cache, v_cache, "B")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"expected block_tables [B, max_blocks] and context_lens [B] for B={B}, got "
                         f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    check_options(window, sinks, softcap, q)
    bn = block_n or default_block_n(block_size, D)
    if not (pow2(bn) and bn >= 16):
        raise ValueError(f"block_n must be a power of two >= 16, got {bn}")
    table_width = block_tables.shape[1]
    span = min(window, table_width * block_size) if window else table_width * block_size  # the longest row's
    max_tiles = -(-span // bn)
    splits = default_num_splits(B, KV, max_tiles) if num_splits is None else num_splits
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {splits}")
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    elif out.shape != (B, H, D) or out.dtype != q.dtype:
        raise ValueError(f"out must be [{B}, {H}, {D}] {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if B == 0 or H == 0:
        return out
    if table_width == 0:
        raise ValueError("block_tables has no columns: every row needs at least one block")

    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    kc = k_cache.view(torch.uint8) if kv_fp8 else k_cache  # the bytes: decoded in the kernel
    vc = v_cache.view(torch.uint8) if kv_fp8 else v_cache
    group = H // KV
    direct = splits == 1
    if direct:  # the kernel never touches the scratch pointers: pass out itself in their place
        part_acc = part_ml = out
    else:
        part_acc = torch.empty((B, H, splits, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((B, H, splits, 2), dtype=torch.float32, device=q.device)
    _paged_decode_split_kernel[(B, KV, splits)](
        q, kc, vc, out, part_acc, part_ml, block_tables, context_lens, q if sinks is None else sinks,
        H, splits, table_width, float(scale) * LOG2E, float(scale), int(window), float(softcap or 1.0),
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        block_tables.stride(0), block_tables.stride(1), context_lens.stride(0),
        GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_N=bn,
        KV_FP8=kv_fp8, IEEE_DOT=q.dtype == torch.float32, DIRECT=direct, HAS_SINKS=sinks is not None,
        SOFTCAP=softcap > 0,
    )
    if not direct:
        _merge_splits_kernel[(B, H)](
            part_acc, part_ml, out, H, splits,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=D, SPLITS_PAD=_next_pow2(splits),
        )
    return out

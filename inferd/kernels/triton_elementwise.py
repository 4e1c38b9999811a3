"""The three fused elementwise ops of a decoder layer in Triton: add_rms_norm, rope_kv_write and silu_mul, with the
contracts (signatures, what is modified in place, where results round) of their torch references in reference.py.

Every op here is memory bound: each input byte is read once and each output byte written once, and the arithmetic
per byte is a handful of flops. So the kernels are shaped for one pass over the data with no scratch, and for
rounding exactly where the reference rounds (the references are torch ops on CPU, each op computing in float32 for
fp16/bf16 tensors and rounding its result to the tensor's dtype):

- add_rms_norm: one program per row. A row is the hidden size wide (576, 2048, 4096, ...: not a power of two in
  general), so the program takes the whole row as one tile of BLOCK = next power of two >= n lanes, masked to n (the
  padding lanes load 0, add nothing to the sum of squares, and are never stored). The row's sum of squares needs the
  whole row before any output can be written, and one tile keeps that to one read of residual (and x) and one write
  of residual and the output. What rounds where, as the reference: residual + x is computed in float32 and rounded
  to the residual's dtype (torch's add_ in fp16/bf16), stored back in place, and that rounded value is what the
  norm reads; the statistics are float32 (sum of squares / n + eps, then 1 / sqrt(.) with IEEE-rounded sqrt and
  division, which is what torch.rsqrt computes on CPU); r * inv is rounded to the dtype before the multiply by
  weight, whose product is rounded again. Only the summation order of the sum of squares differs from torch's.
- rope_kv_write: one program per (token, head) over the H + 2 KV heads of the fused qkv row. A q or k program
  rotates its head in place (neox rotate-half: out[:h] = x[:h] cos[:h] - x[h:] sin[:h], out[h:] = x[h:] cos[h:] +
  x[:h] sin[h:], h = D / 2, with the [max_pos, D] cos/sin tables indexed by position and column, each
  product and the sum rounded to qkv's dtype as the reference's separate torch ops round them); a k program then
  stores its rotated head (as rounded into qkv) to the cache, a v program copies its head. The head is loaded as its
  two halves (tiles of next_pow2(D / 2) lanes, masked to D / 2), so the rotation needs no shuffles. Per-(token, head)
  programs keep the grid wide at decode (batch 1 still gets H + 2 KV programs) with no cross-program dependency:
  each program reads and writes only its own head. Tables R < D wide (partial rotary) rotate the head's first R dims
  (halves of R / 2) and a third tile carries the other D - R dims through to the cache. The cache write casts to
  the cache's dtype (round to nearest even: what torch's .to() does); a float8_e4m3fn cache is viewed as uint8 on
  the host and the kernel encodes the bits itself with integer operations (below), so no float8 pointer type or
  hardware conversion is needed.
  The launch passes enable_fp_fusion=False: with contraction on, the GPU compiler would fuse x * cos + r * sin into
  one FMA (one rounding instead of the reference's three), breaking bit equality in float32.
- silu_mul: one program per (row, BLOCK columns) of the [T, I] output; silu(gate) = gate / (1 + exp(-gate)) in
  float32 (torch's formula), rounded to the dtype (F.silu's output), then times up in float32, rounded again (the
  reference's `*`). The exp is the only difference from torch (another implementation of expf: the interpreter's
  numpy, a GPU's ex2.approx-based tl.exp).

Float8 encoding (_fp32_to_fp8e4m3fn) reproduces torch's float32 -> float8_e4m3fn cast bit for bit: round to nearest
even, subnormals included, finite values and infinities beyond the largest code saturating to +-448 (0x7E/0xFE),
NaN -> 0x7F with the input's sign. The same integer algorithm, written with torch integer ops, was checked against
torch 2.13's CPU cast on all 2^32 float32 bit patterns when this was written (0 differences; ~10 minutes, so not in
the suite); tests/kernels/test_triton_elementwise.py checks the kernel itself on every fp16 value, every rounding
midpoint +-1 ulp and random float32 patterns. Half and bfloat16 inputs go through float32 first, exactly, as torch's
cast does.

Validation: shapes, dtypes and strides are checked on the host with ValueErrors. Position and slot VALUES are checked
on the host only for CPU tensors (where the kernels run under Triton's interpreter, and a read out of bounds would
crash the process); on a GPU that check would be a device -> host sync per layer, so the kernel masks instead: a
token whose position is outside [0, max_pos) is left unrotated and not written, and a slot outside [0, num_slots)
is not written (never a read or write out of bounds).

Dtypes: fp32, fp16 and bf16 activations (bf16 only on a GPU: Triton 3.9's interpreter miscomputes bf16, so the
tests cover fp32 and fp16); caches fp32/fp16/bf16/float8_e4m3fn.

The module imports without triton (AVAILABLE is False then) so the engine can import it on any machine; only a call
fails. On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1 when this module is imported:
@triton.jit reads it at decoration time).
"""

from __future__ import annotations

import torch

# triton, or None where it does not import (AVAILABLE, IMPORT_ERROR): one guard, in the decode kernel's module
from .triton_decode import AVAILABLE, IMPORT_ERROR, tl, triton  # noqa: F401

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HIDDEN = 65536  # add_rms_norm holds a row in one tile
SILU_BLOCK = 1024  # output columns per silu_mul program (untuned: no GPU benchmark yet)


if AVAILABLE:

    @triton.jit
    def _fp32_to_fp8e4m3fn(x):
        """A float32 tile -> uint8 float8_e4m3fn codes, as torch's cast rounds them, with integer operations only.

        |x| >= 2^-6 (float32 exponent field >= 121, the float8 normal range): the 7 code bits are the float32 bits
        shifted down by 20 with the exponent rebased (-120 << 3), after rounding the 20 dropped bits to nearest even
        (add 0x7FFFF plus the kept lowest bit, then shift). |x| < 2^-6: the code is |x| * 2^9 rounded to nearest even
        as an integer (the subnormal step is 2^-9; a result of 8 is the smallest normal code, 0x08, as it should be):
        the 24-bit significand shifted right by 141 - exponent (>= 21; clamped to 31, where everything rounds to 0),
        with the same add-then-shift rounding. Then codes above 0x7E (448) saturate to 0x7E, infinities too, and
        NaN gives 0x7F; the sign bit is copied."""
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        exp = (mag >> 23).to(tl.int32)
        odd = (mag >> 20) & 1
        normal = ((mag + 0x7FFFF + odd) >> 20) - (120 << 3)
        sig = (mag & 0x7FFFFF) | 0x800000
        shift = tl.minimum(tl.maximum(141 - exp, 21), 31).to(tl.uint32)
        sub = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift
        code = tl.where(exp >= 121, normal, sub)
        code = tl.where(mag > 0x7F800000, 0x7F, tl.minimum(code, 0x7E))
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _fp8_encode_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        """1-D float -> float8 bytes through the encoder the KV write uses (tests check it against torch)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offs, _fp32_to_fp8e4m3fn(x), mask=ok)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, n_float, eps, stride_x, stride_r, stride_o,
                             HAS_X: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row): residual[row] += x[row] (rounded to the dtype, stored), out[row] = w * rmsnorm(residual)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0)
        if HAS_X:
            x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
            r = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_r + offs, r, mask=ok)
        r32 = r.to(tl.float32)
        ss = tl.sum(r32 * r32, 0)  # padding lanes are 0
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, n_float) + eps))
        y = (r32 * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference's r32.to(dtype)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_kv_write_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr,
                              num_heads, num_kv_heads, max_pos, num_slots,
                              stride_t, stride_cos, stride_sin,
                              stride_kh, stride_kb, stride_kp, stride_kd,
                              stride_vh, stride_vb, stride_vp, stride_vd,
                              HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST: tl.constexpr, REST_PAD: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr):
        """Program (token t, head): head < H + KV rotates its head of the qkv row in place; head >= H (a k or v
        head) writes its (rotated) values to its cache row at slot_mapping[t]. A head is D = 2 HALF + REST wide:
        the rotated dims (the tables' width, 2 HALF) and, with partial rotary, REST dims that pass through."""
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        pos_ok = (pos >= 0) & (pos < max_pos)
        offs = tl.arange(0, HALF_PAD)
        # masks as lane < scalar limit (0: nothing): the interpreter mistypes a tensor mask & a scalar bool
        ok = offs < tl.where(pos_ok, HALF, 0)
        row = qkv_ptr + t * stride_t + head * (2 * HALF + REST)
        x1 = tl.load(row + offs, mask=ok, other=0.0)
        x2 = tl.load(row + HALF + offs, mask=ok, other=0.0)
        offs_r = tl.arange(0, REST_PAD)
        if REST > 0:  # partial rotary: the unrotated tail of the head, copied to the cache as it is
            x3 = tl.load(row + 2 * HALF + offs_r, mask=offs_r < tl.where(pos_ok, REST, 0), other=0.0)
        dt = qkv_ptr.dtype.element_ty
        if head < num_heads + num_kv_heads:  # q or k: rotate in place
            safe_pos = tl.where(pos_ok, pos, 0)
            c1 = tl.load(cos_ptr + safe_pos * stride_cos + offs, mask=ok, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + safe_pos * stride_cos + HALF + offs, mask=ok, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + safe_pos * stride_sin + offs, mask=ok, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + safe_pos * stride_sin + HALF + offs, mask=ok, other=0.0).to(tl.float32)
            a1 = x1.to(tl.float32)
            a2 = x2.to(tl.float32)
            # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): each product and the sum rounded to dt
            o1 = ((a1 * c1).to(dt).to(tl.float32) + ((-a2) * s1).to(dt).to(tl.float32)).to(dt)
            o2 = ((a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)).to(dt)
            tl.store(row + offs, o1, mask=ok)
            tl.store(row + HALF + offs, o2, mask=ok)
            x1 = o1
            x2 = o2
        if head >= num_heads:  # k or v: to the cache
            slot = tl.load(slot_ptr + t).to(tl.int64)
            slot_ok = pos_ok & (slot >= 0) & (slot < num_slots)
            safe_slot = tl.where(slot_ok, slot, 0)
            block = safe_slot // BLOCK_SIZE
            in_block = safe_slot % BLOCK_SIZE
            # one masked store per cache (no branch-dependent pointers): a k head writes k_cache, a v head v_cache
            kv = head - num_heads
            is_k = kv < num_kv_heads
            h = tl.where(is_k, kv, kv - num_kv_heads).to(tl.int64)
            k_ok = offs < tl.where(slot_ok & is_k, HALF, 0)
            v_ok = offs < tl.where(slot_ok & (kv >= num_kv_heads), HALF, 0)
            if KV_FP8:
                y1 = _fp32_to_fp8e4m3fn(x1.to(tl.float32))
                y2 = _fp32_to_fp8e4m3fn(x2.to(tl.float32))
            else:
                y1 = x1.to(k_ptr.dtype.element_ty)
                y2 = x2.to(k_ptr.dtype.element_ty)
            k_dst = k_ptr + h * stride_kh + block * stride_kb + in_block * stride_kp
            v_dst = v_ptr + h * stride_vh + block * stride_vb + in_block * stride_vp
            tl.store(k_dst + offs * stride_kd, y1, mask=k_ok)
            tl.store(k_dst + (HALF + offs) * stride_kd, y2, mask=k_ok)
            tl.store(v_dst + offs * stride_vd, y1, mask=v_ok)
            tl.store(v_dst + (HALF + offs) * stride_vd, y2, mask=v_ok)
            if REST > 0:
                if KV_FP8:
                    y3 = _fp32_to_fp8e4m3fn(x3.to(tl.float32))
                else:
                    y3 = x3.to(k_ptr.dtype.element_ty)
                tl.store(k_dst + (2 * HALF + offs_r) * stride_kd, y3, mask=offs_r < tl.where(slot_ok & is_k, REST, 0))
                tl.store(v_dst + (2 * HALF + offs_r) * stride_vd, y3,
                         mask=offs_r < tl.where(slot_ok & (kv >= num_kv_heads), REST, 0))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_g, stride_o, BLOCK: tl.constexpr):
        """Program (row, column block): out = round(round(silu(gate)) * up) over BLOCK columns."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        g = tl.load(gu_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_g + n + offs, mask=ok, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        s = tl.div_rn(g, 1.0 + tl.exp(-g)).to(dt).to(tl.float32)  # F.silu's output, in the dtype
        tl.store(out_ptr + row * stride_o + offs, (s * u).to(dt), mask=ok)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _require_triton() -> None:
    if not AVAILABLE:
        raise RuntimeError(f"triton is not available: {IMPORT_ERROR}")


def _same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")


def to_fp8e4m3fn(x: torch.Tensor) -> torch.Tensor:
    """A float32/fp16/bf16 tensor -> float8_e4m3fn, encoded by the KV write's own encoder (what tests check against
    torch's cast)."""
    _require_triton()
    if x.dtype not in DTYPES:
        raise ValueError(f"expected a float32/fp16/bf16 tensor, got {x.dtype}")
    src = x.contiguous().reshape(-1)
    dst = torch.empty(src.shape, dtype=torch.uint8, device=x.device)
    n = src.numel()
    if n:
        block = 4096
        _fp8_encode_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block)
    return dst.view(torch.float8_e4m3fn).view(x.shape)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, rounded to residual's dtype) when x is given; returns weight * rmsnorm(residual) as a
    new contiguous tensor. residual: [rows, n] with contiguous rows (any row stride); x: the same shape and dtype
    (contiguous rows); weight: [n] of the same dtype, contiguous; n <= MAX_HIDDEN."""
    _require_triton()
    if residual.dim() != 2:
        raise ValueError(f"residual must be [rows, n], got shape {tuple(residual.shape)}")
    rows, n = residual.shape
    if residual.dtype not in DTYPES:
        raise ValueError(f"dtype {residual.dtype} not supported (choose one of {DTYPES})")
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden size {n} exceeds {MAX_HIDDEN} (one row is one tile)")
    if n > 1 and residual.stride(1) != 1:
        raise ValueError("residual's rows must be contiguous (stride 1 along the hidden dimension)")
    if weight.shape != (n,) or weight.dtype != residual.dtype or (n > 1 and weight.stride(0) != 1):
        raise ValueError(f"weight must be a contiguous [{n}] tensor of {residual.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype} stride {weight.stride()}")
    if x is not None:
        if x.shape != residual.shape or x.dtype != residual.dtype:
            raise ValueError(f"x must match residual ({tuple(residual.shape)} {residual.dtype}), got "
                             f"{tuple(x.shape)} {x.dtype}")
        if n > 1 and x.stride(1) != 1:
            raise ValueError("x's rows must be contiguous (stride 1 along the hidden dimension)")
    _same_device(x=x, residual=residual, weight=weight)
    out = torch.empty((rows, n), dtype=residual.dtype, device=residual.device)
    if rows == 0 or n == 0:
        return out
    block = _next_pow2(n)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    xa = residual if x is None else x  # never read without HAS_X
    _add_rms_norm_kernel[(rows,)](
        xa, residual, weight, out, n, float(n), float(eps), xa.stride(0), residual.stride(0), out.stride(0),
        HAS_X=x is not None, BLOCK=block, num_warps=warps, enable_fp_fusion=False,
    )
    return out


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                  num_kv_heads: int) -> None:
    """qkv [T, (H + 2 KV) D] (contiguous rows, any row stride): rotates its q and k heads in place (positions index the
    [max_pos, R] cos/sin tables, qkv's dtype, contiguous rows; R < D: partial rotary, each head's first R dims
    rotate and the rest pass through) and writes k (rotated) and v to their cache slots, cast to the cache's dtype.
    Caches [KV, num_blocks, block_size, D] (any strides, fp32/fp16/bf16/float8_e4m3fn, both alike); positions and
    slot_mapping: int32 or int64 [T]; slot = block * block_size + offset.
    """
    _require_triton()
    if qkv.dim() != 2 or k_cache.dim() != 4:
        raise ValueError(f"expected qkv [T, width] and caches [KV, blocks, block_size, D], got {tuple(qkv.shape)}, "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache differ: {tuple(k_cache.shape)} {k_cache.dtype} against "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    T, width = qkv.shape
    KV, num_blocks, block_size, D = k_cache.shape
    if qkv.dtype not in DTYPES:
        raise ValueError(f"qkv dtype {qkv.dtype} not supported (choose one of {DTYPES})")
    if k_cache.dtype not in KV_DTYPES:
        raise ValueError(f"cache dtype {k_cache.dtype} not supported (choose one of {KV_DTYPES})")
    if num_heads < 0 or num_kv_heads < 1 or KV != num_kv_heads:
        raise ValueError(f"the cache has {KV} KV heads; got num_heads={num_heads}, num_kv_heads={num_kv_heads}")
    if D < 2 or D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    if width != (num_heads + 2 * num_kv_heads) * D:
        raise ValueError(f"qkv width {width} != (num_heads + 2 * num_kv_heads) * head_dim = "
                         f"{(num_heads + 2 * num_kv_heads) * D}")
    if qkv.stride(1) != 1:
        raise ValueError("qkv's rows must be contiguous")
    for name, table in (("cos", cos), ("sin", sin)):
        if (table.dim() != 2 or not 0 < table.shape[1] <= D or table.shape[1] % 2 or table.dtype != qkv.dtype
                or table.stride(1) != 1):
            raise ValueError(f"{name} must be a [max_pos, R] table of {qkv.dtype} with contiguous rows (R even, at "
                             f"most head_dim {D}), got {tuple(table.shape)} {table.dtype} stride {table.stride()}")
    if sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.shape != (T,) or idx.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be an int32/int64 [{T}] tensor, got {tuple(idx.shape)} {idx.dtype}")
    _same_device(qkv=qkv, positions=positions, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                 slot_mapping=slot_mapping)
    max_pos, num_slots = cos.shape[0], num_blocks * block_size
    if T == 0:
        return
    if qkv.device.type == "cpu":  # free here (no device sync), and the interpreter must never read out of bounds
        if int(positions.min()) < 0 or int(positions.max()) >= max_pos:
            raise ValueError(f"a position is outside the rope tables [0, {max_pos})")
        if int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= num_slots:
            raise ValueError(f"a slot is outside the cache [0, {num_slots})")
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    kc = k_cache.view(torch.uint8) if kv_fp8 else k_cache  # the bytes: encoded in the kernel
    vc = v_cache.view(torch.uint8) if kv_fp8 else v_cache
    half = cos.shape[1] // 2  # of the rotated dims; the head's other D - 2 half dims pass through
    rest = D - 2 * half
    _rope_kv_write_kernel[(T, num_heads + 2 * num_kv_heads)](
        qkv, positions.contiguous(), cos, sin, kc, vc, slot_mapping.contiguous(),
        num_heads, num_kv_heads, max_pos, num_slots,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        HALF=half, HALF_PAD=_next_pow2(half), REST=rest, REST_PAD=_next_pow2(max(rest, 1)), BLOCK_SIZE=block_size,
        KV_FP8=kv_fp8,
        num_warps=1 if half <= 64 else 2, enable_fp_fusion=False,
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] (contiguous rows, any row stride) -> silu(gate) * up, a new contiguous [T, I] tensor."""
    _require_triton()
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"dtype {gate_up.dtype} not supported (choose one of {DTYPES})")
    T, n = gate_up.shape[0], gate_up.shape[1] // 2
    if n > 0 and gate_up.stride(1) != 1:
        raise ValueError("gate_up's rows must be contiguous")
    out = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0 or n == 0:
        return out
    block = min(SILU_BLOCK, _next_pow2(n))
    _silu_mul_kernel[(T, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                  num_warps=4, enable_fp_fusion=False)
    return out

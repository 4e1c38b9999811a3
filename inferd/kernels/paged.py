"""Reference paged-attention operators over the KV cache (CPU and any device torch runs on): the KV write, block
gathers (with the float8 dequantization), decode attention over gathered blocks and prefill attention through SDPA.

The cache of one layer is a pair of tensors shaped [num_kv_heads, num_blocks, block_size, head_dim]; a token's KV
lives at slot = block_id * block_size + offset. These are the references the fused kernels (cpu_ops.cpp's
paged_decode_attention, and the GPU kernels) are tested against, and the path where no fused kernel applies
(prefill chunks, float8 caches, batch-invariant mode). inferd/models/attention.py documents the layout and the
metadata a step carries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A one-byte float tensor as uint8, bit for bit (a view, no copy): torch 2.13 has no CPU index_copy_ for
    float8 types, and integer copies and gathers exist on every device."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, n_kv, d] written to their slots, cast to the cache's dtype (a no-op when it is theirs; float8
    saturates at +-448)."""
    n_kv, num_blocks, block_size, d = k_cache.shape
    for cache, new in ((k_cache, k), (v_cache, v)):
        _bits(cache).view(n_kv, num_blocks * block_size, d).index_copy_(
            1, slot_mapping, _bits(new.to(cache.dtype)).transpose(0, 1))


FP8_E4M3_TO_BF16_MASK = -0x7810  # 0x87F0 as int16: after a shift by 4, the sign bit and the 7 exponent+mantissa bits
FP8_E4M3_TO_BF16_SCALE = 2.0 ** 120  # bf16's exponent bias (127) less float8_e4m3fn's (7)


def dequantize(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[...] = x (a low-precision tensor) in out's dtype, exactly. On CPU, torch's float8_e4m3fn -> bf16 cast
    is scalar code (~5 ns per value here, ~35x a bf16 gather of the same values); the bit-level conversion below is
    ~8x faster (docs/benchmarks.md) and equal for every float8 value but the two NaN codes (which read as +-480;
    write_kv never stores NaN from finite input): the sign and 7 low bits moved into a bf16's sign, exponent and
    mantissa fields give the value x 2**-120, subnormals included, and a multiply by 2**120 (exact: a power of two)
    restores it."""
    if x.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        b = x.view(torch.int8).to(torch.int16)  # sign-extended: bit 15 is the sign
        b.bitwise_left_shift_(4).bitwise_and_(FP8_E4M3_TO_BF16_MASK)
        if out.dtype == torch.bfloat16:
            return torch.mul(b.view(torch.bfloat16), FP8_E4M3_TO_BF16_SCALE, out=out)
        return out.copy_(b.view(torch.bfloat16).mul_(FP8_E4M3_TO_BF16_SCALE))  # exact in fp16 and fp32 too
    return out.copy_(x)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """cache [n_kv, num_blocks, bs, d] -> [n_kv, len(block_ids), bs, d] in dtype (default: the cache's; another
    one dequantizes, head by head while the gathered bytes are still in cache). One dim-0 index_select per head:
    each head's blocks are contiguous rows, and a dim-0 gather of rows runs ~9x faster here than index_select on
    dim 1 of the 4-D tensor (19.6 MB: 1.1 ms against 9.9 ms, docs/benchmarks.md)."""
    n_kv, _, bs, d = cache.shape
    dtype = cache.dtype if dtype is None else dtype
    out = torch.empty((n_kv, block_ids.numel(), bs, d), dtype=dtype, device=cache.device)
    for h in range(n_kv):
        if dtype == cache.dtype:
            torch.index_select(cache[h], 0, block_ids, out=out[h])
        else:
            dequantize(torch.index_select(_bits(cache[h]), 0, block_ids).view(cache.dtype), out[h])
    return out


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float,
           sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Softmax attention with the options some families add, in the eager form transformers computes them (Gemma 2's
    soft-cap, gpt-oss's sinks). q [B, n, H, d]; keys, values [n_kv, B, ctx, d] (grouped-query: H = n_kv * group);
    allowed bool [B, n, ctx] (which keys each query row sees) -> [B, n, H, d]. Scores are scaled, soft-capped
    (softcap * tanh(s / softcap)) when softcap > 0, then masked; a head's sink logit (sinks [H]) joins the softmax's
    denominator and takes no value. The softmax runs in float32."""
    B, n, H, d = q.shape
    n_kv = keys.shape[0]
    group = H // n_kv
    qg = q.view(B, n, n_kv, group, d).permute(2, 0, 3, 1, 4)  # [n_kv, B, group, n, d]
    scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)) * scale  # [n_kv, B, group, n, ctx]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float().masked_fill(~allowed[None, :, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(n_kv, 1, group, 1, 1).expand(n_kv, B, group, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(values.dtype), values.unsqueeze(2))  # [n_kv, B, group, n, d]
    return out.permute(1, 3, 0, 2, 4).reshape(B, n, H, d)


def window_allowed(rows: torch.Tensor, cols: torch.Tensor, window: int) -> torch.Tensor:
    """Which key positions (cols) each query position (rows) sees: causal, and with window > 0 only the last
    `window` positions, its own included (transformers' sliding window: key > query - window)."""
    allowed = cols <= rows
    if window > 0:
        allowed &= cols > rows - window
    return allowed


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_indices: torch.Tensor,
                     mask: torch.Tensor, scale: float, window: int = 0, sinks: torch.Tensor | None = None,
                     softcap: float = 0.0) -> torch.Tensor:
    """q: [B, n_heads, d] -> [B, n_heads, d]. block_indices: [B * max_blocks] (each row's table padded to
    max_blocks); mask: [1, B, 1, max_blocks * block_size] additive (-inf past each row's context). window, sinks,
    softcap: the layer's attention options (attend); a row's context is the prefix its mask leaves open."""
    B, n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    idx = block_indices
    keys = gather_blocks(k_cache, idx, q.dtype).view(n_kv, B, -1, d)  # [n_kv, B, ctx, d]
    values = gather_blocks(v_cache, idx, q.dtype).view(n_kv, B, -1, d)
    if window > 0 or sinks is not None or softcap:
        open_ = mask.view(B, -1) == 0  # [B, width]: the prefix [0, len) of each row
        lens = open_.sum(-1, keepdim=True)
        cols = torch.arange(open_.shape[1], device=q.device).unsqueeze(0)
        allowed = window_allowed(lens - 1, cols, window).unsqueeze(1)  # the query sits at position len - 1
        return attend(q.unsqueeze(1), keys, values, allowed, scale, sinks, softcap).squeeze(1)
    qg = q.view(B, n_kv, group, d).transpose(0, 1)  # [n_kv, B, group, d]
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [n_kv, B, group, ctx]
    scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values)  # [n_kv, B, group, d]
    return out.transpose(0, 1).reshape(B, n_heads, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, num_cached: int, block_ids: torch.Tensor, scale: float, window: int = 0,
                      sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """One sequence's chunk. q: [n, n_heads, d]; k, v: the chunk's own [n, n_kv, d] -> [n, n_heads, d].
    A first chunk (nothing cached before it) attends to k, v as computed, in the activation dtype; a later chunk
    reads its whole context, its own new k/v included, back from the cache (dequantized to q's dtype). window,
    sinks, softcap: the layer's attention options (attend)."""
    n = q.shape[0]
    if num_cached == 0:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [n_kv, n, d]
    else:
        n_kv, _, block_size, d = k_cache.shape
        ctx = num_cached + n
        keys = gather_blocks(k_cache, block_ids, q.dtype).view(n_kv, -1, d)[:, :ctx]
        values = gather_blocks(v_cache, block_ids, q.dtype).view(n_kv, -1, d)[:, :ctx]
    # query i sits at absolute position num_cached + i and sees keys [0, num_cached + i]
    rows = torch.arange(n, device=q.device).unsqueeze(1) + num_cached
    cols = torch.arange(keys.shape[1], device=q.device).unsqueeze(0)
    if window > 0 or sinks is not None or softcap:
        allowed = window_allowed(rows, cols, window).unsqueeze(0)
        return attend(q.unsqueeze(0), keys.unsqueeze(1), values.unsqueeze(1), allowed, scale, sinks,
                      softcap).squeeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, n_heads, n, d]
    if num_cached == 0:
        out = F.scaled_dot_product_attention(qh, keys.unsqueeze(0), values.unsqueeze(0), is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qh, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=cols <= rows,
                                             scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def build_decode_mask(context_lens: list[int], max_blocks: int, block_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    width = max_blocks * block_size
    lens = torch.tensor(context_lens).unsqueeze(1)
    invalid = torch.arange(width).unsqueeze(0) >= lens  # [B, width]
    mask = torch.zeros(invalid.shape, dtype=dtype).masked_fill_(invalid, float("-inf"))
    return mask.view(1, len(context_lens), 1, width)

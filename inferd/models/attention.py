"""Attention over the paged KV cache: the metadata a step carries, the model's calls into the kernels, and the
attention block (Attention: q/k/v fused into one projection, RoPE and the cache write in one op, then attention
over the cache) that a decoder layer runs.

With the fused CPU kernels (inferd/kernels, the default where they build) decode rows attend through
paged_decode_attention, which reads each sequence's blocks where they lie (block tables + lengths). The reference
path, described below, is what runs elsewhere and what tests compare against.

The cache of one layer is a pair of tensors shaped [num_kv_heads, num_blocks, block_size, head_dim]. A token's KV
lives at slot = block_id * block_size + offset. Decode queries (one token per sequence) are batched: their blocks are
gathered in one index_select and attention runs as grouped batched matmuls, the query heads grouped per KV head,
which on CPU is several times faster than torch's SDPA kernel for one-token queries (docs/machines.md). Prefill chunks
run one sequence at a time through SDPA, which is compute-bound anyway.

The cache may be stored in a lower precision than the activations (`--kv-dtype`: bf16, fp16 or float8_e4m3fn):
write_kv casts the new k/v to the cache's dtype, and the readers dequantize the blocks they gather to the query's
dtype, so attention itself always computes in the activation dtype. A first prefill chunk attends to its own fresh
k/v, not to what was read back from the cache (as vLLM does); later chunks and decodes read the stored precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernels import REFERENCE, paged, reference
from ..kernels.paged import build_decode_mask, dequantize, gather_blocks, write_kv  # noqa: F401 - the model's API
from .batch_invariant import invariant_attention
from .config import ModelConfig
from .layers import Linear, RMSNorm


@dataclass
class PrefillSeq:
    start: int  # first row of this sequence's chunk in the flattened batch
    end: int  # one past its last row
    num_cached: int  # tokens of context already in the cache before this chunk
    block_ids: torch.Tensor | None  # [num_blocks_of_seq] long (None when the varlen kernel reads meta's tables)


@dataclass
class DecodeGroup:
    """Decode rows [start, end) whose block tables are padded to one length and attended together."""
    start: int
    end: int
    block_indices: torch.Tensor  # [B * max_blocks] long, padded with block 0
    mask: torch.Tensor  # [1, B, 1, max_blocks * block_size] additive mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot for each row's new KV
    num_decode_tokens: int = 0  # rows [0, num_decode_tokens) are one-token decodes, one per sequence
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # cover rows [0, num_decode_tokens)
    # with the fused kernels (kernels/): the decode rows' block tables (int32 [B, max_blocks], padded with block 0)
    # and context lengths (int32 [B]), read in place instead of decode_groups
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)
    # with a varlen prefill kernel (ops.prefill_varlen: Triton): every prefill chunk of the step in one call, the
    # chunks' rows [num_decode_tokens, T) in prefills' order: cumulative chunk lengths (int32 [S + 1], from 0),
    # context lengths after the chunk (int32 [S]) and block tables (int32 [S, max_blocks], padded with block 0)
    prefill_cu_seqlens: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None
    # batch-invariant mode (inferd/models/batch_invariant.py): build_groups' (single-row groups, shared segments);
    # when set, decode_groups and prefills are not used
    invariant: tuple | None = None
    # the other KV cache groups' metadata (their own slots and block tables: inferd/engine/kv_groups.py), by their
    # sliding window; a layer whose window is not here uses this one
    by_window: dict[int, AttentionMetadata] = field(default_factory=dict)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                     scale: float) -> torch.Tensor:
    """q: [B, n_heads, d] (the group's rows) -> [B, n_heads, d], over the group's gathered blocks."""
    return paged.decode_attention(q, k_cache, v_cache, g.block_indices, g.mask, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, seq: PrefillSeq, scale: float) -> torch.Tensor:
    """One sequence's chunk (kernels/paged.py's prefill_attention)."""
    return paged.prefill_attention(q, k, v, k_cache, v_cache, seq.num_cached, seq.block_ids, scale)


class Attention(nn.Module):
    """Grouped-query attention of one layer (num_key_value_heads KV heads shared by the query heads), with the
    options some families add, read from the config for this layer: a sliding window (Mistral, Gemma 2/3, gpt-oss),
    per-head sinks (gpt-oss), soft-capped scores (Gemma 2), q/k RMSNorm per head (Qwen3, Gemma 3), a scale of
    query_pre_attn_scalar ** -0.5 (Gemma). Where the step's ops do not take the options (ops.attention_options
    False) a layer that has them runs the references' attention."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        h, qkv = config.hidden_size, self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(h, qkv, config.attention_bias)
        self.o_proj = Linear(self.q_size, h, config.attention_output_bias)  # gpt-oss: with a bias
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.layer_window(layer)
        self.softcap = float(config.attn_logit_softcapping or 0.0)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if config.attention_sinks else None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.partial_rotary = config.rotary_dim < self.head_dim

    @property
    def plain(self) -> bool:
        """No option: what every kernel (the fused decode stack included) runs."""
        return not (self.window or self.softcap or self.sinks is not None or self.q_norm is not None
                    or self.partial_rotary)

    def options(self) -> dict:
        return dict(window=self.window, sinks=self.sinks, softcap=self.softcap)

    def forward(self, x, positions, meta: AttentionMetadata, k_cache, v_cache, ops, rotary):
        if meta.by_window:  # this layer's KV cache group has tables of its own
            meta = meta.by_window.get(self.window, meta)
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, q + k + v], rows contiguous
        if self.q_norm is not None:  # per head, before RoPE, in place in the fused rows
            q = qkv[:, :self.q_size].view(T, self.n_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.n_kv, self.head_dim)
            q.copy_(self.q_norm.forward(q))
            k.copy_(self.k_norm.forward(k))
        # RoPE on q and k in place, and k, v written to their cache slots: one op (kernels/)
        rope_kv_write = ops.rope_kv_write if ops.partial_rotary or not self.partial_rotary else REFERENCE.rope_kv_write
        rope_kv_write(qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping, self.n_heads,
                      self.n_kv)
        q = qkv[:, :self.q_size].view(T, self.n_heads, self.head_dim)
        options = {}
        if self.window or self.softcap or self.sinks is not None:
            options = self.options()
            if not ops.attention_options:
                ops = REFERENCE
        if meta.invariant is not None:  # batch-invariant mode: every row the same way (batch_invariant.py)
            if options:
                raise ValueError("batch-invariant mode does not run sliding windows, sinks or soft-capping")
            out = invariant_attention(q, k_cache, v_cache, meta.invariant, self.scale)
            return self.o_proj.forward(out.reshape(T, self.q_size))
        parts = []
        if meta.decode_tables is not None:  # the fused kernel reads the paged cache in place
            nd = meta.num_decode_tokens
            parts.append(ops.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_tables, meta.decode_lens,
                                                    self.scale, **options))
        else:
            parts.extend(paged.decode_attention(q[g.start:g.end], k_cache, v_cache, g.block_indices, g.mask,
                                                self.scale, **options)
                         for g in meta.decode_groups)
        if meta.prefill_tables is not None:  # every chunk in one call, read from the cache in place
            nd = meta.num_decode_tokens
            # the references' varlen contract, one sequence at a time, where the options sent a Triton step there
            prefill = ops.paged_prefill_attention or reference.paged_prefill_attention
            parts.append(prefill(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens, meta.prefill_context_lens,
                                 meta.prefill_tables, self.scale, **options))
        elif meta.prefills:
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.n_kv, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(T, self.n_kv, self.head_dim)
            for seq in meta.prefills:
                s, e = seq.start, seq.end
                parts.append(paged.prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, seq.num_cached,
                                                     seq.block_ids, self.scale, **options))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.o_proj.forward(out.reshape(T, self.q_size))

"""Attention over the paged KV cache: the metadata a step carries, and the model's calls into the kernels.

With the fused CPU kernels (inferd/kernels, the default where they build) decode rows attend through
paged_decode_attention, which reads each sequence's blocks where they lie (block tables + lengths). The reference
path, described below, is what runs elsewhere and what tests compare against.

The cache of one layer is a pair of tensors shaped [num_kv_heads, num_blocks, block_size, head_dim]. A token's KV
lives at slot = block_id * block_size + offset. Decode queries (one token per sequence) are batched: their blocks are
gathered in one index_select and attention runs as grouped batched matmuls, the query heads grouped per KV head,
which on CPU is several times faster than torch's SDPA kernel for one-token queries (PERF-NOTES.md). Prefill chunks
run one sequence at a time through SDPA, which is compute-bound anyway.

The cache may be stored in a lower precision than the activations (`--kv-dtype`: bf16, fp16 or float8_e4m3fn):
write_kv casts the new k/v to the cache's dtype, and the readers dequantize the blocks they gather to the query's
dtype, so attention itself always computes in the activation dtype. A first prefill chunk attends to its own fresh
k/v, not to what was read back from the cache (as vLLM does); later chunks and decodes read the stored precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels import paged
from ..kernels.paged import build_decode_mask, dequantize, gather_blocks, write_kv  # noqa: F401 - the model's API


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


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                     scale: float) -> torch.Tensor:
    """q: [B, n_heads, d] (the group's rows) -> [B, n_heads, d], over the group's gathered blocks."""
    return paged.decode_attention(q, k_cache, v_cache, g.block_indices, g.mask, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, seq: PrefillSeq, scale: float) -> torch.Tensor:
    """One sequence's chunk (kernels/paged.py's prefill_attention)."""
    return paged.prefill_attention(q, k, v, k_cache, v_cache, seq.num_cached, seq.block_ids, scale)

"""Batch-invariant computation (`--batch-invariant`): a sequence's logits do not depend on what it is batched with,
nor on whether its context was computed by prefill (in chunks of any size) or by decode. So greedy and seeded
streams replay exactly in bf16 too: a failover replay recomputes the journal by prefill, in other batches, and must
land on the same tokens.

Floating-point sums depend on their order, and a kernel's order depends on the shapes it is given: a matmul over
M rows picks its blocking from M, an attention over a padded context reduces over the padded length. Two changes
take every shape that varied with the batch out of a row's arithmetic:

- Linear layers (and the LM head) run over fixed tiles of TILE_ROWS rows (the last tile zero-padded): every call
  has the same M, so the kernel's blocking (and with it each row's reduction order over the hidden size) never
  changes; rows of a matmul never mix.
- Attention: every query row, decode or prefill alike, attends to its own context read back from the paged cache,
  padded to its own block count, in float32: rows with the same block count are computed together by batched
  matmuls whose per-entry shapes depend only on that count (the batch dimension does not reorder anything inside
  an entry); masked keys contribute exact zeros.

Row-wise operations (RMSNorm, RoPE, SiLU, the residual adds, the sampler) are invariant already. The cost is
measured by bench/batch_invariant.py (docs/benchmarks.md); the mode is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import gather_blocks

TILE_ROWS = 16  # rows per Linear call in batch-invariant mode


def tiled_rows(fn, x: torch.Tensor, tile: int = TILE_ROWS) -> torch.Tensor:
    """fn over x [T, ...] in calls of exactly `tile` rows (the last one zero-padded); the T result rows."""
    T = x.shape[0]
    pad = (-T) % tile
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    if x.shape[0] == tile:
        return fn(x)[:T]
    return torch.cat([fn(x[i:i + tile]) for i in range(0, x.shape[0], tile)], dim=0)[:T]


@dataclass
class InvariantGroup:
    """Query rows whose contexts span the same number of blocks."""
    rows: torch.Tensor  # [R] long: rows of the step
    block_ids: torch.Tensor  # [R * num_blocks] long: each row's block table
    mask: torch.Tensor  # [1, R, 1, num_blocks * block_size] float32: -inf past each row's context
    num_blocks: int


def build_groups(contexts: list[tuple[int, list[int]]], block_size: int, device) -> list[InvariantGroup]:
    """contexts: per query row, (context length including itself, its block table)."""
    by_blocks: dict[int, list[int]] = {}
    for row, (ctx, _) in enumerate(contexts):
        by_blocks.setdefault(-(-ctx // block_size), []).append(row)
    groups = []
    for nb, rows in sorted(by_blocks.items()):
        width = nb * block_size
        lens = torch.tensor([contexts[r][0] for r in rows]).unsqueeze(1)
        mask = torch.zeros(len(rows), width).masked_fill_(torch.arange(width).unsqueeze(0) >= lens, float("-inf"))
        groups.append(InvariantGroup(
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor([b for r in rows for b in contexts[r][1][:nb]], dtype=torch.long, device=device),
            mask.view(1, len(rows), 1, width).to(device), nb))
    return groups


def invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        groups: list[InvariantGroup], scale: float) -> torch.Tensor:
    """q: [T, n_heads, d] -> [T, n_heads, d]; each row attends to its context in the cache (its own new KV is
    already written there), in float32."""
    T, n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    for g in groups:
        R = g.rows.numel()
        keys = gather_blocks(k_cache, g.block_ids, torch.float32).view(n_kv, R, -1, d)  # [n_kv, R, L, d]
        values = gather_blocks(v_cache, g.block_ids, torch.float32).view(n_kv, R, -1, d)
        qg = q.index_select(0, g.rows).float().view(R, n_kv, group, d).transpose(0, 1)  # [n_kv, R, group, d]
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale + g.mask  # [n_kv, R, group, L]
        probs = torch.softmax(scores, dim=-1)
        rows_out = torch.matmul(probs, values)  # [n_kv, R, group, d]
        out.index_copy_(0, g.rows, rows_out.transpose(0, 1).reshape(R, n_heads, d).to(q.dtype))
    return out


def enable(model: torch.nn.Module) -> None:
    """Switches a model's Linear layers to fixed row tiles."""
    from .llama import Linear

    for module in model.modules():
        if isinstance(module, Linear):
            module.tile_rows = TILE_ROWS

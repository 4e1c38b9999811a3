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
  padded to its own block count, in float32: its products are entries [group, d] x [d, L] of batched matmuls,
  L fixed by that count (the batch dimension does not reorder anything inside an entry: measured, bitwise, in
  tests/engine/test_batch_invariant.py); masked keys contribute exact zeros. Single rows with the same block count
  are batched across sequences; a prefill chunk's rows within one block share one read of their context.

Row-wise operations (RMSNorm, RoPE, SiLU, the residual adds, the sampler) are invariant already. The cost is
measured by bench/batch_invariant.py (docs/benchmarks.md); the mode is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.paged import gather_blocks
from .layers import Linear

TILE_ROWS = 16  # rows per Linear call in batch-invariant mode


@dataclass
class InvariantGroup:
    """Single query rows (decodes, mostly) whose contexts span the same number of blocks, each read on its own."""
    rows: torch.Tensor  # [R] long: rows of the step
    block_ids: torch.Tensor  # [R * num_blocks] long: each row's block table
    mask: torch.Tensor  # [1, R, 1, num_blocks * block_size] float32: -inf past each row's context
    num_blocks: int


@dataclass
class SharedSegment:
    """Consecutive query rows of one sequence whose contexts span the same blocks (a prefill chunk's rows within
    one block): their context is read once and multiplied through a stride-0 batch, the same [group, d] x [d, L]
    products as a lone row's, without a copy per row (which made long prompts quadratic in memory traffic)."""
    start: int
    end: int  # rows [start, end)
    block_ids: torch.Tensor  # [num_blocks] long
    mask: torch.Tensor  # [R, 1, num_blocks * block_size] float32: -inf past each row's context


def _mask(lens: list[int], width: int) -> torch.Tensor:
    """[len(lens), width] float32: 0 up to each row's context length, -inf past it (masked keys weigh exactly 0)."""
    lens_t = torch.tensor(lens).unsqueeze(1)
    return torch.zeros(len(lens), width).masked_fill_(torch.arange(width).unsqueeze(0) >= lens_t, float("-inf"))


def build_groups(seqs: list[tuple[int, int, list[int]]], block_size: int, device
                 ) -> tuple[list[InvariantGroup], list[SharedSegment]]:
    """seqs: per sequence of the step, in row order, (position of its first query row, its number of query rows,
    its block table). Rows are cut where their context reaches another block: runs of two or more rows become
    shared segments, single rows are grouped by block count across sequences."""
    singles: dict[int, list[tuple[int, int, list[int]]]] = {}  # block count -> (row, context length, blocks)
    segments = []
    row = 0
    for start, n, blocks in seqs:
        j = 0
        while j < n:
            nb = (start + j) // block_size + 1  # blocks spanned by the context of query j (position start + j)
            k = min(n, nb * block_size - start)  # rows j..k-1 stay within those blocks
            if k - j == 1:
                singles.setdefault(nb, []).append((row + j, start + j + 1, blocks))
            else:
                segments.append(SharedSegment(
                    row + j, row + k, torch.tensor(blocks[:nb], dtype=torch.long, device=device),
                    _mask(list(range(start + j + 1, start + k + 1)), nb * block_size).unsqueeze(1).to(device)))
            j = k
        row += n
    groups = []
    for nb, entries in sorted(singles.items()):
        R = len(entries)
        groups.append(InvariantGroup(
            torch.tensor([r for r, _, _ in entries], dtype=torch.long, device=device),
            torch.tensor([b for _, _, blocks in entries for b in blocks[:nb]], dtype=torch.long, device=device),
            _mask([n for _, n, _ in entries], nb * block_size).view(1, R, 1, -1).to(device), nb))
    return groups, segments


def invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: tuple[list[InvariantGroup], list[SharedSegment]], scale: float) -> torch.Tensor:
    """q: [T, n_heads, d] -> [T, n_heads, d]; each row attends to its context in the cache (its own new KV is
    already written there), in float32. Every row's products are [group, d] x [d, L] entries of a batched matmul
    whatever the path, with L fixed by its block count."""
    groups, segments = plan
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
    for s in segments:
        R = s.end - s.start
        keys = gather_blocks(k_cache, s.block_ids, torch.float32).view(n_kv, -1, d)  # [n_kv, L, d]
        values = gather_blocks(v_cache, s.block_ids, torch.float32).view(n_kv, -1, d)
        qs = q[s.start:s.end].float().view(R, n_kv, group, d)
        L = keys.shape[1]
        for h in range(n_kv):  # a stride-0 batch cannot span heads: one batched matmul per KV head
            scores = torch.bmm(qs[:, h], keys[h].expand(R, L, d).transpose(1, 2)) * scale + s.mask  # [R, group, L]
            rows_out = torch.bmm(torch.softmax(scores, dim=-1), values[h].expand(R, L, d))  # [R, group, d]
            out[s.start:s.end, h * group:(h + 1) * group] = rows_out.to(q.dtype)
    return out


def enable(model: torch.nn.Module, on: bool = True) -> None:
    """Switches a model's Linear layers to fixed row tiles (on) or back to one call per step (off). A mixture of
    experts is refused: its experts' matmuls are over however many rows picked each expert, which the batch decides."""
    if on and any(hasattr(m, "quantize_experts") for m in model.modules()):  # models/moe.py's SparseMoE
        raise ValueError("--batch-invariant does not run mixture-of-experts models (Mixtral, Qwen3-MoE, gpt-oss)")
    for module in model.modules():
        if isinstance(module, Linear):
            module.tile_rows = TILE_ROWS if on else None
    if hasattr(model, "forget_decode_stacks"):
        # a tiled Linear has no decode_layers entry; the engine calls this on every model it takes, so its lists
        # are built again from the model as that engine finds it
        model.forget_decode_stacks()

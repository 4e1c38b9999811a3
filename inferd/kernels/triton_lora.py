"""The LoRA operator in Triton (Punica's BGMV: one row, one adapter): `lora_add`, with the contract of
reference.lora_add (y [T, out] += each row's own adapter's delta; models/lora.py's docstring has the slot layout of
the stacked buffers a [S, P R, in] and bt [S, R out]).

The per-row form. The reference runs a segmented matmul per slot over the rows grouped by slot (perm, seg_slots,
seg_starts: Punica's SGMV), which needs the groups' bounds on the host. Here every program reads its own row's slot
from row_slots (int32 [T], -1: the base model's row, nothing added), so a step mixes any slots in any order with no
loop over requests or slots on the host and no host read of the step: two launches per projection, whatever the
step holds.

- shrink: grid (T, P R / BLOCK_J, SPLIT_K). Program (t, jb, split) computes xa[split, t, j] = sum_k x[t, k] a[s, j, k]
  for its BLOCK_J rows j of the slot's A (j < P r, r = ranks[s]: a slot's A is compact, its first P r rows), over
  its split's range of k in BLOCK_K tiles, in float32, into a float32 scratch xa [SPLIT_K, T, P R]. A block wholly
  past P r (a slot of rank below the max) exits at once; so does a base row's program. Split-K: a decode step has
  a few rows, each a long k loop (in = the hidden size), so T * P R / BLOCK_J programs cannot fill a GPU; the k
  range is cut into SPLIT_K pieces (a power of two, at most MAX_SPLIT_K) until the programs reach ~2 per SM
  (split_k_for; 1 for a prefill of many rows). A split past K stores zeros.
- expand: grid (T, out / BLOCK_C). Program (t, cb) takes BLOCK_C output columns; column c lies in part p (the parts
  are at most 3: p, its first column off_p and its size_p come from comparing c with the parts' boundaries, passed
  as scalars). For each part it sums its r values of xa over the splits, then y[t, c] += sum_{i < r} xa[t, p r + i]
  bt[s, r off_p + i size_p + c - off_p]: a [BLOCK_R, BLOCK_C] tile (BLOCK_R = the max rank rounded up to a power of
  two) masked to i < r, summed over i.

Rounding, as the reference rounds (its two matmuls in y's dtype, then an add in y's dtype): xa is accumulated in
float32 (the splits' partial sums too) and rounded to the dtype once summed, the delta is accumulated in float32 and
rounded to y's dtype, and y + delta is computed in float32 and rounded once. For float32 every rounding is a no-op;
only the summation orders differ from torch's.

No device -> host sync: the launch depends on shapes only (T, P, R, in, out) and on the host lists' values (the
parts, and the ranks, which go to the device as a small int32 table kept per distinct list, so a step whose ranks
have not changed copies nothing: a CUDA graph may capture it, once a step with the same ranks has run before the
capture). Robustness without host checks: a slot outside
[0, S) is treated as a base row, a rank above R is clamped to R (never a read out of the buffers).

Per row means each row reads its slot's A and B itself: for decode (one row per request) that is the right shape
(memory bound, and A and B are small); a long prefill of one adapter re-reads the same A per row, where an SGMV
kernel (a row block per slot through tl.dot) would read it once per block. Block sizes are untuned (no GPU benchmark
in this project yet).

The module imports without triton (AVAILABLE is False then); on a CPU the kernels run only under Triton's
interpreter (TRITON_INTERPRET=1), how tests/kernels/test_triton_lora.py checks them.
"""

from __future__ import annotations

import torch

from .triton_decode import AVAILABLE, IMPORT_ERROR, PROGRAMS_PER_SM, SM_COUNT_GUESS, tl, triton  # noqa: F401

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_PARTS = 3  # qkv_proj's q, k, v: the most parts a fused projection has (the expand kernel compares with 2 bounds)
BLOCK_J = 64  # shrink: rows of A (P r of them) per program
BLOCK_K = 128  # shrink: input features per step of the k loop
BLOCK_C = 128  # expand: output columns per program
MAX_SPLIT_K = 16  # shrink: k ranges per row at most (the expand sums that many partial xa per row)
RANK_TABLES_KEPT = 64  # distinct ranks lists kept on each device (they change only when an adapter is loaded)

_rank_tables: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


if AVAILABLE:

    @triton.jit
    def _lora_shrink_kernel(x_ptr, a_ptr, xa_ptr, row_slots_ptr, ranks_ptr, num_slots, max_rank, num_parts, K,
                            k_per_split, stride_x, stride_as, stride_aj, stride_xs, stride_xa,
                            BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (t, jb, split): xa[split, t, j] = sum over the split's k range of x[t, k] a[s, j, k], float32."""
        t = tl.program_id(0).to(tl.int64)
        j0 = tl.program_id(1) * BLOCK_J
        split = tl.program_id(2)
        s = tl.load(row_slots_ptr + t)
        if (s >= 0) & (s < num_slots):
            r = tl.minimum(tl.load(ranks_ptr + s), max_rank)
            rows = num_parts * r  # the slot's A: its first P r rows
            if j0 < rows:
                offs_j = j0 + tl.arange(0, BLOCK_J)
                j_ok = offs_j < rows
                a_row = a_ptr + s.to(tl.int64) * stride_as + offs_j.to(tl.int64) * stride_aj
                acc = tl.zeros((BLOCK_J,), dtype=tl.float32)
                k_start = split * k_per_split
                for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):  # empty past K: zeros
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    k_ok = offs_k < K
                    xk = tl.load(x_ptr + t * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                    ak = tl.load(a_row[:, None] + offs_k[None, :], mask=j_ok[:, None] & k_ok[None, :],
                                 other=0.0).to(tl.float32)
                    acc += tl.sum(ak * xk[None, :], 1)
                tl.store(xa_ptr + split * stride_xs + t * stride_xa + offs_j, acc, mask=j_ok)

    @triton.jit
    def _lora_expand_kernel(y_ptr, xa_ptr, bt_ptr, row_slots_ptr, ranks_ptr, num_slots, max_rank, num_parts, N,
                            off1, off2, stride_y, stride_xs, stride_xa, stride_bs,
                            SPLIT_K: tl.constexpr, MAX_PARTS: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr):
        """Program (t, cb): y[t, c] += sum_{i < r} xa[t, p r + i] bt[s, r off_p + i size_p + c - off_p] over its
        BLOCK_C columns, xa summed over the splits and rounded to the dtype first."""
        t = tl.program_id(0).to(tl.int64)
        s = tl.load(row_slots_ptr + t)
        if (s >= 0) & (s < num_slots):
            r = tl.minimum(tl.load(ranks_ptr + s), max_rank)
            offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            c_ok = offs_c < N
            # column c's part: 0 below off1, 1 below off2, else 2 (off1 = off2 = N for one part, off2 = N for two)
            in1 = offs_c >= off1
            in2 = offs_c >= off2
            p = in1.to(tl.int32) + in2.to(tl.int32)
            off = tl.where(in2, off2, tl.where(in1, off1, 0))
            size = tl.where(in2, N, tl.where(in1, off2, off1)) - off
            offs_i = tl.arange(0, BLOCK_R)
            i_ok = offs_i < r
            offs_sp = tl.arange(0, SPLIT_K)
            # each part's r values of xa (summed over the splits, rounded as the reference's shrink rounds), then
            # spread to the columns of that part
            xa = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
            for q in tl.static_range(MAX_PARTS):
                q_ok = i_ok & (q * r + offs_i < num_parts * r)  # part q exists (q < P)
                v = tl.load(xa_ptr + offs_sp[:, None] * stride_xs + t * stride_xa + q * r + offs_i[None, :],
                            mask=q_ok[None, :], other=0.0)
                xq = tl.sum(v, 0).to(y_ptr.dtype.element_ty).to(tl.float32)
                xa = tl.where((p == q)[None, :], xq[:, None], xa)
            m = i_ok[:, None] & c_ok[None, :]
            b_idx = r * off[None, :] + offs_i[:, None] * size[None, :] + (offs_c - off)[None, :]
            b = tl.load(bt_ptr + s.to(tl.int64) * stride_bs + b_idx.to(tl.int64), mask=m, other=0.0).to(tl.float32)
            delta = tl.sum(xa * b, 0).to(y_ptr.dtype.element_ty).to(tl.float32)  # the expand's rounding
            y_row = y_ptr + t * stride_y + offs_c
            yv = tl.load(y_row, mask=c_ok, other=0.0).to(tl.float32)
            tl.store(y_row, (yv + delta).to(y_ptr.dtype.element_ty), mask=c_ok)


def _require_triton() -> None:
    if not AVAILABLE:
        raise RuntimeError(f"triton is not available: {IMPORT_ERROR}")


def split_k_for(programs: int, k_tiles: int) -> int:
    """Splits of the shrink's k loop (a power of two, at most MAX_SPLIT_K and the k tiles) so that its programs
    reach ~PROGRAMS_PER_SM x SM_COUNT_GUESS: a decode step has few rows, each a long k loop."""
    want = max(1, min(MAX_SPLIT_K, k_tiles, PROGRAMS_PER_SM * SM_COUNT_GUESS // max(1, programs)))
    return 1 << (want.bit_length() - 1)


def rank_table(ranks: list[int], device: torch.device) -> torch.Tensor:
    """The ranks as an int32 tensor on device, made once per distinct list (a copy to a GPU each call would be a
    host -> device transfer per projection)."""
    key = (device, tuple(int(r) for r in ranks))
    table = _rank_tables.get(key)
    if table is None:
        if len(_rank_tables) >= RANK_TABLES_KEPT:
            _rank_tables.clear()
        table = _rank_tables[key] = torch.tensor(key[1], dtype=torch.int32, device=device)
    return table


def lora_add(y: torch.Tensor, x: torch.Tensor, perm: torch.Tensor, seg_slots: list[int], seg_starts: list[int],
             row_slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, ranks: list[int], parts: list[int]) -> None:
    """reference.lora_add's contract, per row: y [T, out] += each row's adapter's delta, row t through slot
    row_slots[t] (-1: none). perm, seg_slots and seg_starts (the reference's grouping) are not read: row_slots says
    the same per row."""
    del perm, seg_slots, seg_starts
    _require_triton()
    T, K = x.shape
    N = y.shape[1]
    S, PR = a.shape[0], a.shape[1]
    P = len(parts)
    if y.dtype not in DTYPES or x.dtype != y.dtype or a.dtype != y.dtype or bt.dtype != y.dtype:
        raise ValueError(f"y, x, a and bt must share one dtype of {DTYPES}, got {y.dtype}, {x.dtype}, {a.dtype}, "
                         f"{bt.dtype}")
    if not 1 <= P <= MAX_PARTS or PR % P or sum(parts) != N:
        raise ValueError(f"parts {parts} must be 1 to {MAX_PARTS} sizes summing to y's {N} columns, dividing a's "
                         f"{PR} rows")
    R = PR // P
    if (y.shape[0] != T or a.shape[2] != K or tuple(bt.shape) != (S, R * N) or tuple(row_slots.shape) != (T,)
            or row_slots.dtype != torch.int32 or len(ranks) != S):
        raise ValueError(f"shapes: y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, bt {tuple(bt.shape)}, "
                         f"row_slots {tuple(row_slots.shape)} {row_slots.dtype}, {len(ranks)} ranks")
    if y.stride(1) != 1:
        raise ValueError(f"y must have contiguous rows (it is added to in place), got stride {y.stride()}")
    if T == 0 or R == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    a, bt, row_slots = a.contiguous(), bt.contiguous(), row_slots.contiguous()
    ranks_t = rank_table(ranks, y.device)
    block_j = min(BLOCK_J, triton.next_power_of_2(PR))
    block_k = min(BLOCK_K, triton.next_power_of_2(K))
    j_blocks = triton.cdiv(PR, block_j)
    k_tiles = triton.cdiv(K, block_k)
    split_k = split_k_for(T * j_blocks, k_tiles)
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    xa = torch.empty(split_k, T, PR, dtype=torch.float32, device=y.device)
    _lora_shrink_kernel[(T, j_blocks, split_k)](
        x, a, xa, row_slots, ranks_t, S, R, P, K, k_per_split, x.stride(0), a.stride(0), a.stride(1), xa.stride(0),
        xa.stride(1), BLOCK_J=block_j, BLOCK_K=block_k)
    bounds = [sum(parts[:i + 1]) for i in range(P - 1)] + [N] * (MAX_PARTS - P)  # off1, off2
    block_c = min(BLOCK_C, triton.next_power_of_2(N))
    _lora_expand_kernel[(T, triton.cdiv(N, block_c))](
        y, xa, bt, row_slots, ranks_t, S, R, P, N, bounds[0], bounds[1], y.stride(0), xa.stride(0), xa.stride(1),
        bt.stride(0), SPLIT_K=split_k, MAX_PARTS=MAX_PARTS, BLOCK_R=triton.next_power_of_2(R), BLOCK_C=block_c)

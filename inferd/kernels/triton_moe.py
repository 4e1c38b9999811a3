"""The fused MoE experts in Triton (vLLM's fused_moe scheme): one grouped GEMM launch for all active experts' gate/up
matmuls, the activation, one grouped GEMM launch for their down matmuls (weighted by the routing weights), and the
sum over each token's k slots. The block (inferd/models/moe.py) calls `fused_moe` when its ops namespace has it
(kernels.triton_ops(): the Triton kernels); the torch path (one F.linear per active expert) is the reference.

Layout. Pairs p = token * k + slot (P = T * k of them) are sorted by expert and padded per expert to BLOCK_M rows
(align_by_expert): sorted_pairs [max_padded] holds pair indices, P in the padding; block_experts [max_padded /
BLOCK_M] the expert of each row block, -1 past the last. The buffers are sized for the worst case (P + E (BLOCK_M - 1)
rows) so building them needs no device -> host sync: on a GPU the whole step stays asynchronous.

Kernel: one program per (row block, BLOCK_N output columns). It reads its block's expert, the BLOCK_M pair indices,
gathers their input rows (row = pair // ROW_DIV: the token for gate/up, the pair itself for down), runs the
[BLOCK_M, K] x [K, BLOCK_N] product over K in BLOCK_K steps against that expert's [N, K] weight, adds the expert's
bias, multiplies by the pair's routing weight when asked, and writes the rows to out[pair]. Blocks past the last
expert exit at once; padding rows are masked. Float32 inputs multiply with input_precision="ieee" (no TF32: the
reference is a float32 matmul). Block sizes are untuned (no GPU benchmark in this project yet): BLOCK_M 16 for steps
of up to 64 pairs per expert on average, 64 above; BLOCK_N 64; BLOCK_K 32.

Experts outside the block's range (expert parallelism) come in as id E (= the block's local expert count): they get
no rows, so their pairs' outputs stay zero. On a CPU the kernel runs only under Triton's interpreter
(TRITON_INTERPRET=1), how tests/kernels/test_triton_moe.py checks it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .triton_decode import AVAILABLE, IMPORT_ERROR, tl, triton  # noqa: F401

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_N = 64
BLOCK_K = 32
SMALL_BLOCK_M = 16  # tl.dot's smallest tile
LARGE_BLOCK_M = 64
LARGE_ROWS_PER_EXPERT = 64  # pairs per expert (on average) from which the larger row block is used


if AVAILABLE:

    @triton.jit
    def _moe_gemm_kernel(a_ptr, w_ptr, bias_ptr, route_w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs,
                         N, K, stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_om,
                         ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTE: tl.constexpr,
                         IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if e >= 0:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(sorted_ptr + offs_m).to(tl.int64)
            valid = pair < num_pairs
            row = pair // ROW_DIV
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                a = tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :],
                            mask=valid[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                            mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(a, w, input_precision="ieee")
                else:
                    acc += tl.dot(a, w)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if MUL_ROUTE:
                acc = acc * tl.load(route_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=valid[:, None] & n_mask[None, :])


def _require_triton() -> None:
    if not AVAILABLE:
        raise RuntimeError(f"triton is not available: {IMPORT_ERROR}")


def block_m_for(num_pairs: int, num_experts: int) -> int:
    return LARGE_BLOCK_M if num_pairs >= LARGE_ROWS_PER_EXPERT * num_experts else SMALL_BLOCK_M


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] (values 0..E, E meaning "not here") -> (sorted_pairs int32 [max_padded]: pair indices grouped by
    expert, each expert's group padded with P = T * k to a multiple of block_m; block_experts int32
    [max_padded / block_m]: each row block's expert, -1 for blocks past the last). Torch ops only, no host sync."""
    flat = ids.flatten().to(torch.int64)
    P = flat.numel()
    E = num_experts
    counts = torch.bincount(flat, minlength=E + 1)[:E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    here = sorted_e < E
    e = sorted_e.clamp(max=E - 1)
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    max_padded = (P + E * (block_m - 1) + block_m - 1) // block_m * block_m
    dest = torch.where(here, starts[e] + torch.arange(P, device=flat.device) - first[e], max_padded)
    sorted_pairs = torch.full((max_padded + 1,), P, dtype=torch.int64, device=flat.device)
    sorted_pairs.scatter_(0, dest, order)  # pairs not here land in the extra last slot, then dropped
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    block_experts = torch.where(block_experts < E, block_experts, -1)
    return sorted_pairs[:max_padded].to(torch.int32), block_experts.to(torch.int32)


def moe_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, sorted_pairs: torch.Tensor,
             block_experts: torch.Tensor, num_pairs: int, row_div: int, block_m: int,
             route_weights: torch.Tensor | None = None) -> torch.Tensor:
    """out [num_pairs, N]: out[p] = a[p // row_div] @ w[e(p)]^T (+ bias[e(p)]) (* route_weights[p]); rows of pairs
    with no expert here stay zero. a [rows, K] (contiguous rows), w [E, N, K], bias [E, N]."""
    _require_triton()
    N, K = w.shape[1], w.shape[2]
    if a.shape[1] != K or a.stride(1) != 1:
        raise ValueError(f"a must be [rows, {K}] with contiguous rows, got {tuple(a.shape)} stride {a.stride()}")
    out = torch.zeros((num_pairs, N), dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    grid = (block_experts.numel(), triton.cdiv(N, BLOCK_N))
    _moe_gemm_kernel[grid](
        a, w, bias if bias is not None else w, route_weights if route_weights is not None else a, out, sorted_pairs,
        block_experts, num_pairs, N, K, a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        ROW_DIV=row_div, HAS_BIAS=bias is not None, MUL_ROUTE=route_weights is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              activation: Callable[[torch.Tensor], torch.Tensor], gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts of a SparseMoE step: x [T, H], gate_up [E, 2I, H], down [E, H, I], weights/ids [T, k] (ids in
    0..E, E: an expert not held here) -> [T, H] = sum over each token's k pairs of weight * down(act(gate_up(x)))."""
    _require_triton()
    if x.dtype not in DTYPES:
        raise ValueError(f"dtype {x.dtype} not supported (choose one of {DTYPES})")
    T, k = ids.shape
    E = gate_up.shape[0]
    P = T * k
    block_m = block_m_for(P, E)
    sorted_pairs, block_experts = align_by_expert(ids, E, block_m)
    x = x.contiguous()
    h = moe_gemm(x, gate_up, gate_up_bias, sorted_pairs, block_experts, P, k, block_m)
    act = activation(h).contiguous()
    route = weights.flatten().contiguous()
    y = moe_gemm(act, down, down_bias, sorted_pairs, block_experts, P, 1, block_m, route)
    return y.view(T, k, -1).sum(dim=1)

"""The layers a decoder family is built from: Linear (oneDNN-packed on CPU; fixed row tiles in batch-invariant
mode), RMSNorm and the gated MLP. The attention block over the paged KV cache is in attention.py; a family's own
module (llama.py) puts them together and names its weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import REFERENCE as reference_ops
from .config import ModelConfig


def tiled_rows(fn, x: torch.Tensor, tile: int) -> torch.Tensor:
    """fn over x [T, ...] in calls of exactly `tile` rows (the last one zero-padded); the T result rows."""
    T = x.shape[0]
    pad = (-T) % tile
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    if x.shape[0] == tile:
        return fn(x)[:T]
    return torch.cat([fn(x[i:i + tile]) for i in range(0, x.shape[0], tile)], dim=0)[:T]


class Linear(nn.Module):
    """y = x W^T + b. On CPU the weight is repacked once, after loading, into oneDNN's blocked layout and
    multiplied by oneDNN: on this class of CPU (MKL sgemm on AMD Zen, docs/benchmarks.md) that is 1.1-1.5x faster
    than F.linear from batch 1 (a GEMV) to batch 64. Elsewhere (CUDA, or where oneDNN refuses the dtype) the plain
    F.linear runs."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN layout; not a parameter (state_dict can't hold it)
        self.tile_rows: int | None = None  # batch-invariant mode: calls of exactly this many rows (batch_invariant.py)
        self.lora = None  # its LoRA adapter slots (models/lora.py LoraTarget) where the engine serves adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows is not None and x.dim() == 2:
            y = tiled_rows(self._forward, x, self.tile_rows)
        else:
            y = self._forward(x)
        if self.lora is not None:
            self.lora.apply(y, x)  # each row's own adapter's delta (none for the base model's rows)
        return y

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def stack_entry(self, rows: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """This matmul for kernels' decode_layers at `rows` rows, as _forward would run it: (kind, weight, aux,
        bias), kind 0 the oneDNN packed weight, 2 a plain weight; None where decode_layers cannot run it."""
        if self.tile_rows is not None:
            return None
        if self.packed is not None:
            return 0, self.packed, self.packed.new_empty(0), self.bias
        return 2, self.weight, self.weight.new_empty(0), self.bias

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"weight shape {tuple(weight.shape)}, expected {tuple(self.weight.shape)}")
        self.weight.copy_(weight)
        if self.bias is not None:
            self.bias.copy_(bias)

    @torch.no_grad()
    def pack(self) -> bool:
        """Repack for oneDNN on CPU; frees the plain weight. False (and no change) where not possible."""
        if self.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            probe = torch.ones(1, self.weight.shape[1], dtype=self.weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
        except RuntimeError:  # e.g. bf16 on a CPU without AVX-512: oneDNN refuses
            return False
        self.packed = packed
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return True


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class MLP(nn.Module):
    """The gated MLP: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, self.inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(h, 2 * self.inter, False)
        self.down_proj = Linear(self.inter, h, False)

    def forward(self, x, ops=reference_ops):
        return self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(x)))

"""Weight-only int8 quantization (`--quantize int8`): the Int8Linear module, quantize_model (which swaps a loaded
model's Linears for it, in place) and weight_bytes (a model's bytes as stored, int8 counted as 1 byte).

Every Linear (q/k/v, o, gate/up, down and the lm_head) keeps an int8 weight [out, in] and one symmetric scale per
output channel (scale = max |w| of the row / 127, zero point 0); activations stay in the model's dtype. A tied
lm_head is already its own Linear (llama.py), so quantizing it leaves the embedding table untouched.

Kernels, measured on this project's CPU (2-core EPYC with AVX-512 BF16, torch 2.13, SmolLM2-135M's 121 matrices):
- `torch.ops.aten._weight_int8pack_mm(x [M, K], w int8 [N, K], scales [N])` exists on CPU only (no CUDA kernel);
  x must be 2-D with a contiguous last dimension, w contiguous, scales of x's dtype; it **crashes the process**
  (SIGSEGV) when K is not a multiple of 16. With bf16 activations, all matrices at M = 1 took 9.3 ms against
  13.0 ms for the bf16 oneDNN Linear, but its cost grows ~linearly with M (M = 16: 43 ms vs 18 ms; M = 256: 539 ms
  vs 166 ms): it only pays for a few rows. With fp32 activations it is slow at any M (56 ms at M = 1, 900 ms at
  M = 16, against 23 / 31 ms for fp32 oneDNN).
- Elsewhere (more rows, other dtypes, other devices) the weight is converted to the activation dtype a chunk of
  output rows at a time (the temporary stays in cache), multiplied, and the output scaled per channel:
  x (w * s)^T = (x w^T) * s. M = 16: 30 ms, M = 256: 194 ms for all matrices.
So int8 speeds up batch-1 decoding in bf16 and is slower than bf16 for batched steps and prefill on this CPU; it
always saves memory (weights 1/2 of bf16, 1/4 of fp32). Whole engine steps (bench/quantization.py): batch 1
0.80-0.99x the bf16 step time, batch 16 1.2-1.8x, a 453-token prefill 1.1-1.4x; quality against bf16 on that
bench's text: mean KL 0.010 nats, top-1 agreement 0.956. The engine refuses it with fp32 activations
(check_quantization): there every path measured 2-29x slower than the unquantized fp32 model.
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Linear

QUANTIZE_MODES = ("int8", "int4")
INT8_MAX = 127  # symmetric: -127..127 (-128 unused, so that w and -w quantize alike)
INT8PACK_K_MULTIPLE = 16  # _weight_int8pack_mm segfaults on other input sizes (torch 2.13 CPU)
# rows up to which _weight_int8pack_mm beats the convert-and-multiply path (all of SmolLM2's matrices, bf16:
# M = 4: 15.6 vs 21.8 ms, M = 8: 26.0 vs 24.2 ms)
INT8PACK_MAX_ROWS = 6
DEQUANT_CHUNK_BYTES = 4 << 20  # the converted weight rows of one chunk of the fallback path


def _check_mode(mode: str) -> None:
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantization {mode!r} (choose one of: {', '.join(QUANTIZE_MODES)})")


def check_quantization(mode: str | None, dtype: torch.dtype) -> None:
    """ValueError for an unknown mode, or for int8 with float32 activations (slower than not quantizing)."""
    if mode is None:
        return
    _check_mode(mode)
    if mode == "int8" and dtype == torch.float32:
        raise ValueError(
            "--quantize int8 needs 16-bit activations: with float32 the int8 kernels ran 2-29x slower than the "
            "unquantized float32 model on CPU. Use --dtype bfloat16 (on a CPU with AVX-512 BF16 or AMX, or a GPU)")


@torch.no_grad()
def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [out, in], scales [out] in scale_dtype) with w ~= q * scale[:, None]. The scale is rounded to
    scale_dtype before the weight is divided by it, so the int8 values fit the scale that is actually used."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = torch.round(w / scale.to(torch.float32)[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale


_scratch_local = threading.local()


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused buffer (per thread, dtype and device) that the fallback converts weight chunks into: no allocation
    of a weight-sized temporary per matmul, and the same cache-resident addresses every time."""
    buffers = getattr(_scratch_local, "buffers", None)
    if buffers is None:
        buffers = _scratch_local.buffers = {}
    key = (dtype, device)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
            buf = buffers[key] = torch.empty(max(numel, DEQUANT_CHUNK_BYTES // _element_size(dtype)), dtype=dtype,
                                             device=device)
    return buf


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Int8Linear(Linear):
    """y = x (W_int8 * scale[:, None])^T + b. A Linear (llama.py) to the rest of the model: same load() (which
    quantizes), pack() (a no-op), and `weight` (here int8), so the model's weight accounting counts it as stored."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)  # not Linear.__init__: no full-precision weight is ever allocated
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"Int8Linear needs a 2-D int8 weight, got {weight.dtype} {tuple(weight.shape)}")
        if tuple(scales.shape) != (weight.shape[0],):
            raise ValueError(f"scales shape {tuple(scales.shape)}, expected ({weight.shape[0]},)")
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(scales.dtype), requires_grad=False)
        self.packed = None
        self.lora = None
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> Int8Linear:
        """Quantize a full-precision weight; scales (and bias) in dtype (default: the weight's)."""
        q, scales = quantize_int8(weight, dtype or weight.dtype)
        return cls(q, scales, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def stack_entry(self, rows: int) -> None:
        """decode_layers does not run int8 weights: a model with them takes the Python layers."""
        return None

    def uses_int8pack(self, x: torch.Tensor) -> bool:
        """Whether forward(x) runs _weight_int8pack_mm (else it converts the weight a chunk at a time)."""
        rows = x.numel() // max(1, self.in_features)
        return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and self.scales.dtype == x.dtype
                and self.in_features % INT8PACK_K_MULTIPLE == 0 and 0 < rows <= INT8PACK_MAX_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.uses_int8pack(x2):
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = self._convert_matmul(x2)
        if self.lora is not None:  # LoRA adapters (models/lora.py), as Linear.forward adds them
            self.lora.apply(y, x2)
        return y.reshape(*shape[:-1], self.out_features)

    def _convert_matmul(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        scales = self.scales.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        rows = min(self.out_features, max(1, DEQUANT_CHUNK_BYTES // (self.in_features * x.element_size())))
        buf = _scratch(rows * self.in_features, dtype, x.device)
        parts = []
        for i in range(0, self.out_features, rows):
            w = self.weight[i:i + rows]
            w_conv = buf[:w.numel()].view(w.shape).copy_(w)
            part = F.linear(x, w_conv) * scales[i:i + rows]
            parts.append(part if bias is None else part + bias[i:i + rows])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    @torch.no_grad()
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full-precision weight this module stands for: w_int8 * scale, in dtype (default: the scales')."""
        dtype = dtype or self.scales.dtype
        return (self.weight.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(dtype)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantize and store a new full-precision weight of the same shape."""
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"weight shape {tuple(weight.shape)}, expected {tuple(self.weight.shape)}")
        q, scales = quantize_int8(weight, self.scales.dtype)
        self.weight.copy_(q)
        self.scales.copy_(scales)
        if self.bias is not None:
            self.bias.copy_(bias)

    def pack(self) -> bool:
        return False


INT4_GROUP = 32  # values per scale/zero pair, as GGUF's Q4_0/Q4_1 blocks
INT4_LEVELS = 15  # codes 0..15
INT4PACK_INNER_K_TILES = 2
# rows up to which torch's int4 CPU kernel beats the bf16 oneDNN matmul over the dequantized weight (bench/int4.py:
# all of SmolLM2's matrices, bf16, AMD EPYC AVX-512 BF16: M = 1 6.4 vs 21 ms, M = 16 32 vs 22 ms)
INT4_MAX_ROWS = 4


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, dtype: torch.dtype,
                  group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per group of `group` input values (Q4_1's scheme: w ~= q * d + m, q in 0..15, d and m
    per group). Returns (codes int32 [out, in], scales [out, in / group] and mins [out, in / group], both rounded to
    dtype) with the codes chosen for the rounded scales, so that dequantizing with them is what the kernel computes."""
    out_f, in_f = weight.shape
    if in_f % group:
        raise ValueError(f"int4 needs the input size ({in_f}) to be a multiple of {group}")
    w = weight.detach().to(torch.float32).view(out_f, in_f // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / INT4_LEVELS).to(dtype)
    m = lo.to(dtype)
    d32, m32 = d.to(torch.float32), m.to(torch.float32)
    safe = torch.where(d32 > 0, d32, torch.ones_like(d32))
    q = torch.round((w - m32[..., None]) / safe[..., None]).clamp_(0, INT4_LEVELS).to(torch.int32)
    return q.view(out_f, in_f), d, m


class Int4Linear(Linear):
    """y = x W^T + b with W held as 4-bit codes, a scale and a minimum per 32 input values (`--quantize int4`).
    Up to INT4_MAX_ROWS rows (single-stream decoding, memory-bound) torch's CPU int4 kernel
    (`_weight_int4pack_mm_for_cpu`) reads the 4-bit weights: ~3.3x fewer bytes than bf16. Larger steps (batched
    decoding, prefill: compute-bound) multiply the dequantized weights in the activation dtype through oneDNN, so
    this module keeps both and saves no memory on a CPU: it trades memory for single-stream speed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        nn.Module.__init__(self)
        q, d, m = quantize_int4(weight, dtype)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.tile_rows = None
        # the kernel's form: w = (q - 8) * scale + zero, i.e. zero = m + 8 d; [in / group, out, 2]
        zeros = (m.to(torch.float32) + 8 * d.to(torch.float32)).to(dtype)
        self.register_buffer("scales_zeros", torch.stack([d, zeros], dim=-1).transpose(0, 1).contiguous())
        dense = (q.view(self.out_features, -1, INT4_GROUP).to(torch.float32) * d.to(torch.float32)[..., None]
                 + m.to(torch.float32)[..., None]).view(self.out_features, self.in_features)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.weight = nn.Parameter(dense.to(dtype), requires_grad=False)  # the dequantized weight (batched steps)
        self.packed = None
        self.lora = None
        try:
            self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q, INT4PACK_INNER_K_TILES))
        except (RuntimeError, AttributeError):  # no CPU int4 kernel for this shape: the dense path only
            self.weight_int4 = None
        Linear.pack(self)  # the dequantized weight in oneDNN's layout, as an unquantized Linear

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> Int4Linear:
        return cls(weight, bias, dtype or weight.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={INT4_GROUP}"

    def uses_int4pack(self, x: torch.Tensor) -> bool:
        rows = x.numel() // max(1, self.in_features)
        return (self.weight_int4 is not None and x.device.type == "cpu" and x.dtype == self.scales_zeros.dtype
                and 0 < rows <= INT4_MAX_ROWS)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_int4pack(x):
            shape = x.shape
            x2 = x.reshape(-1, self.in_features).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight_int4, INT4_GROUP, self.scales_zeros)
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*shape[:-1], self.out_features)
        return Linear._forward(self, x)

    def stack_entry(self, rows: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """As _forward runs `rows` rows: kind 1 (the int4 kernel) where uses_int4pack would hold (CPU, the
        activations in the scales' dtype: the model's), else the dense copy as a Linear."""
        if (self.weight_int4 is not None and self.scales_zeros.device.type == "cpu"
                and 0 < rows <= INT4_MAX_ROWS):
            return 1, self.weight_int4, self.scales_zeros, self.bias
        return Linear.stack_entry(self, rows)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        raise NotImplementedError("an Int4Linear is built from its float weight (Int4Linear.from_float)")

    def pack(self) -> bool:
        return False

    def step_bytes(self, rows: int = 1) -> int:
        """Weight bytes a matmul of `rows` rows reads: the 4-bit codes and scales, or the dense weight."""
        if self.weight_int4 is not None and rows <= INT4_MAX_ROWS:
            return (self.weight_int4.numel() * self.weight_int4.element_size()
                    + self.scales_zeros.numel() * self.scales_zeros.element_size())
        dense = self.packed if self.packed is not None else self.weight
        return dense.numel() * dense.element_size()


def _float_weight(linear: Linear) -> torch.Tensor:
    """A Linear's weight, also when it was repacked for oneDNN (build_model packs on CPU and frees the plain one)."""
    return linear.packed.to_dense() if linear.packed is not None else linear.weight.detach()


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str | None) -> int:
    """Replace every full-precision Linear of model (the decoder layers' and the lm_head; inside tensor-parallel
    wrappers too) by its quantized version, in place, dropping the full-precision weights. Returns how many were
    replaced; mode None does nothing. ValueError for an unknown mode. Float32 works (it is exact to the dequantized
    weights) but is slow: the engine refuses it first (check_quantization); tests and benchmarks may use it."""
    if mode is None:
        return 0
    _check_mode(mode)
    # int4: the head keeps its precision (a Q4_1 GGUF keeps it 8-bit: the default model's token_embd is Q8_0): at 4
    # bits it cost 0.037 nats of KL against bf16 on its own (0.004 without), and int8's kernel was no faster than
    # bf16's for it here (49152 x 576 at one row: int8 2.15 ms, bf16 1.92, int4 0.89)
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is Linear and not (mode == "int4" and name == "lm_head")
               and not getattr(m, "keep_precision", False)]  # an MoE router (moe.py): routing is a near-tie argmax
    # MoE blocks (moe.SparseMoE) quantize their stacked experts themselves, one quantized Linear per expert matrix
    experts = sum(m.quantize_experts(mode) for m in model.modules() if hasattr(m, "quantize_experts"))
    if not targets:
        return experts
    dtype = targets[0][1].weight.dtype
    if targets[0][1].weight.device.type != "cpu":
        warnings.warn("int8 weights on a GPU: torch has no fused int8-weight kernel there, so each matmul converts "
                      "its weight first; this saves memory but is slower than unquantized bf16", stacklevel=2)
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight = _float_weight(linear)
        bias = None if linear.bias is None else linear.bias.detach()
        cls = Int4Linear if mode == "int4" else Int8Linear
        setattr(parent, attr, cls.from_float(weight, bias, dtype))
        del weight, bias
        linear.packed = None  # free the full-precision weight now, not when the old module is collected
        linear.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=linear.weight.device), requires_grad=False)
    if hasattr(model, "forget_decode_stacks"):
        model.forget_decode_stacks()  # they held the replaced modules' weights
    return len(targets) + experts


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as stored (an int8 weight 1 byte per value, scales and
    everything else at their own dtype), plus any Linear's oneDNN-packed weight (which is neither). Shared tensors
    count once. This is the whole model, the embedding table and rotary tables included; LlamaForCausalLM's own
    weight_bytes() is what one decode step reads (no embedding table; Int8Linear counted by its int8 weight)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor):
            tensors.append(packed)
        elif isinstance(packed, list):  # moe.DenseExperts: (gate_up, down) per expert
            tensors.extend(t for pair in packed for t in pair)
        for t in tensors:
            if id(t) in seen:
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total

"""The sparse mixture-of-experts block (Mixtral, Qwen3-MoE, gpt-oss): a decoder layer's MLP where a router picks
top_k of num_experts gated MLPs per token and sums their outputs weighted by the routing weights.

Compute is by expert, not by token: the step's (token, expert) pairs are sorted by expert, each active expert runs one
gate/up matmul and one down matmul over all of its tokens (a GEMM, not top_k GEMVs per token), and the weighted
results are put back in (token, slot) order and summed over each token's k slots. Experts no token picked cost
nothing. Where the ops namespace has `fused_moe` (the Triton kernels, inferd/kernels/triton_moe.py) the two grouped
GEMMs run as one launch each over the expert-sorted tokens instead of one matmul per expert.

Weights, whatever the family stores: gate/up fused per expert as [E, 2I, H] (gate rows first, then up: Mixtral's and
Qwen3-MoE's concatenated layout) and down as [E, H, I], both [out, in] like a Linear; optional biases [E, 2I], [E, H]
(gpt-oss). gpt-oss stores gate_up transposed ([E, H, 2I]) with gate and up interleaved (columns 0, 2, 4, ... gate;
1, 3, 5, ... up) and down as [E, I, H]; load_hf_state transposes and de-interleaves them (a permutation of the rows:
every dot product is the same).

Routing, as transformers 5.24 computes it (MixtralTopKRouter, Qwen3MoeTopKRouter, GptOssTopKRouter):
- mixtral: softmax over all experts in float32, top-k, the k weights renormalised to sum 1 (which equals a softmax over
  the top-k logits); the weights stay float32 until the weighted expert output is cast back to the activations' dtype.
- qwen3_moe: the same, renormalised only when norm_topk_prob; the weights cast to the logits' dtype.
- gpt_oss: the router has a bias; top-k over the logits, then a softmax over the k, in the logits' dtype.
Activations: silu(gate) * up (ops.silu_mul over the fused rows) for mixtral and qwen3_moe; gpt-oss's clamped SwiGLU
(gpt_oss_swiglu) with the expert biases.

Expert parallelism (inferd/models/parallel.py, ExpertParallel): a block built with expert_range=(start, stop) holds
only those experts; it routes over all of them and computes only its own experts' share of the output (zero rows for
the others), so the ranks' outputs sum to the whole block's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import REFERENCE as reference_ops
from .layers import Linear

MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
GPT_OSS_SWIGLU_ALPHA = 1.702  # transformers' GptOssConfig.swiglu_alpha
GPT_OSS_SWIGLU_LIMIT = 7.0  # GptOssConfig.swiglu_limit


@dataclass(frozen=True)
class MoESpec:
    """One MoE block's shape and its family's routing and activation."""
    family: str  # one of MOE_FAMILIES
    hidden_size: int
    intermediate_size: int  # of one expert
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True  # qwen3_moe: renormalise the top-k weights (mixtral always does, gpt_oss never needs)
    swiglu_alpha: float = GPT_OSS_SWIGLU_ALPHA
    swiglu_limit: float = GPT_OSS_SWIGLU_LIMIT

    def __post_init__(self):
        if self.family not in MOE_FAMILIES:
            raise ValueError(f"unknown MoE family {self.family!r} (one of: {', '.join(MOE_FAMILIES)})")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")

    @property
    def biased(self) -> bool:
        """gpt-oss: the router and every expert matmul have a bias."""
        return self.family == "gpt_oss"

    @classmethod
    def from_hf_config(cls, config) -> MoESpec:
        """From a transformers config (object or config.json dict) of model_type mixtral, qwen3_moe or gpt_oss."""
        def get(name, default=None):
            if isinstance(config, Mapping):
                return config.get(name, default)
            return getattr(config, name, default)

        family = get("model_type")
        if family == "mixtral":
            return cls(family, get("hidden_size"), get("intermediate_size"), get("num_local_experts"),
                       get("num_experts_per_tok"))
        if family == "qwen3_moe":
            return cls(family, get("hidden_size"), get("moe_intermediate_size"), get("num_experts"),
                       get("num_experts_per_tok"), norm_topk_prob=bool(get("norm_topk_prob", False)))
        if family == "gpt_oss":
            return cls(family, get("hidden_size"), get("intermediate_size"), get("num_local_experts"),
                       get("num_experts_per_tok"), swiglu_alpha=float(get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)),
                       swiglu_limit=float(get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)))
        raise ValueError(f"not an MoE family: model_type {family!r}")


def hf_block_prefix(state: Mapping[str, torch.Tensor], layer_prefix: str) -> str:
    """Where a decoder layer's MoE block sits in a transformers state dict: "<layer>.block_sparse_moe." in Mixtral
    checkpoints (transformers 5 renames it to mlp when it loads them), "<layer>.mlp." otherwise. layer_prefix:
    "model.layers.3." (with its dot)."""
    legacy = layer_prefix + "block_sparse_moe."
    return legacy if any(k.startswith(legacy) for k in state) else layer_prefix + "mlp."


def gpt_oss_swiglu(gate_up: torch.Tensor, alpha: float = GPT_OSS_SWIGLU_ALPHA,
                   limit: float = GPT_OSS_SWIGLU_LIMIT) -> torch.Tensor:
    """gpt-oss's activation over [.., 2I] rows (gate half, then up half: our de-interleaved layout), as
    transformers' GptOssExperts._apply_gate: gate clamped above at limit, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def route(spec: MoESpec, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k] int64) from router logits [T, E], by the family's rule (module doc)."""
    if spec.family == "gpt_oss":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return F.softmax(top, dim=1, dtype=top.dtype), ids
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.family == "mixtral" or spec.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if spec.family == "qwen3_moe":
        top = top.to(logits.dtype)
    return top, ids


class DenseExperts(nn.Module):
    """The experts' weights as stacked tensors: gate_up [E, 2I, H], down [E, H, I] (+ biases [E, 2I], [E, H]).

    On CPU, pack() repacks each expert's two matrices into oneDNN's layout and frees the stacked ones, as
    layers.Linear.pack does and for the same reason, sharper here: MKL's sgemm on this CPU (AMD EPYC) took 15-16 ms
    for a [2..8 rows] x [1024, 768] float32 product that oneDNN does in well under 1 ms, and an expert's share of a
    batch is exactly such a handful of rows."""

    def __init__(self, num_experts: int, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * inter), requires_grad=False) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden), requires_grad=False) if bias else None
        # oneDNN-packed [gate_up, down] per expert (not parameters: state_dict can't hold them); None until pack()
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def _mm(self, x: torch.Tensor, e: int, which: int, weight: torch.Tensor, bias: torch.Tensor | None):
        b = None if bias is None else bias[e]
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed[e][which], b, "none", [], "")
        return F.linear(x, weight[e], b)

    def gate_up_mm(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._mm(x, e, 0, self.gate_up, self.gate_up_bias)

    def down_mm(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._mm(x, e, 1, self.down, self.down_bias)

    def float_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]), also after pack()."""
        if self.packed is not None:
            return self.packed[e][0].to_dense(), self.packed[e][1].to_dense()
        return self.gate_up[e].detach(), self.down[e].detach()

    @torch.no_grad()
    def pack(self) -> bool:
        """Repack for oneDNN on CPU, freeing the stacked weights; False (and no change) where not possible (another
        device, a dtype oneDNN refuses). The fused Triton path needs the stacked weights: it runs on GPUs, where
        nothing is packed."""
        if self.packed is not None or self.gate_up.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        try:
            packed = [(torch.ops.mkldnn._reorder_linear_weight(self.gate_up[e]),
                       torch.ops.mkldnn._reorder_linear_weight(self.down[e])) for e in range(self.gate_up.shape[0])]
            probe = torch.ones(1, self.gate_up.shape[2], dtype=self.gate_up.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed[0][0], None, "none", [], "")
        except RuntimeError:  # e.g. bf16 on a CPU without AVX-512
            return False
        self.packed = packed
        empty = torch.empty(0, dtype=self.gate_up.dtype)
        self.gate_up = nn.Parameter(empty, requires_grad=False)
        self.down = nn.Parameter(empty.clone(), requires_grad=False)
        return True

    def expert_bytes(self, e: int, rows: int = 1) -> int:
        """Bytes of expert e's weights (and biases) one matmul pair over it reads."""
        ts = list(self.packed[e]) if self.packed is not None else [self.gate_up[e], self.down[e]]
        ts += [b[e] for b in (self.gate_up_bias, self.down_bias) if b is not None]
        return sum(t.numel() * t.element_size() for t in ts)


def _num_experts(dense: DenseExperts) -> int:
    return len(dense.packed) if dense.packed is not None else dense.gate_up.shape[0]


class QuantizedExperts(nn.Module):
    """Each expert's two matmuls as quantize.py's Int8Linear or Int4Linear (per-channel int8, or int4 in groups of 32
    input values), built from a DenseExperts; their forward picks the kernel by rows as for any quantized Linear."""

    def __init__(self, dense: DenseExperts, mode: str):
        super().__init__()
        from .quantize import Int4Linear, Int8Linear

        cls = {"int8": Int8Linear, "int4": Int4Linear}[mode]
        self.mode = mode
        dtype = dense.gate_up.dtype
        self.gate_up, self.down = nn.ModuleList(), nn.ModuleList()
        for e in range(_num_experts(dense)):
            gate_up, down = dense.float_weights(e)
            self.gate_up.append(cls.from_float(gate_up, None if dense.gate_up_bias is None else dense.gate_up_bias[e],
                                               dtype))
            self.down.append(cls.from_float(down, None if dense.down_bias is None else dense.down_bias[e], dtype))

    def gate_up_mm(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.gate_up[e](x)

    def down_mm(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.down[e](x)

    def expert_bytes(self, e: int, rows: int = 1) -> int:
        total = 0
        for m in (self.gate_up[e], self.down[e]):
            if hasattr(m, "step_bytes"):  # Int4Linear: the 4-bit codes or the dense copy, by rows
                total += m.step_bytes(rows)
            else:  # Int8Linear: int8 weight and scales
                total += m.weight.numel() + m.scales.numel() * m.scales.element_size()
            if m.bias is not None:
                total += m.bias.numel() * m.bias.element_size()
        return total


class SparseMoE(nn.Module):
    """A decoder layer's MLP for the MoE families: forward(x [T, H], ops) -> [T, H] (module doc).

    Loading: load_router(weight [E, H], bias [E] | None) and load_experts(gate_up [E, 2I, H], down [E, H, I],
    gate_up_bias [E, 2I] | None, down_bias [E, H] | None) in our layout, over all E experts (a block holding an
    expert_range keeps its slice); or load_hf_state(state, prefix) from transformers' names, in-module or as saved."""

    def __init__(self, spec: MoESpec, expert_range: tuple[int, int] | None = None):
        super().__init__()
        self.spec = spec
        start, stop = expert_range or (0, spec.num_experts)
        if not 0 <= start < stop <= spec.num_experts:
            raise ValueError(f"expert range {start}..{stop} outside 0..{spec.num_experts}")
        self.expert_start, self.expert_stop = start, stop
        self.router = Linear(spec.hidden_size, spec.num_experts, spec.biased)
        self.router.keep_precision = True  # quantize_model leaves it: routing picks among near-equal logits
        self.experts: DenseExperts | QuantizedExperts = DenseExperts(stop - start, spec.hidden_size,
                                                                    spec.intermediate_size, spec.biased)
        # bincount of the last forward's expert ids over all E (a device tensor: reading it syncs; see
        # weight_bytes_touched)
        self.last_expert_counts: torch.Tensor | None = None

    @property
    def num_local_experts(self) -> int:
        return self.expert_stop - self.expert_start

    # ---- loading ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_router(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if self.spec.biased and bias is None:
            raise ValueError(f"{self.spec.family}'s router has a bias")
        self.router.load(weight, bias if self.spec.biased else None)

    @torch.no_grad()
    def load_experts(self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                     down_bias: torch.Tensor | None = None) -> None:
        """All E experts' weights in our layout (module doc); this block keeps its expert range."""
        spec, ex = self.spec, self.experts
        if not isinstance(ex, DenseExperts):
            raise ValueError("experts are quantized: load before quantizing")
        E, H, inter = spec.num_experts, spec.hidden_size, spec.intermediate_size
        for name, t, shape in (("gate_up", gate_up, (E, 2 * inter, H)), ("down", down, (E, H, inter))):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} shape {tuple(t.shape)}, expected {shape}")
        if spec.biased != (gate_up_bias is not None and down_bias is not None):
            raise ValueError(f"{spec.family}'s experts {'have' if spec.biased else 'have no'} biases")
        lo, hi = self.expert_start, self.expert_stop
        self._copy_local(gate_up[lo:hi], down[lo:hi], None if gate_up_bias is None else gate_up_bias[lo:hi],
                         None if down_bias is None else down_bias[lo:hi])

    def _copy_local(self, gate_up, down, gate_up_bias, down_bias) -> None:
        ex = self.experts
        if ex.packed is not None:
            raise ValueError("experts are packed for oneDNN: load before pack()")
        ex.gate_up.copy_(gate_up)
        ex.down.copy_(down)
        if ex.gate_up_bias is not None:
            ex.gate_up_bias.copy_(gate_up_bias)
            ex.down_bias.copy_(down_bias)

    @torch.no_grad()
    def load_hf_state(self, state: Mapping[str, torch.Tensor], prefix: str = "") -> set[str]:
        """Load from transformers' names under prefix (the block's, with its dot: "model.layers.3.mlp." or, for a
        Mixtral checkpoint, "model.layers.3.block_sparse_moe."). Reads either form transformers 5 has:
        - the module's state (fused): gate.weight or router.weight/bias, experts.gate_up_proj, experts.down_proj
          (+ experts.gate_up_proj_bias, experts.down_proj_bias for gpt_oss: transposed and interleaved as stored);
        - the checkpoint's per-expert names save_pretrained writes for mixtral (experts.N.w1/w3/w2.weight: gate, up,
          down) and qwen3_moe (experts.N.gate_proj/up_proj/down_proj.weight).
        Returns the names it read (so a loader can tell which keys are left)."""
        spec = self.spec
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            used.add(prefix + name)
            return state[prefix + name]

        router = "router." if spec.family == "gpt_oss" else "gate."
        self.load_router(take(router + "weight"), take(router + "bias") if spec.biased else None)
        if prefix + "experts.gate_up_proj" in state:
            gate_up, down = take("experts.gate_up_proj"), take("experts.down_proj")
            gu_bias = d_bias = None
            if spec.family == "gpt_oss":  # [E, H, 2I] interleaved -> [E, 2I, H] gate rows then up rows
                gate_up = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
                down = down.transpose(1, 2)
                gu_bias = take("experts.gate_up_proj_bias")
                gu_bias = torch.cat([gu_bias[..., 0::2], gu_bias[..., 1::2]], dim=-1)
                d_bias = take("experts.down_proj_bias")
            self.load_experts(gate_up, down, gu_bias, d_bias)
            return used
        names = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}.get(spec.family)
        if names is None:
            raise KeyError(f"{prefix}experts.gate_up_proj")
        g, u, d = names
        local = range(self.expert_start, self.expert_stop)  # only this block's experts are read (and marked used)
        gate_up = torch.stack([torch.cat([take(f"experts.{e}.{g}.weight"), take(f"experts.{e}.{u}.weight")])
                               for e in local])
        down = torch.stack([take(f"experts.{e}.{d}.weight") for e in local])
        n, H, inter = len(local), spec.hidden_size, spec.intermediate_size
        if tuple(gate_up.shape) != (n, 2 * inter, H) or tuple(down.shape) != (n, H, inter):
            raise ValueError(f"{prefix}experts: gate/up {tuple(gate_up.shape[1:])} and down "
                             f"{tuple(down.shape[1:])} per expert, expected {(2 * inter, H)} and {(H, inter)}")
        self._copy_local(gate_up, down, None, None)
        return used

    @classmethod
    def from_hf_block(cls, module: nn.Module, spec: MoESpec, expert_range: tuple[int, int] | None = None
                      ) -> SparseMoE:
        """Ours, with the weights of a transformers MoE block module (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock,
        GptOssMLP)."""
        moe = cls(spec, expert_range)
        weight = next(module.parameters())
        moe.to(dtype=weight.dtype, device=weight.device)
        moe.load_hf_state({k: v.detach() for k, v in module.state_dict().items()})
        return moe

    # ---- quantization ----------------------------------------------------------------------------------------------
    def quantize_experts(self, mode: str) -> int:
        """Experts to int8 (per output channel) or int4 (groups of 32) weights, as quantize.py's Linears; the router
        keeps its precision. quantize_model calls this for every SparseMoE. Returns the matrices quantized."""
        if not isinstance(self.experts, DenseExperts):
            return 0
        self.experts = QuantizedExperts(self.experts, mode)
        return 2 * self.num_local_experts

    def pack(self) -> bool:
        """The experts (DenseExperts.pack) and the router repacked for oneDNN on CPU; whether the experts were. A
        model's pack_weights must call this: the experts are not Linears."""
        if self.router.packed is None:  # a model's loop over its Linears may have packed it already
            self.router.pack()
        return isinstance(self.experts, DenseExperts) and self.experts.pack()

    # ---- compute ---------------------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], ids [T, k]) over all E experts, from the router's logits of x [T, H]."""
        return route(self.spec, self.router(x))

    def activation(self, gate_up: torch.Tensor, ops) -> torch.Tensor:
        if self.spec.family == "gpt_oss":
            return gpt_oss_swiglu(gate_up, self.spec.swiglu_alpha, self.spec.swiglu_limit)
        return ops.silu_mul(gate_up)

    def forward(self, x: torch.Tensor, ops=reference_ops) -> torch.Tensor:
        weights, ids = self.route(x)
        self.last_expert_counts = torch.bincount(ids.flatten(), minlength=self.spec.num_experts)
        fused = getattr(ops, "fused_moe", None)
        if fused is not None and isinstance(self.experts, DenseExperts) and self.experts.packed is None:
            local = ids - self.expert_start
            local = torch.where((local >= 0) & (local < self.num_local_experts), local, self.num_local_experts)
            ex = self.experts
            return fused(x, ex.gate_up, ex.down, weights, local, lambda h: self.activation(h, ops),
                         ex.gate_up_bias, ex.down_bias)
        return self.forward_by_expert(x, weights, ids, ops)

    def forward_by_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                          ops=reference_ops) -> torch.Tensor:
        """The torch path: pairs sorted by expert, one gate/up and one down matmul per active local expert over its
        rows, the activation once over all rows, the weighted rows summed back into their tokens."""
        k = self.spec.top_k
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # pair p = token * k + slot, grouped by expert
        all_counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()  # the one host sync
        skip = sum(all_counts[:self.expert_start])  # pairs of experts before this block's range
        counts = all_counts[self.expert_start:self.expert_stop]
        n = sum(counts)
        if n == 0:  # no token chose this block's experts (an expert-parallel shard)
            return torch.zeros_like(x)
        pairs = order[skip:skip + n]
        tokens = pairs // k
        rows = x[tokens]
        inter = self.spec.intermediate_size
        gate_up = rows.new_empty(n, 2 * inter)
        starts = []
        s = 0
        for e, c in enumerate(counts):
            starts.append(s)
            if c:
                gate_up[s:s + c] = self.experts.gate_up_mm(e, rows[s:s + c])
            s += c
        act = self.activation(gate_up, ops)
        out_rows = x.new_empty(n, x.shape[1])
        for e, c in enumerate(counts):
            if c:
                out_rows[starts[e]:starts[e] + c] = self.experts.down_mm(e, act[starts[e]:starts[e] + c])
        w = weights.flatten()[pairs]
        # back in pair order, then each token's k slots summed: index_add_ into the token rows computes the same
        # sums, but torch's CPU index_add_ took 15 ms for one token's 8 rows (qwen3 shape, bench/moe_step.py)
        by_pair = x.new_zeros(flat.numel(), x.shape[1]) if n < flat.numel() else x.new_empty(n, x.shape[1])
        by_pair[pairs] = (out_rows * w[:, None]).to(x.dtype)
        return by_pair.view(x.shape[0], k, x.shape[1]).sum(dim=1)

    # ---- accounting ------------------------------------------------------------------------------------------------
    def weight_bytes_touched(self, expert_ids=None, rows: int = 1) -> int:
        """Bytes of weights a step reads through this block: the router, plus each distinct expert of this block in
        expert_ids (global ids, any iterable or tensor; default: those the last forward used, which syncs a device
        tensor) once, however many tokens chose it. rows: the step's rows (an Int4 expert reads its 4-bit or its
        dense copy by rows). For a roofline: count what a step touched, not all E experts."""
        if expert_ids is None:
            if self.last_expert_counts is None:
                return self.router_bytes()
            expert_ids = torch.nonzero(self.last_expert_counts).flatten().tolist()
        elif isinstance(expert_ids, torch.Tensor):
            expert_ids = expert_ids.flatten().tolist()
        local = {int(e) - self.expert_start for e in expert_ids if self.expert_start <= int(e) < self.expert_stop}
        return self.router_bytes() + sum(self.experts.expert_bytes(e, rows) for e in local)

    def router_bytes(self) -> int:
        ts = [self.router.packed if self.router.packed is not None else self.router.weight]
        if self.router.bias is not None:
            ts.append(self.router.bias)
        return sum(t.numel() * t.element_size() for t in ts)

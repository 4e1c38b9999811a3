"""LoRA adapters inside the model: each target projection (a Linear) holds max_loras *slots* of low-rank weights in
preallocated stacked buffers, and a step adds to each row the delta of its own adapter (or none: the base model's
rows). The rows of a step are grouped by slot (LoraStep) once per step, and every projection runs one segmented
matmul over the groups (kernels: reference.lora_add, the fused CPU op, the Triton kernel): one step mixes requests
of different adapters and of the base model, with no weight merged and no loop over requests.

The layout of one projection's buffers (LoraTarget), for a slot s of rank r (at most max_rank R), with the projection
fused from parts (qkv_proj: q, k, v; gate_up_proj: gate, up; o_proj and down_proj: one part):
- a [S, P R, in]: part p's A (PEFT's lora_A, [r, in]) in rows p r .. p r + r - 1 (compact: the first P r rows);
- bt [S, R out]: part p's scale * B^T (PEFT's lora_B is [out_p, r]) as a row-major [r, out_p] block at element
  r * off_p, off_p the part's first output column (compact: the first r * out elements).
A part the adapter does not target is zeros. The scale (lora_alpha / r, or / sqrt(r) for rsLoRA) is folded into B.

Which adapter lives in which slot, loading and eviction are the engine's (inferd/engine/lora.py); this module is
the model's side: the buffers, writing one adapter into a slot, and the step's grouping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# PEFT's module names -> (our fused projection, its part)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}


@dataclass
class LoraStep:
    """One step's rows grouped by adapter slot."""
    perm: torch.Tensor  # int64 [N]: the rows that have an adapter, grouped by slot (on the model's device)
    seg_slots: list[int]  # the slot of each group
    seg_starts: list[int]  # group i is perm[seg_starts[i]:seg_starts[i + 1]]
    row_slots: torch.Tensor  # int32 [T]: each row's slot, -1 for the base model (a per-row kernel's form)
    ranks: list[int]  # every slot's rank (0: empty)


class LoraState:
    """Shared by every LoraTarget of one model: the step being run (None: no row has an adapter, nothing to add)
    and the operator that adds the deltas (kernels: reference.lora_add's contract)."""

    def __init__(self, max_loras: int, max_rank: int, add):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.ranks = [0] * max_loras
        self.step: LoraStep | None = None
        self.add = add

    def begin_step(self, row_slots: list[int], device: torch.device) -> None:
        """Group this step's rows (row_slots: each row's slot or -1) for the projections to come."""
        if all(s < 0 for s in row_slots):
            self.step = None
            return
        by_slot: dict[int, list[int]] = {}
        for row, s in enumerate(row_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(row)
        perm, seg_slots, seg_starts = [], [], [0]
        for s in sorted(by_slot):
            perm += by_slot[s]
            seg_slots.append(s)
            seg_starts.append(len(perm))
        self.step = LoraStep(torch.tensor(perm, dtype=torch.long, device=device), seg_slots, seg_starts,
                             torch.tensor(row_slots, dtype=torch.int32, device=device), list(self.ranks))

    def end_step(self) -> None:
        self.step = None


class LoraTarget:
    """One projection's adapter slots (the module docstring's layout)."""

    def __init__(self, state: LoraState, in_features: int, parts: list[int], dtype: torch.dtype,
                 device: torch.device):
        self.state, self.parts, self.in_features = state, list(parts), in_features
        self.out_features = sum(parts)
        S, R = state.max_loras, state.max_rank
        self.a = torch.zeros(S, len(parts) * R, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(S, R * self.out_features, dtype=dtype, device=device)

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> None:
        step = self.state.step
        if step is not None:
            self.state.add(y, x, step.perm, step.seg_slots, step.seg_starts, step.row_slots, self.a, self.bt,
                           step.ranks, self.parts)

    @torch.no_grad()
    def write(self, slot: int, rank: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]],
              scale: float) -> None:
        """Slot `slot` gets an adapter of rank `rank`: weights[p] = (A [rank, in], B [out_p, rank]) for each part
        it targets; the others are zero."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        off = 0
        for p, size in enumerate(self.parts):
            if p in weights:
                a, b = weights[p]
                self.a[slot, p * rank:(p + 1) * rank].copy_(a)
                self.bt[slot, rank * off:rank * (off + size)].copy_((b.float() * scale).t().reshape(-1))
            off += size

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()


def lora_parts(model: torch.nn.Module) -> dict[str, list[int]]:
    """The part sizes of each fused projection of a layer of this model (its config)."""
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv_proj": [q, kv, kv], "o_proj": [cfg.hidden_size],
            "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size], "down_proj": [cfg.hidden_size]}


def projections(model: torch.nn.Module, layer: int) -> dict[str, torch.nn.Module]:
    """Layer `layer`'s target projections by our names (those it has: an MoE layer has no gate_up/down)."""
    block = model.layers[layer]
    found = {}
    for owner in (block.self_attn, block.mlp):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            if hasattr(owner, name):
                found[name] = getattr(owner, name)
    return found


def attach(model: torch.nn.Module, max_loras: int, max_rank: int, add, dtype: torch.dtype,
           device: torch.device) -> LoraState:
    """Give every target projection of the model its slots; returns the state the engine drives."""
    state = LoraState(max_loras, max_rank, add)
    parts = lora_parts(model)
    cfg = model.config
    inputs = {"qkv_proj": cfg.hidden_size, "o_proj": cfg.num_attention_heads * cfg.head_dim,
              "gate_up_proj": cfg.hidden_size, "down_proj": cfg.intermediate_size}
    for i in range(len(model.layers)):
        for name, linear in projections(model, i).items():
            linear.lora = LoraTarget(state, inputs[name], parts[name], dtype, device)
    model.lora_state = state
    if hasattr(model, "forget_decode_stacks"):
        model.forget_decode_stacks()
    return state

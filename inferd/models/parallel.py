"""Tensor parallelism, Megatron style, the model's side: the divisibility rule, the shard of each rank (its config
and weights) and the row-parallel all-reduce. Starting the ranks as processes, handing them each step and the loop
they run live in the engine (inferd/engine/tensor_parallel.py): models/ imports nothing from engine/.

In every decoder layer the q/k/v and gate/up projections are column-parallel: rank r holds query heads
[r*H/N, (r+1)*H/N), the KV heads they read (GQA groups stay whole) and 1/N of the MLP's intermediate size.
o_proj and down_proj are row-parallel: each rank multiplies its slice of the input features and an all-reduce adds
the partial sums (two all-reduces per layer). Embedding, norms and lm_head are replicated. Each rank's paged KV
cache holds only its KV heads.

Expert parallelism (MoE blocks, moe.SparseMoE): rank r holds experts [r*E/N, (r+1)*E/N) whole (not a slice of every
expert), routes every token over all E experts with the replicated router, computes only its experts' weighted
share of the output, and an all-reduce adds the ranks' shares (one all-reduce per MoE layer, where a tensor-parallel
MLP also has one). Each rank reads 1/N of the expert weights, and a token costs only the ranks holding its experts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..kernels import REFERENCE as reference_ops
from .config import ModelConfig
from .moe import MoESpec, SparseMoE

if TYPE_CHECKING:
    from .llama import LlamaForCausalLM


# ---- the shard of one rank ---------------------------------------------------------------------------------------
def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """ValueError unless tp splits the model's heads, KV heads and MLP evenly."""
    if tp < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {tp}")
    if tp > 1 and (config.num_experts or config.attention_sinks or config.attention_output_bias):
        # shard_state_dict splits dense MLPs and q/k/v/o only: experts, sinks and an o_proj bias are not sharded
        raise ValueError(f"tensor_parallel={tp} does not run the {config.architecture} architecture (mixture-of-"
                         "experts models run on one device)")
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size}
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp]
    if bad:
        raise ValueError(f"tensor_parallel={tp} does not divide the model's {', '.join(bad)}")


def shard_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config of one rank's shard: its heads and MLP width (head_dim and hidden size unchanged)."""
    check_tensor_parallel(config, tp)
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tp,
                               num_key_value_heads=config.num_key_value_heads // tp,
                               intermediate_size=config.intermediate_size // tp)


def shard_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, tp: int, rank: int
                     ) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of a HF-named state dict (views, not copies; Phi-3's fused projections: copies)."""
    local = shard_config(config, tp)
    q_rows = local.num_attention_heads * config.head_dim
    kv_rows = local.num_key_value_heads * config.head_dim
    inter = local.intermediate_size
    column = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": inter, "up_proj": inter}
    row = {"o_proj": q_rows, "down_proj": inter}
    out = {}
    for name, t in state.items():
        module = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else ""
        if module in ("qkv_proj", "gate_up_proj"):  # Phi-3's fused projections: this rank's rows of each part
            sizes = ([config.num_attention_heads * config.head_dim] + [config.num_key_value_heads * config.head_dim] * 2
                     if module == "qkv_proj" else [config.intermediate_size] * 2)
            shares = [q_rows, kv_rows, kv_rows] if module == "qkv_proj" else [inter, inter]
            t = torch.cat([part[rank * n:(rank + 1) * n] for part, n in zip(t.split(sizes), shares)])
        elif module in column:  # weight [out, in] and bias [out]: this rank's output features
            n = column[module]
            t = t[rank * n:(rank + 1) * n]
        elif module in row:  # weight [out, in]: this rank's input features
            n = row[module]
            t = t[:, rank * n:(rank + 1) * n]
        out[name] = t
    return out


class RowParallel(nn.Module):
    """A row-parallel Linear: this rank multiplies its slice of the input features, and an all-reduce adds the
    partial sums of all ranks (Llama's o_proj and down_proj have no bias, so none is added N times)."""

    def __init__(self, linear: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y


def build_shard(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str | torch.device,
                max_positions: int | None, tp: int, rank: int, group: dist.ProcessGroup) -> LlamaForCausalLM:
    """Rank `rank`'s model: the full model's code over its shard's config, and all-reduces after o_proj and
    down_proj."""
    from .build import build_model

    model = build_model(shard_config(config, tp), shard_state_dict(state, config, tp, rank), dtype, str(device),
                        max_positions)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    return model


# ---- expert parallelism ------------------------------------------------------------------------------------------
def check_expert_parallel(num_experts: int, ep: int) -> None:
    """ValueError unless ep ranks split num_experts evenly."""
    if ep < 1:
        raise ValueError(f"expert_parallel must be at least 1, got {ep}")
    if num_experts % ep:
        raise ValueError(f"expert_parallel={ep} does not divide the model's num_experts={num_experts}")


def expert_range(num_experts: int, ep: int, rank: int) -> tuple[int, int]:
    """The experts [start, stop) rank `rank` of ep holds."""
    check_expert_parallel(num_experts, ep)
    n = num_experts // ep
    return rank * n, (rank + 1) * n


class ExpertParallel(nn.Module):
    """An MoE block whose experts are split over the group's ranks: this rank's SparseMoE (built over its
    expert_range) computes its experts' share, and an all-reduce adds every rank's. forward(x, ops) as the block's."""

    def __init__(self, moe: SparseMoE, group: dist.ProcessGroup):
        super().__init__()
        self.moe = moe
        self.group = group

    def forward(self, x: torch.Tensor, ops=reference_ops) -> torch.Tensor:
        y = self.moe(x, ops)
        dist.all_reduce(y, group=self.group)
        return y


def expert_parallel_block(spec: MoESpec, state: dict[str, torch.Tensor], prefix: str, ep: int, rank: int,
                          group: dist.ProcessGroup) -> ExpertParallel:
    """Rank `rank`'s share of one MoE block, loaded from transformers' names under prefix (SparseMoE.load_hf_state:
    either form); the caller moves it to its dtype and device."""
    moe = SparseMoE(spec, expert_range(spec.num_experts, ep, rank))
    moe.load_hf_state(state, prefix)
    return ExpertParallel(moe, group)

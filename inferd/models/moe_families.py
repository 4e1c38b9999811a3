"""The mixture-of-experts families (Mixtral, Qwen3-MoE, gpt-oss) on the Llama decoder: which layers get an MoE block
(models/moe.py's SparseMoE) instead of the dense MLP, the names and shapes their checkpoints give the router and
experts, the GGUF names of those (llama.cpp's ffn_gate_inp and ffn_{gate,up,down}_exps, stacked over experts), and
what a step reads of them (only the experts its tokens picked).

Checkpoint names, as transformers 5.24's save_pretrained writes them (and as the published checkpoints have them):
- mixtral: model.layers.N.block_sparse_moe.gate.weight [E, H]; ...experts.M.w1/w3.weight [I, H] (gate, up),
  ...experts.M.w2.weight [H, I] (down);
- qwen3_moe: model.layers.N.mlp.gate.weight [E, H]; ...mlp.experts.M.gate_proj/up_proj.weight [I, H],
  ...down_proj.weight [H, I];
- gpt_oss: model.layers.N.mlp.router.weight [E, H] and .bias [E]; ...mlp.experts.gate_up_proj [E, H, 2I] (gate and
  up interleaved) and gate_up_proj_bias [E, 2I]; ...mlp.experts.down_proj [E, I, H] and down_proj_bias [E, H]
  (unquantized: the published gpt-oss checkpoints hold MXFP4 experts, *_blocks and *_scales, which are not read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import ModelConfig

if TYPE_CHECKING:  # the loader reads shapes and names from here without torch
    from torch import nn

    from .moe import MoESpec, SparseMoE

_PER_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def moe_prefix(config: ModelConfig, layer: int) -> str:
    """The checkpoint prefix of layer `layer`'s MoE block, with its dot."""
    block = "block_sparse_moe" if config.architecture == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}."


def moe_spec(config: ModelConfig) -> MoESpec:
    from .moe import GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT, MoESpec

    return MoESpec(config.architecture, config.hidden_size, config.moe_intermediate_size, config.num_experts,
                   config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                   swiglu_alpha=config.swiglu_alpha or GPT_OSS_SWIGLU_ALPHA,
                   swiglu_limit=config.swiglu_limit or GPT_OSS_SWIGLU_LIMIT)


def make_mlp(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a SparseMoE on an MoE layer, else the dense gated MLP."""
    from .layers import MLP
    from .moe import SparseMoE

    return SparseMoE(moe_spec(config)) if config.is_moe_layer(layer) else MLP(config)


def moe_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of layer `layer`'s router and experts (module doc)."""
    p, E, H, inter = moe_prefix(config, layer), config.num_experts, config.hidden_size, config.moe_intermediate_size
    if config.architecture == "gpt_oss":
        return {p + "router.weight": (E, H), p + "router.bias": (E,),
                p + "experts.gate_up_proj": (E, H, 2 * inter), p + "experts.gate_up_proj_bias": (E, 2 * inter),
                p + "experts.down_proj": (E, inter, H), p + "experts.down_proj_bias": (E, H)}
    gate, up, down = _PER_EXPERT_NAMES[config.architecture]
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (E, H)}
    for e in range(E):
        shapes[f"{p}experts.{e}.{gate}.weight"] = (inter, H)
        shapes[f"{p}experts.{e}.{up}.weight"] = (inter, H)
        shapes[f"{p}experts.{e}.{down}.weight"] = (H, inter)
    return shapes


# GGUF (llama.cpp) name of a block tensor -> the checkpoint name after the MoE prefix; "{e}": one of E experts,
# stacked on the GGUF tensor's first (HF order) dimension
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}


def gguf_moe_name(config: ModelConfig, layer: int, gguf_name: str, expert: int | None = None) -> str | None:
    """The checkpoint name (a template with "{e}" for a stacked tensor) of GGUF tensor blk.<layer>.<gguf_name>
    .weight of an MoE layer (llama.cpp's ffn_gate_inp; ffn_*_exps stacked, or the older per-expert ffn_gate.M of
    Mixtral files); None where it is not an MoE tensor."""
    if config.architecture not in _PER_EXPERT_NAMES or not config.is_moe_layer(layer):
        return None
    p = moe_prefix(config, layer)
    if gguf_name == "ffn_gate_inp":
        return p + "gate.weight"
    names = _PER_EXPERT_NAMES[config.architecture]
    if gguf_name in _GGUF_EXPERT_NAMES:
        return f"{p}experts.{{e}}.{names[_GGUF_EXPERT_NAMES[gguf_name]]}.weight"
    per_expert = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2}
    if expert is not None and gguf_name in per_expert:
        return f"{p}experts.{expert}.{names[per_expert[gguf_name]]}.weight"
    return None


def moe_blocks(model: nn.Module) -> list[SparseMoE]:
    from .moe import SparseMoE

    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def expert_bytes_touched(blocks: list[SparseMoE], rows: int = 1) -> int:
    """Bytes of expert weights the last step read: each block's experts that at least one of its tokens picked, once
    (the routers are counted with the dense weights)."""
    return sum(b.weight_bytes_touched(rows=rows) - b.router_bytes() for b in blocks)

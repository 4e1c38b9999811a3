"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's changes, computed in transformers' order
(Gemma2ForCausalLM, Gemma3ForCausalLM).

- RMSNorm scales by (1 + w), in float32 before the cast back (GemmaRMSNorm), and a layer has four of them: around
  the attention (input, post_attention) and around the MLP (pre_feedforward, post_feedforward), each sublayer's
  output normed before it is added to the residual stream.
- Gemma 3: q and k are RMSNormed per head (the same (1 + w) norm); the scale is query_pre_attn_scalar ** -0.5.
- Sliding layers (a window) and global layers interleave; Gemma 3's sliding layers rotate by their own RoPE base
  (rope_local_theta, unscaled), global ones by rope_theta and rope_scaling: two rotary tables. Gemma 2 soft-caps
  its attention scores (attn_logit_softcapping, in the attention kernels).
- The embedding is scaled by sqrt(hidden_size), that factor cast to the model's dtype first; the MLP gates with
  GELU (tanh approximation); the logits may be soft-capped (final_logit_softcapping); the head is tied.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .config import ModelConfig
from .layers import Linear, RMSNorm
from .llama import LlamaForCausalLM
from .rope import RotaryEmbedding


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): the weight holds w (checkpoints store it so, starting at 0); computed in float32 and
    cast to the input's dtype last, as Gemma3RMSNorm does (Llama casts before multiplying)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, self.inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(h, 2 * self.inter, False)
        self.down_proj = Linear(self.inter, h, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = bool(config.layer_types and config.layer_types[layer] == "sliding_attention")
        self.self_attn = Attention(config, layer)
        if config.qk_norm:  # Gemma 3
            self.self_attn.q_norm = GemmaRMSNorm(config.head_dim, eps)
            self.self_attn.k_norm = GemmaRMSNorm(config.head_dim, eps)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, hidden, positions, meta, k_cache, v_cache, ops, rotary):
        x = self.input_layernorm.forward(hidden)
        x = self.self_attn.forward(x, positions, meta, k_cache, v_cache, ops, rotary)
        hidden = hidden + self.post_attention_layernorm.forward(x)
        x = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden))
        return hidden + self.post_feedforward_layernorm.forward(x)


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int | None = None, dtype: torch.dtype = torch.float32):
        super().__init__(config, max_positions, dtype)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Gemma 3's sliding layers' table: their own base, no scaling (Gemma3RotaryEmbedding's "sliding_attention")
        self.rotary_local = self.rotary
        if config.rope_local_theta is not None:
            local = dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
            self.rotary_local = RotaryEmbedding(local, max_positions or config.max_position_embeddings, dtype)
        self.embed_scale = config.hidden_size ** 0.5
        self.drop_unreachable_windows(max_positions or config.max_position_embeddings)

    def forward(self, input_ids, positions, meta, kv_caches):
        ops = self.ops
        hidden = self.embed_tokens(input_ids)
        # transformers: embed_scale (a float32 tensor) cast to the weights' dtype, then the product
        hidden = hidden * torch.tensor(self.embed_scale).to(hidden.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            rotary = self.rotary_local if layer.sliding else self.rotary
            hidden = layer.forward(hidden, positions, meta, k_cache, v_cache, ops, rotary)
        return self.norm.forward(hidden)

    def _decode_stack(self, rows: int) -> tuple | None:
        return None  # decode_layers runs the Llama layer only

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:  # in the model's dtype, as transformers' Gemma models
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_hf_state_dict(state)
        for i, layer in enumerate(self.layers):
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                getattr(layer, name).weight.copy_(state[f"model.layers.{i}.{name}.weight"])

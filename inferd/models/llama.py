"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain PyTorch over a paged KV cache.

Rows of a step are flattened: [T, hidden], decodes first, then prefill chunks. Projections that read the same input
are fused (q/k/v into one matmul, gate/up into one): fewer, larger matmuls are what a CPU (and a GPU) does best.
Logits are computed only for the rows that are sampled (compute_logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, decode_attention, prefill_attention, write_kv
from .config import ModelConfig
from .rope import RotaryEmbedding, apply_rotary


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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(T, self.n_kv, self.head_dim), cos, sin)
        v = v.view(T, self.n_kv, self.head_dim)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if nd == T:
            out = decode_attention(q, k_cache, v_cache, meta, self.scale)
        else:
            parts = []
            if nd:
                parts.append(decode_attention(q[:nd], k_cache, v_cache, meta, self.scale))
            for seq in meta.prefills:
                s, e = seq.start, seq.end
                parts.append(prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, seq, self.scale))
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.o_proj(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=False)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as transformers names them, fusing q/k/v and gate/up."""
        cfg = self.config
        params = dict(self.named_parameters())

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name} missing from checkpoint")
            return state[name]

        def put(name: str, value: torch.Tensor) -> None:
            p = params[name]
            if p.shape != value.shape:
                raise ValueError(f"weight {name}: checkpoint shape {tuple(value.shape)}, model {tuple(p.shape)}")
            p.copy_(value)

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"))
        for i in range(cfg.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            put(dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", take(src + "post_attention_layernorm.weight"))
            attn = src + "self_attn."
            put(dst + "self_attn.qkv_proj.weight",
                torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"], dim=0))
            if cfg.attention_bias:
                put(dst + "self_attn.qkv_proj.bias", torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]))
            put(dst + "self_attn.o_proj.weight", take(attn + "o_proj.weight"))
            mlp = src + "mlp."
            put(dst + "mlp.gate_up_proj.weight",
                torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")], dim=0))
            put(dst + "mlp.down_proj.weight", take(mlp + "down_proj.weight"))

"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain PyTorch over a paged KV cache.

Rows of a step are flattened: [T, hidden], decodes first, then prefill chunks. Projections that read the same input
are fused (q/k/v into one matmul, gate/up into one): fewer, larger matmuls are what a CPU (and a GPU) does best.
Logits are computed only for the rows that are sampled (compute_logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import REFERENCE as reference_ops
from .attention import AttentionMetadata, decode_attention, prefill_attention
from .batch_invariant import invariant_attention, tiled_rows
from .config import ModelConfig
from .rope import RotaryEmbedding


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows is not None and x.dim() == 2:
            return tiled_rows(self._forward, x, self.tile_rows)
        return self._forward(x)

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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        h, qkv = config.hidden_size, self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(h, qkv, config.attention_bias)
        self.o_proj = Linear(self.q_size, h, False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, positions, meta: AttentionMetadata, k_cache, v_cache, ops, rotary):
        T = x.shape[0]
        qkv = self.qkv_proj.forward(x)  # [T, q + k + v], rows contiguous
        # RoPE on q and k in place, and k, v written to their cache slots: one op (kernels/)
        ops.rope_kv_write(qkv, positions, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping, self.n_heads,
                          self.n_kv)
        q = qkv[:, :self.q_size].view(T, self.n_heads, self.head_dim)
        if meta.invariant is not None:  # batch-invariant mode: every row the same way (batch_invariant.py)
            out = invariant_attention(q, k_cache, v_cache, meta.invariant, self.scale)
            return self.o_proj.forward(out.reshape(T, self.q_size))
        parts = []
        if meta.decode_tables is not None:  # the fused kernel reads the paged cache in place
            nd = meta.num_decode_tokens
            parts.append(ops.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_tables, meta.decode_lens,
                                                    self.scale))
        else:
            parts.extend(decode_attention(q[g.start:g.end], k_cache, v_cache, g, self.scale)
                         for g in meta.decode_groups)
        if meta.prefill_tables is not None:  # every chunk in one call, read from the cache in place
            nd = meta.num_decode_tokens
            parts.append(ops.paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens,
                                                     meta.prefill_context_lens, meta.prefill_tables, self.scale))
        elif meta.prefills:
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.n_kv, self.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(T, self.n_kv, self.head_dim)
            for seq in meta.prefills:
                s, e = seq.start, seq.end
                parts.append(prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, seq, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return self.o_proj.forward(out.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, self.inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(h, 2 * self.inter, False)
        self.down_proj = Linear(self.inter, h, False)

    def forward(self, x, ops=reference_ops):
        return self.down_proj.forward(ops.silu_mul(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, positions, meta, k_cache, v_cache, ops, rotary):
        """x: the previous layer's output (None for the first layer), added to residual (in place) before the norm;
        returns this layer's MLP output, which the next layer (or the final norm) adds."""
        h = ops.add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        h = self.self_attn.forward(h, positions, meta, k_cache, v_cache, ops, rotary)
        h = ops.add_rms_norm(h, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self.mlp.forward(h, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        # _weight: no random init (on the meta device, normal_ goes through torch._refs and imports torch._dynamo,
        # 1.2 s of every worker start); the checkpoint fills it
        self.embed_tokens = nn.Embedding(v, h, _weight=torch.empty(v, h))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # a tied head still gets its own Linear: on CPU it is repacked, and the embedding keeps its plain rows
        self.lm_head = Linear(h, v, False)
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings, dtype)
        # the step's operators (inferd/kernels): the torch references until an engine selects the fused ones
        self.ops = reference_ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # submodules are called through .forward: nn.Module.__call__'s hook machinery cost ~1 ms per batch-1
        # step over the 30 layers' ~300 calls (no hooks are used on this model)
        ops, rotary = self.ops, self.rotary
        residual = self.embed_tokens(input_ids)  # a fresh tensor: the residual stream, added to in place
        if (getattr(ops, "decode_layers", None) is not None and meta.decode_tables is not None and not meta.prefills
                and meta.invariant is None):
            # a pure decode step: the whole stack in one call (the same ops, in the same order: the same bits)
            stack = self._decode_stack(input_ids.shape[0])
            if stack is not None:
                norms, weights, aux, biases, kinds = stack
                attn = self.layers[0].self_attn
                return ops.decode_layers(residual, positions, rotary.cos, rotary.sin, meta.slot_mapping,
                                         meta.decode_tables, meta.decode_lens, [k for k, _ in kv_caches],
                                         [v for _, v in kv_caches], norms, self.norm.eps, weights, aux, biases,
                                         kinds, attn.n_heads, attn.n_kv, attn.scale)
        x = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer.forward(x, residual, positions, meta, k_cache, v_cache, ops, rotary)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)

    def _decode_stack(self, rows: int) -> tuple | None:
        """decode_layers' lists for a step of `rows` rows (norm weights, then per layer four (kind, weight, aux,
        bias) matmuls), built once per regime (the int4 kernel's few rows, or more) and kept; None where a layer
        has something decode_layers does not run (int8 weights, tensor-parallel shards, batch-invariant tiles,
        different norm epsilons)."""
        from .quantize import INT4_MAX_ROWS  # (quantize imports this module: imported here, when first needed)

        key = rows <= INT4_MAX_ROWS  # Int4Linear multiplies its int4 weights up to there, its dense copy past it
        cache = self.__dict__.setdefault("_decode_stacks", {})
        if key in cache:
            return cache[key]
        stack = None
        norms, weights, aux, biases, kinds = [], [], [], [], []
        ok = True
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                ok &= norm.eps == self.norm.eps
                norms.append(norm.weight)
            for linear in (getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None),
                           getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)):
                entry = linear.stack_entry(rows) if isinstance(linear, Linear) else None
                if entry is None:
                    ok = False
                    break
                kind, weight, extra, bias = entry
                kinds.append(kind)
                weights.append(weight)
                aux.append(extra)
                biases.append(bias)
            if not ok:
                break
        if ok:
            norms.append(self.norm.weight)
            stack = (norms, weights, aux, biases, kinds)
        cache[key] = stack
        return stack

    def forget_decode_stacks(self) -> None:
        """Drop the kept decode_layers lists (after the model's modules or weights were replaced)."""
        self.__dict__.pop("_decode_stacks", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

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

        embed = take("model.embed_tokens.weight")
        put("embed_tokens.weight", embed)
        put("norm.weight", take("model.norm.weight"))
        self.lm_head.load(embed if cfg.tie_word_embeddings else take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            put(dst + "input_layernorm.weight", take(src + "input_layernorm.weight"))
            put(dst + "post_attention_layernorm.weight", take(src + "post_attention_layernorm.weight"))
            attn = src + "self_attn."
            layer.self_attn.qkv_proj.load(
                torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"], dim=0),
                torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]) if cfg.attention_bias else None)
            layer.self_attn.o_proj.load(take(attn + "o_proj.weight"))
            mlp = src + "mlp."
            layer.mlp.gate_up_proj.load(torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]))
            layer.mlp.down_proj.load(take(mlp + "down_proj.weight"))

    def pack_weights(self) -> int:
        """Repack every Linear for the device's fastest kernel; returns how many were repacked."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer and the head; the embedding table is only
        looked up a row per token."""
        tensors = [m.weight for m in self.modules() if isinstance(m, RMSNorm)]
        total = 0
        for m in self.modules():
            if isinstance(m, Linear) and hasattr(m, "step_bytes"):  # int4: the 4-bit codes a decode step reads
                total += m.step_bytes(1)
            elif isinstance(m, Linear):
                tensors.append(m.packed if m.packed is not None else m.weight)
            if isinstance(m, Linear) and m.bias is not None:
                tensors.append(m.bias)
        return total + sum(t.numel() * t.element_size() for t in tensors)

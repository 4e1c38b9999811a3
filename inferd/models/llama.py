"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3/4; with an MoE block for Mixtral,
Qwen3-MoE and gpt-oss: moe_families.py) in plain PyTorch over a paged KV cache. Gemma 2/3 change the layer (gemma.py).

Rows of a step are flattened: [T, hidden], decodes first, then prefill chunks. Projections that read the same input
are fused (q/k/v into one matmul, gate/up into one): fewer, larger matmuls are what a CPU (and a GPU) does best.
Logits are computed only for the rows that are sampled (compute_logits). The layers are the shared ones (layers.py,
attention.py); this module stacks them the Llama way and loads weights as transformers names them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import REFERENCE as reference_ops
from .attention import Attention, AttentionMetadata
from .config import ModelConfig
from .layers import Linear, RMSNorm
from .moe_families import expert_bytes_touched, make_mlp, moe_blocks, moe_prefix
from .quantize import INT4_MAX_ROWS
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer)  # the gated MLP, or an MoE block (moe.py) on an MoE family's MoE layers

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
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # a tied head still gets its own Linear: on CPU it is repacked, and the embedding keeps its plain rows
        self.lm_head = Linear(h, v, False)
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings, dtype)
        # the step's operators (inferd/kernels): the torch references until an engine selects the fused ones
        self.ops = reference_ops
        self.drop_unreachable_windows(max_positions or config.max_position_embeddings)

    def drop_unreachable_windows(self, max_positions: int) -> None:
        """A sliding window of max_positions or more never hides a position (Mistral v0.1's 4096 at a shorter
        context, Phi-4-mini's 262144): such a layer attends plainly, and the fused kernels keep running it."""
        for layer in self.layers:
            if layer.self_attn.window >= max_positions:
                layer.self_attn.window = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # submodules are called through .forward: nn.Module.__call__'s hook machinery cost ~1 ms per batch-1
        # step over the 30 layers' ~300 calls (no hooks are used on this model)
        ops, rotary = self.ops, self.rotary
        residual = self.embed_tokens(input_ids)  # a fresh tensor: the residual stream, added to in place
        lora = getattr(self, "lora_state", None)
        step = lora.step if lora is not None else None
        # LoRA rows: decode_layers adds their deltas by the fused lora_add, so only where the state's operator is it
        if (getattr(ops, "decode_layers", None) is not None and meta.decode_tables is not None and not meta.prefills
                and meta.invariant is None and (step is None or lora.add is getattr(ops, "lora_add", None))):
            # a pure decode step: the whole stack in one call (the same ops, in the same order: the same bits)
            stack = self._decode_stack(input_ids.shape[0])
            norms, weights, aux, biases, kinds, lora_a, lora_bt, lora_parts = stack or (None,) * 8
            if stack is not None and (step is None or lora_a):  # LoRA rows need the stack's LoRA slots
                if step is None:
                    lora_args = (None, [], [], None, [], [], [], [])
                else:
                    lora_args = (step.perm, step.seg_slots, step.seg_starts, step.row_slots, lora_a, lora_bt,
                                 step.ranks, lora_parts)
                attn = self.layers[0].self_attn
                return ops.decode_layers(residual, positions, rotary.cos, rotary.sin, meta.slot_mapping,
                                         meta.decode_tables, meta.decode_lens, [k for k, _ in kv_caches],
                                         [v for _, v in kv_caches], norms, self.norm.eps, weights, aux, biases,
                                         kinds, attn.n_heads, attn.n_kv, attn.scale, *lora_args)
        x = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer.forward(x, residual, positions, meta, k_cache, v_cache, ops, rotary)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)

    def _decode_stack(self, rows: int) -> tuple | None:
        """decode_layers' lists for a step of `rows` rows (norm weights, then per layer four (kind, weight, aux,
        bias) matmuls; then their LoRA slots: a and bt per matmul and the part sizes, empty without LoRA), built
        once per regime (the int4 kernel's few rows, or more) and kept; None where a layer has something
        decode_layers does not run (int8 weights, tensor-parallel shards, batch-invariant tiles, different norm
        epsilons, attention options, an MoE block: it has no gate_up_proj; LoRA on some matmuls and not others)."""
        key = rows <= INT4_MAX_ROWS  # Int4Linear multiplies its int4 weights up to there, its dense copy past it
        cache = self.__dict__.setdefault("_decode_stacks", {})
        if key in cache:
            return cache[key]
        stack = None
        norms, weights, aux, biases, kinds = [], [], [], [], []
        targets = []  # each matmul's LoraTarget (or None)
        ok = True
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            ok &= attn.plain
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
                targets.append(linear.lora)
            if not ok:
                break
        lora_a, lora_bt, lora_parts = [], [], []
        if ok and any(t is not None for t in targets):
            ok = all(t is not None for t in targets)
            for t in targets if ok else ():
                lora_a.append(t.a)
                lora_bt.append(t.bt)
            ok = ok and all(t.parts == targets[i % 4].parts for i, t in enumerate(targets))  # one set of parts
            for t in targets[:4] if ok else ():
                lora_parts += [len(t.parts), *t.parts]
        if ok:
            norms.append(self.norm.weight)
            stack = (norms, weights, aux, biases, kinds, lora_a, lora_bt, lora_parts)
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
            if attn + "qkv_proj.weight" in state:  # Phi-3: fused in the checkpoint, in our order (q, k, v)
                layer.self_attn.qkv_proj.load(take(attn + "qkv_proj.weight"))
            else:
                layer.self_attn.qkv_proj.load(
                    torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"], dim=0),
                    torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"]) if cfg.attention_bias else None)
            layer.self_attn.o_proj.load(take(attn + "o_proj.weight"),
                                        take(attn + "o_proj.bias") if cfg.attention_output_bias else None)
            if cfg.qk_norm:  # Qwen3, Qwen3-MoE, Gemma 3
                put(dst + "self_attn.q_norm.weight", take(attn + "q_norm.weight"))
                put(dst + "self_attn.k_norm.weight", take(attn + "k_norm.weight"))
            if cfg.attention_sinks:
                put(dst + "self_attn.sinks", take(attn + "sinks"))
            if cfg.is_moe_layer(i):  # router and experts, as the family's checkpoint names them (moe_families.py)
                layer.mlp.load_hf_state(state, moe_prefix(cfg, i))
                continue
            mlp = src + "mlp."
            if mlp + "gate_up_proj.weight" in state:  # Phi-3: fused, gate then up
                layer.mlp.gate_up_proj.load(take(mlp + "gate_up_proj.weight"))
            else:
                layer.mlp.gate_up_proj.load(torch.cat([take(mlp + "gate_proj.weight"),
                                                       take(mlp + "up_proj.weight")]))
            layer.mlp.down_proj.load(take(mlp + "down_proj.weight"))

    def pack_weights(self) -> int:
        """Repack every Linear, and every MoE block's experts (not Linears), for the device's fastest kernel; returns
        how many were repacked."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear)) + sum(b.pack() for b in moe_blocks(self))

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer and the head; the embedding table is only
        looked up a row per token. An MoE block's experts are not in it: a step reads only those its tokens picked
        (moe_families.expert_bytes_touched); its router is."""
        tensors = [m.weight for m in self.modules() if isinstance(m, RMSNorm)]
        total = 0
        for name, m in self.named_modules():
            if ".experts" in name:
                continue
            if isinstance(m, Linear) and hasattr(m, "step_bytes"):  # int4: the 4-bit codes a decode step reads
                total += m.step_bytes(1)
            elif isinstance(m, Linear):
                tensors.append(m.packed if m.packed is not None else m.weight)
            if isinstance(m, Linear) and m.bias is not None:
                tensors.append(m.bias)
        return total + sum(t.numel() * t.element_size() for t in tensors)

    def expert_bytes_touched(self, rows: int = 1) -> int:
        """Bytes of MoE expert weights the last forward read: per MoE block, each expert its tokens picked, once
        (0 for a dense model). rows: the step's rows (an int4 expert reads its 4-bit or its dense copy by rows)."""
        blocks = self.__dict__.get("_moe_blocks")
        if blocks is None:
            blocks = self.__dict__["_moe_blocks"] = moe_blocks(self)
        return expert_bytes_touched(blocks, rows) if blocks else 0

"""ModelConfig: the architecture facts the runtime needs, read from a HF config.json or GGUF metadata."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi3", "mixtral",
                           "qwen3_moe", "gpt_oss")
# general.architecture values we load from GGUF (a "llama" with experts is Mixtral; "qwen3moe" is Qwen3-MoE)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe")
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe", "gpt_oss")  # a decoder layer's MLP is models/moe.py's SparseMoE
_MISSING = object()


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3" (text) | "phi3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # attention options of some families (models/attention.py, kernels/paged.attend)
    sliding_window: int | None = None  # the positions a sliding layer attends to, its own included
    # each layer's kind, "sliding_attention" or "full_attention" (transformers' layer_types); None with a
    # sliding_window: every layer slides
    layer_types: list[str] | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: scores soft-capped, softcap * tanh(s / softcap)
    final_logit_softcapping: float | None = None  # Gemma 2/3: the logits soft-capped the same way
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in each softmax's denominator
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale query_pre_attn_scalar ** -0.5
    partial_rotary_factor: float = 1.0  # Phi: RoPE on the first head_dim * factor dims of each head
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled); None: rope_theta
    attention_output_bias: bool = False  # gpt-oss: o_proj has a bias too (its attention_bias covers q/k/v/o)
    # mixture of experts (MOE_ARCHITECTURES; models/moe.py): the MLP of an MoE layer routes each token to
    # num_experts_per_tok of num_experts gated MLPs of moe_intermediate_size
    num_experts: int = 0  # HF num_local_experts (Mixtral, gpt-oss) or num_experts (Qwen3-MoE); 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's (Qwen3-MoE's moe_intermediate_size; else intermediate_size)
    norm_topk_prob: bool = True  # Qwen3-MoE: the top-k weights renormalised to sum 1 (Mixtral always does)
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i is MoE where (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not one of these
    swiglu_alpha: float | None = None  # gpt-oss: the experts' clamped SwiGLU (moe.gpt_oss_swiglu)
    swiglu_limit: float | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (else the dense gated MLP of intermediate_size)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layer_window(self, layer: int) -> int:
        """The sliding window of layer `layer` (0: it attends to its whole context)."""
        if not self.sliding_window:
            return 0
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return 0

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (head_dim, less with partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type == "gemma3" and isinstance(d.get("text_config"), dict):  # the multimodal config: its text part
            d = {**d["text_config"], "model_type": "gemma3_text"}
        model_type = "gemma3" if model_type == "gemma3_text" else model_type
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_local_theta = d.get("rope_local_base_freq")  # Gemma 3 before transformers 5
        partial_rotary_factor = d.get("partial_rotary_factor")
        # transformers 5 moved rope settings into "rope_parameters" (Gemma 3: one dict per layer type)
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
            rope_local_theta = (rp.get("sliding_attention") or {}).get("rope_theta", rope_local_theta)
            rp = rp["full_attention"]
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            partial_rotary_factor = rp.get("partial_rotary_factor", partial_rotary_factor)
            if rp.get("rope_type", rp.get("type", "default")) != "default":
                rope_scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        if model_type == "phi3" and rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            if rope_scaling.get("rope_type", rope_scaling.get("type")) in ("su", "yarn", "longrope"):  # Phi3Config's
                rope_scaling["rope_type"] = "longrope"
            rope_scaling.setdefault("original_max_position_embeddings", d.get("original_max_position_embeddings"))
        if model_type == "gemma3":
            rope_theta = 1_000_000.0 if rope_theta is None else rope_theta  # Gemma3TextConfig's defaults
            rope_local_theta = 10_000.0 if rope_local_theta is None else rope_local_theta
        sliding_window, layer_types = _sliding_layers(model_type, d)
        fields: dict[str, Any] = dict(
            architecture=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type in ("gemma2", "gemma3"))),
            # Phi-3's fused projection has no bias whatever the config says
            attention_bias=model_type != "phi3" and bool(d.get("attention_bias", model_type in ("qwen2", "gpt_oss"))),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding_window,
            layer_types=layer_types,
            # Gemma 2 soft-caps scores and logits (Gemma2Config's defaults 50 and 30); Gemma3Attention holds
            # attn_logit_softcapping but never applies it, Gemma3ForCausalLM applies the final one
            attn_logit_softcapping=d.get("attn_logit_softcapping", 50.0) if model_type == "gemma2" else None,
            final_logit_softcapping=(d.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None)
                                     if model_type in ("gemma2", "gemma3") else None),
            qk_norm=model_type in ("qwen3", "gemma3"),
            query_pre_attn_scalar=(float(d.get("query_pre_attn_scalar", 256)) if model_type in ("gemma2", "gemma3")
                                   else None),
            partial_rotary_factor=float(partial_rotary_factor or 1.0),
            rope_local_theta=float(rope_local_theta) if model_type == "gemma3" else None,
        )
        fields.update(_family_fields(model_type, d))  # the MoE families' own (their windows and norms included)
        return cls(**fields)

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], tensor_names: Collection[str]) -> ModelConfig:
        """Build a config from GGUF metadata (`fields`: key -> value, arrays as sequences) and the tensor names."""
        arch = fields.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = _MISSING) -> Any:
            value = fields.get(f"{arch}.{key}", default)
            if value is _MISSING:
                raise ValueError(f"GGUF metadata is missing {arch}.{key}")
            return value

        def scalar(key: str, default: Any = _MISSING) -> Any:
            value = get(key, default)
            if isinstance(value, (list, tuple)):  # some files store per-layer values
                if not value or any(v != value[0] for v in value):
                    raise ValueError(f"GGUF {arch}.{key} varies per layer ({value!r}); not supported")
                value = value[0]
            return value

        hidden = int(scalar("embedding_length"))
        heads = int(scalar("attention.head_count"))
        kv_heads = int(scalar("attention.head_count_kv", heads) or heads)
        rope_dims = scalar("rope.dimension_count", None)
        # Phi-3 writes no key_length, and its rope.dimension_count is the rotated part of a head
        head_dim = scalar("attention.key_length", None) or (arch != "phi3" and rope_dims) or hidden // heads

        vocab = fields.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = fields.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
            vocab = len(tokens)

        rope_scaling: dict[str, Any] | None = None
        scaling_type = fields.get(f"{arch}.rope.scaling.type")
        factor = fields.get(f"{arch}.rope.scaling.factor")
        if scaling_type is None and fields.get(f"{arch}.rope.scale_linear") is not None:  # legacy key
            scaling_type, factor = "linear", fields[f"{arch}.rope.scale_linear"]
        if scaling_type not in (None, "none") and factor not in (None, 0, 0.0, 1, 1.0):
            rope_scaling = {"rope_type": str(scaling_type), "factor": float(factor)}
            orig = fields.get(f"{arch}.rope.scaling.original_context_length")
            if orig is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig)

        eos_ids: list[int] = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            value = fields.get(key)
            if value is not None and int(value) not in eos_ids:
                eos_ids.append(int(value))
        bos = fields.get("tokenizer.ggml.bos_token_id")

        names = set(tensor_names)
        n_layers = int(scalar("block_count"))
        family: dict[str, Any] = {}
        if arch in ("gemma2", "gemma3"):
            # as llama.cpp reads them (src/llama-model.cpp): every pattern-th layer global (Gemma 3: 6 unless the file
            # says, Gemma 2: 2), Gemma 3's sliding layers' RoPE base 10000 unless freq_base_swa, the attention scale
            # 1/sqrt(head_dim) except the 27B models' (Gemma 3: 62 layers, Gemma 2: 46) which use hidden / heads
            gemma3 = arch == "gemma3"
            pattern = fields.get(f"{arch}.attention.sliding_window_pattern", 6 if gemma3 else 2)
            if isinstance(pattern, (list, tuple)):  # per layer: True where the layer slides
                layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
            else:
                layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                               for i in range(n_layers)]
            window = fields.get(f"{arch}.attention.sliding_window")
            big = n_layers == (62 if gemma3 else 46)
            family = dict(sliding_window=int(window) if window else None, layer_types=layer_types if window else None,
                          qk_norm=gemma3, query_pre_attn_scalar=float(hidden // heads if big else head_dim),
                          rope_local_theta=float(fields.get(f"{arch}.rope.freq_base_swa", 10000.0)) if gemma3 else None,
                          attn_logit_softcapping=fields.get(f"{arch}.attn_logit_softcapping"),
                          final_logit_softcapping=fields.get(f"{arch}.final_logit_softcapping"))
        elif arch == "qwen3":
            family = dict(qk_norm=True)
        elif arch == "phi3":
            window = fields.get(f"{arch}.attention.sliding_window")
            family = dict(sliding_window=int(window) if window else None,
                          partial_rotary_factor=(int(rope_dims) if rope_dims else int(head_dim)) / int(head_dim))
            if "rope_factors_long.weight" in names:  # longrope: the factors themselves are tensors (the loader)
                orig = fields.get(f"{arch}.rope.scaling.original_context_length")
                rope_scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(orig),
                                "attention_factor": float(fields.get(f"{arch}.rope.scaling.attn_factor", 1.0))}
        moe: dict[str, Any] = {}
        experts = int(scalar("expert_count", 0) or 0)
        if experts:  # llama.cpp's Mixtral is a "llama" with experts; a layer without a router is dense
            layers = int(scalar("block_count"))
            moe = dict(num_experts=experts, num_experts_per_tok=int(scalar("expert_used_count")),
                       moe_intermediate_size=int(scalar("expert_feed_forward_length", 0)
                                                 or scalar("feed_forward_length")),
                       mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names])
        if arch == "qwen3moe":  # llama.cpp's qwen3moe always renormalises the top-k weights (as transformers reads it)
            moe.update(norm_topk_prob=True, qk_norm="blk.0.attn_q_norm.weight" in names)
        architecture = {"qwen3moe": "qwen3_moe"}.get(str(arch), str(arch))
        if architecture == "llama" and experts:
            architecture = "mixtral"
        return cls(
            **moe,
            architecture=architecture,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(scalar("feed_forward_length")),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(scalar("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(scalar("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(scalar("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            **family,
        )


def _sliding_layers(model_type: str, d: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers' config classes derive them: Mistral and Phi-3 slide every layer
    when sliding_window is set (their masks: create_sliding_window_causal_mask); Qwen2/3 only with use_sliding_window,
    from layer max_window_layers on; Gemma 3 interleaves, every sliding_window_pattern-th layer (default 6) global,
    Gemma 2 every other layer."""
    window = d.get("sliding_window")
    layer_types = d.get("layer_types")
    n = d["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            return None, None
        if layer_types is None:
            first = d.get("max_window_layers", 28)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    elif model_type in ("gemma2", "gemma3"):
        window = d.get("sliding_window", 4096)
        if layer_types is None:
            default = 6 if model_type == "gemma3" else 2
            pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", default))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    elif model_type not in ("mistral", "phi3"):
        return None, None
    if not window:
        return None, None
    return int(window), (list(layer_types) if layer_types is not None else None)


def _family_fields(model_type: str, d: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields only some families have, from their HF config dict."""
    if model_type not in MOE_ARCHITECTURES:
        return {}
    out: dict[str, Any] = dict(
        num_experts=int(d.get("num_local_experts") or d.get("num_experts") or 0),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
    )
    if model_type == "mixtral":  # every layer's window, where it has one
        out.update(sliding_window=d.get("sliding_window"))
    elif model_type == "qwen3_moe":
        out.update(norm_topk_prob=bool(d.get("norm_topk_prob", False)), qk_norm=True,
                   decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                   mlp_only_layers=[int(i) for i in d.get("mlp_only_layers") or []],
                   sliding_window=d.get("sliding_window") if d.get("use_sliding_window") else None)
    elif model_type == "gpt_oss":
        layers = d["num_hidden_layers"]
        out.update(sliding_window=d.get("sliding_window", 128), attention_sinks=True,
                   attention_output_bias=bool(d.get("attention_bias", True)),
                   # transformers' default: even layers slide, odd ones attend to everything
                   layer_types=d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                        for i in range(layers)],
                   swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), swiglu_limit=float(d.get("swiglu_limit", 7.0)))
    return out

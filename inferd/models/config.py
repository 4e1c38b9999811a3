"""ModelConfig: the architecture facts the runtime needs, read from a HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
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

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        # transformers 5 moved rope settings into "rope_parameters"
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
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
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

"""Rotary position embeddings: plain RoPE, linear, Llama 3, Phi-3's longrope and YaRN scaling, computed as
transformers does."""

from __future__ import annotations

import math

import torch

from ..kernels.reference import apply_rotary, rotate_half  # noqa: F401 - the model's API
from .config import ModelConfig


def _kind(config: ModelConfig) -> str | None:
    scaling = config.rope_scaling
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def longrope_attention_factor(config: ModelConfig) -> float:
    """The factor longrope multiplies cos and sin by (transformers' _compute_longrope_parameters): the config's, or
    sqrt(1 + ln(factor) / ln(original context)) with factor max_position_embeddings / original context."""
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """The inverse frequencies; longrope's short factors (the ones transformers' rotary_emb.inv_freq holds), or with
    long=True its long ones."""
    dim = config.rotary_dim  # partial rotary (Phi): the tables cover only the rotated dims
    shape = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    kind = _kind(config)
    if kind == "longrope":
        factors = config.rope_scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta ** shape)
    inv_freq = 1.0 / (config.rope_theta ** shape)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    if kind == "yarn":
        return _yarn_inv_freq(config, dim)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3, longrope, yarn)")


def _yarn_factor(config: ModelConfig) -> float:
    scaling = config.rope_scaling
    factor = scaling.get("factor")
    if factor is None:
        return config.max_position_embeddings / scaling["original_max_position_embeddings"]
    return factor


def _yarn_inv_freq(config: ModelConfig, dim: int) -> torch.Tensor:
    """YaRN (gpt-oss): each frequency between the extrapolated (unscaled) and the interpolated (divided by factor)
    one by a linear ramp over the dims whose wavelengths fall between beta_fast and beta_slow rotations of the original
    context; transformers' _compute_yarn_parameters, step for step (the same float32 bits)."""
    scaling, base = config.rope_scaling, config.rope_theta
    factor = _yarn_factor(config)
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (YaRN's attention scaling; 1.0 for the other kinds)."""
    scaling = config.rope_scaling
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config)

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin tables for every position up to max_positions; lookup by position index."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.config, self.max_positions, self.dtype = config, max_positions, dtype
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device: torch.device | str | None = None) -> None:
        """Fill the tables (again after the model was built on the meta device)."""
        device = device or self.cos.device
        if device == torch.device("meta"):
            return
        positions = torch.arange(self.max_positions, dtype=torch.float)
        freqs = positions[:, None] * rope_inv_freq(self.config)[None, :]
        scale = rope_attention_factor(self.config)  # YaRN's (1.0 for the others but longrope, below)
        if _kind(self.config) == "longrope":
            # transformers switches a whole forward to the long factors once it reaches past the original context
            # (and Phi3ForCausalLM recomputes the cache then); a paged cache keeps what it computed, so here a
            # position past the original context rotates by the long factors and one within it by the short ones:
            # the same as transformers for every sequence within the original context
            orig = int(self.config.rope_scaling["original_max_position_embeddings"])
            long = positions[:, None] * rope_inv_freq(self.config, long=True)[None, :]
            freqs = torch.where(positions[:, None] >= orig, long, freqs)
            scale = longrope_attention_factor(self.config)
        emb = torch.cat((freqs, freqs), dim=-1)
        # as transformers: cos() * attention_scaling in float32, then the model's dtype
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.cos = cos.to(device=device, dtype=self.dtype)
        self.sin = sin.to(device=device, dtype=self.dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]

"""Pooling for embeddings: how a model's per-token hidden states become one vector per input (mean, cls, max or the
last token, then normalized or not), as its sentence-transformers folder says or the flags override.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

POOLING_MODES = ("mean", "cls", "max", "lasttoken")
DECODER_POOLING_MODES = ("lasttoken", "mean")  # a causal model's first token sees nothing: no cls, no max


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None
    dimension: int | None = None


def read_pooling(folder: str | os.PathLike) -> PoolingConfig:
    """What the sentence-transformers files of folder say (modules.json, the Pooling module's config.json,
    sentence_bert_config.json); a plain transformers folder: mean pooling, no normalization."""
    folder = Path(folder)
    modules = json.loads((folder / "modules.json").read_text()) if (folder / "modules.json").exists() else []
    mode, dimension = "mean", None
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            cfg_path = folder / m.get("path", "") / "config.json"
            if cfg_path.exists():
                cfg = json.loads(cfg_path.read_text())
                dimension = cfg.get("word_embedding_dimension")
                for key, value in (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
                                   ("pooling_mode_lasttoken", "lasttoken"), ("pooling_mode_mean_tokens", "mean")):
                    if cfg.get(key):
                        mode = value
                        break
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    sbert = folder / "sentence_bert_config.json"
    max_len = json.loads(sbert.read_text()).get("max_seq_length") if sbert.exists() else None
    return PoolingConfig(mode, normalize, max_len, dimension)


def resolve_pooling(folder: str, decoder: bool, pooling: str = "auto", normalize: str = "auto") -> PoolingConfig:
    """The folder's pooling (read_pooling), else a decoder's default (last token, normalized); then the flags
    (--embed-pooling auto|mean|last, --embed-normalize auto|on|off) over both."""
    found = read_pooling(folder) if os.path.isdir(folder) else PoolingConfig()
    has_config = os.path.isdir(folder) and (Path(folder) / "modules.json").exists()
    if decoder and not has_config:
        found = PoolingConfig("lasttoken", True, None, None)
    mode = {"auto": found.mode, "last": "lasttoken", "mean": "mean"}[pooling]
    if decoder and mode not in DECODER_POOLING_MODES:
        raise ValueError(f"{mode} pooling does not fit a decoder model; use --embed-pooling last or mean")
    norm = {"auto": found.normalize, "on": True, "off": False}[normalize]
    return PoolingConfig(mode, norm, found.max_seq_length, found.dimension)


def pool(hidden: torch.Tensor, lens: list[int], mode: str) -> torch.Tensor:
    """Unpadded rows ([sum(lens), h]: each input's tokens in turn) -> [len(lens), h]: last token or mean."""
    ends = torch.tensor(lens).cumsum(0)
    if mode == "lasttoken":
        return hidden[ends - 1]
    if mode == "mean":
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        seg = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device),
                                      torch.tensor(lens, device=hidden.device))
        sums.index_add_(0, seg, hidden)
        return sums / torch.tensor(lens, dtype=hidden.dtype, device=hidden.device)[:, None]
    raise ValueError(f"unknown pooling {mode!r}")


def pool_padded(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Padded rows ([B, width, h], mask [B, width]: 1 on each input's tokens) -> [B, h]: any of POOLING_MODES
    (mean, and anything unknown, averages the unmasked tokens)."""
    m = mask[:, :, None].to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(m == 0, float("-inf")).amax(dim=1)
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)

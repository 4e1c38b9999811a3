"""PEFT's LoRA adapter format, read and checked without torch (the API process checks an adapter before any worker
loads it; the worker checks again when it loads the weights: inferd/engine/lora.py).

An adapter is a folder with `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors`, whose tensors PEFT names
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]) for each adapted module of each layer. Checked here, each failure an AdapterError with a named code (the
API's 400 `code`): the path (inside --lora-root when set: adapter_path_forbidden; the files there:
adapter_not_found), the size (adapter_too_large), the config (adapter_invalid, or adapter_unsupported for what we
do not serve: DoRA, biases, extra trained modules, per-module ranks, embeddings), the rank (adapter_rank_too_large),
and every tensor's shape against the base model's projection (adapter_shape_mismatch).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes; anything near this is not one
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")  # an adapter's name: what a request's `model` is

# lora_A / lora_B of one module of one layer; PEFT may keep the adapter's own name ("default") in the key
_KEY = re.compile(r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_([AB])"
                  r"(?:\.default)?\.weight")
# modules we adapt: PEFT's names, with the base weight each one's shape is checked against
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


class AdapterError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: what the gateway knows of it and what a worker loads."""
    path: str  # the folder, resolved
    rank: int
    alpha: float
    use_rslora: bool
    modules: tuple[str, ...]  # PEFT module names it adapts (sorted)
    digest: str  # sha256 of its two files: the identity its prefix-cache blocks are keyed by
    nbytes: int  # the weights file's size

    @property
    def scale(self) -> float:
        """The factor on B A: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise AdapterError("adapter_invalid", "lora_name must be 1 to 128 characters: letters, digits and ._:/@+- "
                                              "(starting with a letter or digit)")
    return name


def parse_key(key: str) -> tuple[int, str, str] | None:
    """A PEFT tensor name -> (layer, module, "A" or "B"); None for a name that is not a projection's LoRA weight."""
    m = _KEY.fullmatch(key)
    return None if m is None else (int(m.group(1)), m.group(3), m.group(4))


def resolve_path(path: object, root: str | None) -> Path:
    """The adapter folder, symlinks resolved; inside `root` (resolved too) when a root is set."""
    if not isinstance(path, str) or not path or len(path) > 4096 or "\0" in path:
        raise AdapterError("adapter_invalid", "lora_path must be a non-empty path")
    resolved = Path(os.path.realpath(path))
    if root is not None:
        base = Path(os.path.realpath(root))
        if resolved != base and base not in resolved.parents:
            raise AdapterError("adapter_path_forbidden", "lora_path is outside the server's --lora-root")
    if not resolved.is_dir():
        raise AdapterError("adapter_not_found", f"no adapter folder at {path}")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (resolved / name).is_file():
            raise AdapterError("adapter_not_found", f"the adapter folder has no {name}")
    return resolved


def read_config(folder: Path) -> dict:
    f = folder / CONFIG_FILE
    if f.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError("adapter_too_large", f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        data = json.loads(f.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError("adapter_invalid", f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise AdapterError("adapter_invalid", f"{CONFIG_FILE} must hold a JSON object")
    return data


def _config_fields(cfg: dict, max_rank: int) -> tuple[int, float, bool]:
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError("adapter_unsupported", f"peft_type {peft_type!r} is not served (LORA only)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError("adapter_invalid", f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError("adapter_rank_too_large", f"the adapter's rank {r} is over the server's --max-lora-rank "
                                                     f"{max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0 < alpha < float("inf")):
        raise AdapterError("adapter_invalid", f"lora_alpha must be a positive number, got {alpha!r}")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError("adapter_invalid", "use_rslora must be true or false")
    for key, what in (("use_dora", "DoRA"), ("modules_to_save", "extra trained modules (modules_to_save)"),
                      ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"), ("fan_in_fan_out", "fan_in_fan_out")):
        if cfg.get(key):
            raise AdapterError("adapter_unsupported", f"{what} is not served")
    if cfg.get("bias", "none") != "none":
        raise AdapterError("adapter_unsupported", "trained biases (bias other than \"none\") are not served")
    return r, float(alpha), use_rslora


def base_shapes(config: ModelConfig) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, PEFT module name) -> the base projection's (out, in), for every module an adapter may target."""
    from .loader import expected_weight_shapes

    shapes = {}
    for name, shape in expected_weight_shapes(config).items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.weight", name)
        if m and m.group(2) in MODULES and len(shape) == 2:
            shapes[(int(m.group(1)), m.group(2))] = (shape[0], shape[1])
    return shapes


def read_adapter(path: object, config: ModelConfig, max_rank: int, max_bytes: int,
                 root: str | None = None) -> AdapterSpec:
    """Check the adapter at `path` against the base model `config`; AdapterError names what is wrong."""
    folder = resolve_path(path, root)
    weights = folder / WEIGHTS_FILE
    nbytes = weights.stat().st_size
    if nbytes > max_bytes:
        raise AdapterError("adapter_too_large", f"{WEIGHTS_FILE} is {nbytes} bytes, over the server's limit of "
                                                f"{max_bytes} (--max-lora-bytes)")
    r, alpha, use_rslora = _config_fields(read_config(folder), max_rank)
    shapes = tensor_shapes(weights)
    expected = base_shapes(config)
    seen: dict[tuple[int, str], set[str]] = {}
    for key, shape in shapes.items():
        parsed = parse_key(key)
        if parsed is None:
            raise AdapterError("adapter_unsupported", f"tensor {key!r} is not a LoRA weight of a projection we adapt "
                                                      f"({', '.join(MODULES)})")
        layer, module, which = parsed
        if (layer, module) not in expected:
            raise AdapterError("adapter_shape_mismatch", f"tensor {key!r}: the base model has no {module} in layer "
                                                         f"{layer}")
        out, inp = expected[(layer, module)]
        want = (r, inp) if which == "A" else (out, r)
        if tuple(shape) != want:
            raise AdapterError("adapter_shape_mismatch", f"tensor {key!r} is {tuple(shape)}; the base model's "
                                                         f"{module} with rank {r} needs {want}")
        seen.setdefault((layer, module), set()).add(which)
    if not seen:
        raise AdapterError("adapter_invalid", f"{WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), which in seen.items():
        if which != {"A", "B"}:
            raise AdapterError("adapter_invalid", f"layer {layer} {module} has lora_{''.join(which)} without its pair")
    return AdapterSpec(str(folder), r, alpha, use_rslora, tuple(sorted({m for _, m in seen})), file_digest(folder),
                       nbytes)


def tensor_shapes(weights: Path) -> dict[str, list[int]]:
    """Names and shapes from the safetensors header (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="numpy") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError("adapter_invalid", f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from None


def file_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def parse_modules(specs: list[str]) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH ... -> [(name, path)]; ValueError on a malformed entry."""
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        out.append((name, path))
    return out

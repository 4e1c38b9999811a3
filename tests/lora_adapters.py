"""Random LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) for a model folder, and the
transformers model with an adapter merged by hand (W + scale * B A): the reference an adapter's outputs are compared
with. Shared by the engine, kernel and API tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """PEFT module -> (out, in) of a Llama-family config.json."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
            "up_proj": (inter, h), "down_proj": (h, inter)}


def module_group(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def write_adapter(path: Path, model_dir: Path, rank: int, seed: int, modules=ALL_MODULES, alpha: float | None = None,
                  use_rslora: bool = False, std: float = 0.08, config_extra: dict | None = None,
                  shape_override: dict | None = None) -> Path:
    """A random adapter for the model in model_dir; shape_override {module: (rows, cols)} writes that lora_A shape
    instead (a wrong adapter)."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = module_shapes(cfg)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in modules:
            out, inp = shapes[m]
            a_shape = (shape_override or {}).get(m, (rank, inp))
            prefix = f"base_model.model.model.layers.{layer}.{module_group(m)}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(a_shape, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
              "use_rslora": use_rslora, "target_modules": list(modules), "bias": "none", "lora_dropout": 0.0,
              "base_model_name_or_path": str(model_dir), "task_type": "CAUSAL_LM", **(config_extra or {})}
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def merged_hf_model(model_dir: Path, adapter_dir: Path):
    """transformers' model of model_dir in float32 with the adapter merged by hand: W += scale * B @ A."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            params[name] += scale * (b.double() @ a.double()).float()
    return model

"""load_model: a ready-to-run model, its config and tokenizer from a HF folder or a GGUF file."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .rope import RotaryEmbedding


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str = "cpu", max_positions: int | None = None) -> LlamaForCausalLM:
    cls = LlamaForCausalLM
    if config.architecture in ("gemma2", "gemma3"):
        from .gemma import GemmaForCausalLM as cls
    with torch.device("meta"):
        model = cls(config, max_positions, dtype)
    # the dtype on the meta model, then memory on the device: each weight is allocated once, in its final dtype
    # (to_empty then .to(dtype) held a float32 copy of the model on the device first: ~32 GB for an 8B model)
    model = model.to(dtype).to_empty(device=device)
    for rotary in (m for m in model.modules() if isinstance(m, RotaryEmbedding)):  # Gemma 3 has two
        rotary.build_tables(device)  # buffers are not in the checkpoint
    model.load_hf_state_dict(state_dict)
    model.eval().requires_grad_(False)
    model.pack_weights()
    return model


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               max_positions: int | None = None, progress=None):
    """progress(done, total): called as weight tensors load (a progress bar)."""
    from .loader import load_model_config, load_state_dict
    from .tokenizer import load_tokenizer

    config = load_model_config(path)
    state = load_state_dict(path, config, dtype, progress)
    model = build_model(config, state, dtype, device, max_positions)
    return model, config, load_tokenizer(path)

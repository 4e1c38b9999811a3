from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine
from inferd.engine.runner import kv_bytes_per_block
from parity import PEAKED_HEAD


@pytest.fixture(scope="session")
def micro():
    """A 2-layer random Llama with a 512-token vocabulary, built in memory (no tokenizer): for engine mechanics. Its
    weights keep transformers' default spread, whose repetitive output gives n-gram drafts something to find; its
    head is scaled instead, so its logits are peaked as the rule needs (tests/parity.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from inferd.models.build import build_model
    from inferd.models.config import ModelConfig

    torch.manual_seed(99)
    hf_cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    hf = LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # a scaled head: peaked logits (near-ties rare), the same greedy choices as unscaled
        hf.model.norm.weight.mul_(PEAKED_HEAD)
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    model = build_model(cfg, hf.state_dict(), torch.float32)

    def engine(blocks: int = 64, **kw) -> Engine:
        per_block = kv_bytes_per_block(cfg, kw.get("block_size", 16), torch.float32)
        return Engine(model, cfg, EngineConfig(kv_cache_bytes=per_block * blocks, **kw), torch.float32)

    return SimpleNamespace(cfg=cfg, model=model, hf=hf, engine=engine)

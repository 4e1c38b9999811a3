"""Qwen3, Gemma 2, Gemma 3 and Phi-3 from GGUF: tiny random models written as llama.cpp's convert_hf_to_gguf.py
writes them (gguf-py's tensor names and metadata keys; Gemma's norms stored as 1 + w; Phi-3's fused projections and
longrope factors as tensors), in float32, load to the weights and the config of the same model's save_pretrained
folder, and run to the same logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from inferd.models import loader
from inferd.models.build import build_model
from inferd.models.loader import load_model_config, load_state_dict
from parity import PEAKED_HEAD, assert_same_rows


def _hf_model(family: str):
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, num_hidden_layers=2, head_dim=32,
                                                   tie_word_embeddings=False))
    elif family == "gemma3":  # llama.cpp's Gemma 3: every 6th layer global, query_pre_attn_scalar = head_dim
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}}
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, num_hidden_layers=6, head_dim=16,
                                                         query_pre_attn_scalar=16, sliding_window=10,
                                                         rope_parameters=rope))
    elif family == "gemma2":  # llama.cpp's Gemma 2: every other layer global, query_pre_attn_scalar = head_dim
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, num_hidden_layers=2, head_dim=16,
                                                     query_pre_attn_scalar=16, sliding_window=10,
                                                     attn_logit_softcapping=2.0, final_logit_softcapping=30.0))
    else:
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.05, 1.2, 1.5, 2.0, 3.0], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
                "original_max_position_embeddings": 128}
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**common, num_hidden_layers=2, rope_parameters=rope,
                                                 original_max_position_embeddings=128, sliding_window=16,
                                                 pad_token_id=0))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        model.model.norm.weight.mul_(PEAKED_HEAD)
    return model.eval()


# HF module (without "model.layers.N.") -> llama.cpp's name, per family (gguf-py's MODEL_TENSORS)
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}
_GEMMA2 = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}
_FAMILY = {"gemma2": _GEMMA2, "gemma3": _GEMMA2,
           "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _gguf_name(family: str, hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_FAMILY.get(family, {}).get(module) or _BLOCK[module]}.{kind}"


def _write_gguf(path: Path, family: str, model) -> Path:
    """What convert_hf_to_gguf.py writes for `family` (float32)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), family)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    state = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    if family == "phi3":
        rope = cfg.rope_parameters
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_sliding_window(cfg.sliding_window)
        orig = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(orig))))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        assert len(rope["long_factor"]) * 2 == int(head_dim * 0.75)
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if family == "qwen3":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if family == "gemma2":
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
        w.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    if family == "gemma3":
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(cfg.sliding_window)
    for hf_name, t in state.items():
        arr = t.detach().float().numpy().copy()
        if family.startswith("gemma") and hf_name.endswith("norm.weight"):
            arr = arr + 1  # convert_hf_to_gguf.py's Gemma: the norms as 1 + w
        w.add_tensor(_gguf_name(family, hf_name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model, cfg, prompt: list[int]):
    config = EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.float32) * 16, record_logits=True)
    engine = Engine(model, cfg, config, torch.float32)
    req = engine.requests[engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
    while engine.has_unfinished_requests():
        engine.step()
    return req


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_gguf_loads_as_the_folder(family, tmp_path):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    path = _write_gguf(tmp_path / "tiny.gguf", family, hf)

    ours, ref = load_model_config(path), load_model_config(tmp_path / "hf")
    assert ours.architecture == ref.architecture == family
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
                  "attention_bias", "sliding_window", "layer_types", "qk_norm", "query_pre_attn_scalar",
                  "partial_rotary_factor", "rope_local_theta", "attn_logit_softcapping", "final_logit_softcapping"):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    if ref.rope_scaling is not None:
        assert ours.rope_scaling["rope_type"] == ref.rope_scaling["rope_type"]

    state, ref_state = load_state_dict(path, ours, torch.float32), load_state_dict(tmp_path / "hf", ref, torch.float32)
    assert list(state) == list(ref_state)
    for name, t in ref_state.items():
        if family.startswith("gemma") and name.endswith("norm.weight"):  # (1 + w) - 1 rounds (as transformers' load)
            torch.testing.assert_close(state[name], t, rtol=0, atol=1e-6)
        else:
            assert torch.equal(state[name], t), name

    if family.startswith("gemma"):  # the norms un-shifted bit for bit as transformers' own GGUF load does (its Qwen3
        # GGUF load ignores key_length, its Phi-3 one sets a pad id past a tiny vocabulary: not compared)
        from transformers import AutoModelForCausalLM

        theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
        theirs_state = theirs.state_dict()
        assert all(torch.equal(t, theirs_state[name]) for name, t in state.items())

    # the same logits: a prompt across the window, and past Phi-3's original context (its long factors)
    ours_model = build_model(dataclasses.replace(ours, rms_norm_eps=ref.rms_norm_eps), state, torch.float32)
    ref_model = build_model(ref, ref_state, torch.float32)
    prompt = torch.randint(3, ref.vocab_size, (130,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = _logits(ours_model, ours, prompt), _logits(ref_model, ref, prompt)
    assert_same_rows(a.output_token_ids, a.debug_logits, b.output_token_ids, b.debug_logits, family)


def test_gguf_block_names_cover_the_families():
    """Every tensor name gguf-py lists for the four architectures that a HF checkpoint has maps to a HF name."""
    import gguf
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    for arch, skip in ((MODEL_ARCH.QWEN3, {"rope_freqs"}), (MODEL_ARCH.GEMMA2, set()), (MODEL_ARCH.GEMMA3, set()),
                       (MODEL_ARCH.PHI3, {"rope_factors_long", "rope_factors_short", "blk.{bid}.attn_q",
                                          "blk.{bid}.attn_k", "blk.{bid}.attn_v"})):
        name = gguf.MODEL_ARCH_NAMES[arch]
        for tensor in MODEL_TENSORS[arch]:
            pattern = TENSOR_NAMES[tensor]
            if pattern not in skip:
                assert loader._gguf_to_hf_name(pattern.format(bid=0) + ".weight", name) is not None, (name, pattern)

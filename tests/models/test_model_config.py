"""ModelConfig against the transformers model it stands for, field by field: each field is checked against what the
transformers model built from the same config actually uses (the epsilon its norms hold, the inverse frequencies its
rotary embedding computes, its projections' shapes and biases, its head tied or not), for the tiny Llama and Qwen2
and for the default GGUF. A ModelConfig field without a check here fails the test: a new field gets one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import pytest
import torch

from inferd.models.config import ModelConfig
from inferd.models.loader import load_model_config
from inferd.models.rope import longrope_attention_factor, rope_attention_factor, rope_inv_freq
from parity import COMMITTED_REFS

HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
              "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "gpt_oss": "GptOssForCausalLM"}


def _eos(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _projections(attn) -> list:
    """A layer's q/k/v projections (Phi-3: its one fused projection)."""
    return [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "qkv_proj") if hasattr(attn, n)]


def _window(hf, i: int) -> int:
    """Layer i's sliding window in transformers: its attention's, or (Mistral, Phi-3: no attribute) the config's,
    which their masks use for every layer."""
    attn = hf.model.layers[i].self_attn
    return (attn.sliding_window if hasattr(attn, "sliding_window") else getattr(hf.config, "sliding_window", None)) or 0


def _inv_freq(hf, kind: str = "full_attention") -> torch.Tensor:
    """The rotary inverse frequencies (Gemma 3: of one layer kind)."""
    rotary = hf.model.rotary_emb
    if hasattr(rotary, f"{kind}_inv_freq"):
        return getattr(rotary, f"{kind}_inv_freq")
    return rotary.inv_freq if kind == "full_attention" else None


def _hf_attention_scaling(hf) -> float:
    rotary = hf.model.rotary_emb
    return getattr(rotary, "attention_scaling", getattr(rotary, "full_attention_attention_scaling", None))


def _attention_scaling(c: ModelConfig) -> float:
    """What our tables are multiplied by: longrope's factor, YaRN's (rope_attention_factor), else 1."""
    if (c.rope_scaling or {}).get("rope_type") == "longrope":
        return longrope_attention_factor(c)
    return rope_attention_factor(c)


def _router(layer):
    """A transformers decoder layer's MoE router (Mixtral's and Qwen3-MoE's mlp.gate, gpt-oss's mlp.router), or None
    where its MLP is dense."""
    router = getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
    return router if hasattr(router, "top_k") else None


def _moe_layers(hf) -> list:
    return [(i, layer, _router(layer)) for i, layer in enumerate(hf.model.layers) if _router(layer) is not None]


def _inter(experts) -> int:
    """One expert's intermediate size: down_proj is [E, H, I] (Mixtral, Qwen3-MoE) or [E, I, H] (gpt-oss, whose
    gate_up is [E, H, 2I]); gate_up's 2I dim tells which."""
    gu, down = experts.gate_up_proj.shape, experts.down_proj.shape
    return gu[2] // 2 if gu[1] == down[2] else gu[1] // 2


# ModelConfig field -> (ours, the transformers model) -> None, or raises AssertionError
CHECKS = {
    "architecture": lambda c, hf: type(hf).__name__ == HF_CLASSES[c.architecture],
    "vocab_size": lambda c, hf: hf.model.embed_tokens.num_embeddings == hf.lm_head.out_features == c.vocab_size,
    "hidden_size": lambda c, hf: hf.model.embed_tokens.embedding_dim == c.hidden_size,
    "intermediate_size": lambda c, hf: all(layer.mlp.down_proj.in_features == c.intermediate_size
                                           for layer in hf.model.layers if _router(layer) is None),
    "num_hidden_layers": lambda c, hf: len(hf.model.layers) == c.num_hidden_layers,
    "num_attention_heads": lambda c, hf: all(layer.self_attn.o_proj.in_features == c.num_attention_heads * c.head_dim
                                             for layer in hf.model.layers),
    "num_key_value_heads": lambda c, hf: all(sum(p.out_features for p in _projections(layer.self_attn))
                                             == (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                                             for layer in hf.model.layers),
    "head_dim": lambda c, hf: all(layer.self_attn.head_dim == c.head_dim for layer in hf.model.layers),
    "rms_norm_eps": lambda c, hf: all(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)) == c.rms_norm_eps
                                      for norm in hf.modules() if type(norm).__name__.endswith("RMSNorm")),
    # the rotary tables: ours from rope_theta and rope_scaling, transformers' from its own rope parameters
    "rope_theta": lambda c, hf: torch.equal(rope_inv_freq(c), _inv_freq(hf).float()),
    "rope_scaling": lambda c, hf: torch.equal(rope_inv_freq(c), _inv_freq(hf).float())
    and _hf_attention_scaling(hf) == _attention_scaling(c),
    "max_position_embeddings": lambda c, hf: hf.config.max_position_embeddings == c.max_position_embeddings,
    "tie_word_embeddings": lambda c, hf: (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr())
    == c.tie_word_embeddings,
    "attention_bias": lambda c, hf: all(all((p.bias is not None) == c.attention_bias
                                            for p in _projections(layer.self_attn)) for layer in hf.model.layers),
    "attention_output_bias": lambda c, hf: all((layer.self_attn.o_proj.bias is not None) == c.attention_output_bias
                                               for layer in hf.model.layers),
    "bos_token_id": lambda c, hf: hf.config.bos_token_id == c.bos_token_id,
    "eos_token_ids": lambda c, hf: _eos(hf.config.eos_token_id) == c.eos_token_ids,
    # the attention options: what each transformers attention layer holds
    "sliding_window": lambda c, hf: all(c.layer_window(i) == _window(hf, i) for i in range(len(hf.model.layers))),
    "layer_types": lambda c, hf: all(c.layer_window(i) == _window(hf, i) for i in range(len(hf.model.layers))),
    "attn_logit_softcapping": lambda c, hf: all(getattr(layer.self_attn, "attn_logit_softcapping", None)
                                                == c.attn_logit_softcapping for layer in hf.model.layers),
    "final_logit_softcapping": lambda c, hf: getattr(hf.config, "final_logit_softcapping", None)
    == c.final_logit_softcapping,
    "attention_sinks": lambda c, hf: all(hasattr(layer.self_attn, "sinks") == c.attention_sinks
                                         for layer in hf.model.layers),
    "qk_norm": lambda c, hf: all(hasattr(layer.self_attn, "q_norm") == hasattr(layer.self_attn, "k_norm") == c.qk_norm
                                 for layer in hf.model.layers),
    "query_pre_attn_scalar": lambda c, hf: all(layer.self_attn.scaling
                                               == (c.query_pre_attn_scalar or c.head_dim) ** -0.5
                                               for layer in hf.model.layers),
    "partial_rotary_factor": lambda c, hf: _inv_freq(hf).numel() * 2 == c.rotary_dim,
    # Gemma 3's sliding layers' table; elsewhere none
    "rope_local_theta": lambda c, hf: torch.equal(rope_inv_freq(dataclasses.replace(
        c, rope_theta=c.rope_local_theta, rope_scaling=None)), _inv_freq(hf, "sliding_attention").float())
    if c.rope_local_theta is not None else _inv_freq(hf, "sliding_attention") is None,
    # mixture of experts: which layers route (decoder_sparse_step, mlp_only_layers), and each router and its experts
    "num_experts": lambda c, hf: all(r.weight.shape[0] == c.num_experts for _, _, r in _moe_layers(hf))
    and (c.num_experts > 0) == bool(_moe_layers(hf)),
    "num_experts_per_tok": lambda c, hf: all(r.top_k == c.num_experts_per_tok for _, _, r in _moe_layers(hf)),
    "moe_intermediate_size": lambda c, hf: all(_inter(layer.mlp.experts) == c.moe_intermediate_size
                                               for _, layer, _ in _moe_layers(hf)),
    # Mixtral always renormalises; gpt-oss's softmax over the top k sums to 1 as well
    "norm_topk_prob": lambda c, hf: all(getattr(r, "norm_topk_prob", True) == c.norm_topk_prob
                                        for _, _, r in _moe_layers(hf)),
    "decoder_sparse_step": lambda c, hf: [i for i, _, _ in _moe_layers(hf)]
    == [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)],
    "mlp_only_layers": lambda c, hf: [i for i, _, _ in _moe_layers(hf)]
    == [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)],
    "swiglu_alpha": lambda c, hf: all(getattr(layer.mlp.experts, "alpha", None) == c.swiglu_alpha
                                      for _, layer, _ in _moe_layers(hf)),
    "swiglu_limit": lambda c, hf: all(getattr(layer.mlp.experts, "limit", None) == c.swiglu_limit
                                      for _, layer, _ in _moe_layers(hf)),
}


def test_every_field_has_a_check():
    assert {f.name for f in dataclasses.fields(ModelConfig)} == set(CHECKS)


def assert_matches(ours: ModelConfig, hf) -> None:
    wrong = [name for name, check in CHECKS.items() if not check(ours, hf)]
    assert not wrong, f"ModelConfig disagrees with transformers on {wrong}: {ours}"


def hf_gguf_config(path: str):
    """transformers' config of a GGUF file. Reading it costs ~18 s (the whole file is parsed), so it is committed
    beside the compact references (tests/data/hf-reference), keyed by the file's size and transformers' version."""
    import transformers
    from transformers import AutoConfig

    key = json.dumps(["gguf-config", os.path.getsize(path), transformers.__version__])
    stored = COMMITTED_REFS / f"config-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if not stored.exists():
        folder, name = os.path.split(path)
        stored.write_text(json.dumps(AutoConfig.from_pretrained(folder, gguf_file=name).to_dict(), indent=1,
                                     sort_keys=True) + "\n")
    d = json.loads(stored.read_text())
    return transformers.CONFIG_MAPPING[d["model_type"]].from_dict(d)


def hf_model(hf_config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()


@pytest.mark.parametrize("which", ["tiny-llama", "tiny-qwen2"])
def test_tiny_models(which, tiny_llama_dir, tiny_qwen2_dir):
    from transformers import AutoConfig

    path = tiny_llama_dir if which == "tiny-llama" else tiny_qwen2_dir
    assert_matches(load_model_config(str(path)), hf_model(AutoConfig.from_pretrained(path)))


MOE_CONFIGS = {
    "mixtral": dict(num_local_experts=4, sliding_window=16),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3],
                      norm_topk_prob=True, num_hidden_layers=4),
    "gpt_oss": dict(num_local_experts=4, sliding_window=8, swiglu_limit=5.0),
}


def moe_hf_config(family: str, **overrides):
    import transformers

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts_per_tok=2)
    kw.update(MOE_CONFIGS[family])
    kw.update(overrides)
    return transformers.CONFIG_MAPPING[family](**kw)


@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_moe_families(family):
    """Mixtral (a window on every layer), Qwen3-MoE (MoE on layer 1 only: every 2nd layer but layer 3), gpt-oss
    (sinks, o_proj bias, YaRN, alternating windows), from their config.json as transformers writes it."""
    hf_config = moe_hf_config(family)
    ours = ModelConfig.from_hf_dict(json.loads(hf_config.to_json_string()))
    assert_matches(ours, hf_model(hf_config))


@pytest.mark.parametrize("family, field, wrong", [("qwen3_moe", "mlp_only_layers", []),
                                                  ("qwen3_moe", "norm_topk_prob", False),
                                                  ("gpt_oss", "swiglu_limit", 7.0),
                                                  ("gpt_oss", "rope_scaling", None)])
def test_a_wrong_moe_field_is_caught(family, field, wrong):
    hf_config = moe_hf_config(family)
    ours = dataclasses.replace(ModelConfig.from_hf_dict(json.loads(hf_config.to_json_string())), **{field: wrong})
    with pytest.raises(AssertionError, match=field):
        assert_matches(ours, hf_model(hf_config))


def test_default_gguf(smollm2_gguf_path):
    assert_matches(load_model_config(smollm2_gguf_path), hf_model(hf_gguf_config(smollm2_gguf_path)))


@pytest.mark.parametrize("field, wrong", [("rms_norm_eps", 1e-5), ("rope_theta", 500000.0 * 1.01),
                                          ("num_key_value_heads", 4), ("attention_bias", True),
                                          ("tie_word_embeddings", True), ("rope_scaling", None)])
def test_a_wrong_field_is_caught(tiny_llama_dir, field, wrong):
    """The check can fail: the tiny Llama's config with one field wrong (its epsilon is 1e-6, its RoPE base 5e5 with
    Llama 3 scaling, 2 KV heads, no bias, an untied head)."""
    from transformers import AutoConfig

    ours = dataclasses.replace(load_model_config(str(tiny_llama_dir)), **{field: wrong})
    with pytest.raises(AssertionError, match=field):
        assert_matches(ours, hf_model(AutoConfig.from_pretrained(tiny_llama_dir)))


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma2", "phi3", "mistral"])
def test_families(family, tmp_path):
    """The tiny models tests/models/test_families.py compares with transformers: Qwen3 (a sliding layer from
    max_window_layers), Gemma 3 (interleaved layers, two RoPE tables, query_pre_attn_scalar, final soft-cap), Phi-3
    (partial rotary, longrope), Mistral (every layer sliding), read from their saved config.json."""
    from test_families import _hf_model

    hf = _hf_model(family)
    hf.config.save_pretrained(tmp_path)
    assert_matches(load_model_config(str(tmp_path)), hf)

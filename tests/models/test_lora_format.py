"""PEFT adapters checked without torch (inferd/models/lora_format.py): every refusal names its reason, and a good
adapter's scale is lora_alpha / r (rsLoRA: / sqrt r). Tiny config, no model loaded."""

from __future__ import annotations

import json
import math

import pytest
from lora_adapters import write_adapter

from inferd.models.config import ModelConfig
from inferd.models.lora_format import AdapterError, parse_modules, read_adapter

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


@pytest.fixture()
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def check(path, max_rank: int = 8, max_bytes: int = 1 << 20, root=None):
    return read_adapter(str(path), ModelConfig.from_hf_dict(CONFIG), max_rank, max_bytes, root)


def test_a_good_adapter_and_its_scale(model_dir, tmp_path):
    spec = check(write_adapter(tmp_path / "a", model_dir, rank=4, seed=1, alpha=8))
    assert spec.rank == 4 and spec.scale == 2.0 and len(spec.digest) == 64
    assert spec.modules == tuple(sorted(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    rs = check(write_adapter(tmp_path / "rs", model_dir, rank=4, seed=1, alpha=8, use_rslora=True))
    assert math.isclose(rs.scale, 8 / 2)
    # other weights, another identity (the prefix cache keys blocks by it)
    assert check(write_adapter(tmp_path / "b", model_dir, rank=4, seed=2, alpha=8)).digest != spec.digest


@pytest.mark.parametrize("case,code", [
    ("rank", "adapter_rank_too_large"),
    ("shape", "adapter_shape_mismatch"),
    ("dora", "adapter_unsupported"),
    ("bias", "adapter_unsupported"),
    ("modules_to_save", "adapter_unsupported"),
    ("rank_pattern", "adapter_unsupported"),
    ("not_json", "adapter_invalid"),
    ("bad_r", "adapter_invalid"),
    ("missing_weights", "adapter_not_found"),
    ("no_folder", "adapter_not_found"),
    ("too_large", "adapter_too_large"),
    ("outside_root", "adapter_path_forbidden"),
    ("embedding", "adapter_unsupported"),
    ("unpaired", "adapter_invalid"),
])
def test_a_bad_adapter_is_refused_with_its_reason(model_dir, tmp_path, case, code):
    root = tmp_path / "root"
    path = root / case
    kwargs = {}
    if case == "rank":
        write_adapter(path, model_dir, rank=16, seed=1)
    elif case == "shape":
        write_adapter(path, model_dir, rank=4, seed=1, shape_override={"k_proj": (4, 12)})
    elif case in ("dora", "bias", "modules_to_save", "rank_pattern", "bad_r"):
        extra = {"dora": {"use_dora": True}, "bias": {"bias": "all"},
                 "modules_to_save": {"modules_to_save": ["lm_head"]}, "rank_pattern": {"rank_pattern": {"q_proj": 2}},
                 "bad_r": {"r": "four"}}[case]
        write_adapter(path, model_dir, rank=4, seed=1, config_extra=extra)
    elif case == "not_json":
        write_adapter(path, model_dir, rank=4, seed=1)
        (path / "adapter_config.json").write_text("{nope")
    elif case == "missing_weights":
        write_adapter(path, model_dir, rank=4, seed=1)
        (path / "adapter_model.safetensors").unlink()
    elif case == "too_large":
        write_adapter(path, model_dir, rank=4, seed=1)
        kwargs["max_bytes"] = 100
    elif case == "outside_root":
        path = write_adapter(tmp_path / "elsewhere", model_dir, rank=4, seed=1)
        kwargs["root"] = str(root)
    elif case in ("embedding", "unpaired"):
        from safetensors.torch import load_file, save_file

        write_adapter(path, model_dir, rank=4, seed=1)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        if case == "embedding":
            import torch

            tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 64)
        else:
            del tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
        save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError) as e:
        check(path, **kwargs)
    assert e.value.code == code, str(e.value)


def test_a_symlink_out_of_the_root_is_outside_it(model_dir, tmp_path):
    real = write_adapter(tmp_path / "elsewhere", model_dir, rank=4, seed=1)
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(real)
    with pytest.raises(AdapterError) as e:
        check(root / "link", root=str(root))
    assert e.value.code == "adapter_path_forbidden"
    assert check(real, root=str(tmp_path)).rank == 4


def test_lora_modules_flag_parsing():
    assert parse_modules(["a=/x", "b=/y=z"]) == [("a", "/x"), ("b", "/y=z")]
    for bad in ("a", "=x", "a="):
        with pytest.raises(ValueError):
            parse_modules([bad])

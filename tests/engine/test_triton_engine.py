"""Whole engines on the Triton kernels (kernels.select(..., "triton"): split-K paged decode, varlen paged prefill,
add+RMSNorm, RoPE with the KV write, SiLU x up; inferd/kernels/triton_*.py), run on a CPU through Triton's interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py), against the same engines on the torch references, greedy, token for
token under the exactness rule (tests/parity.py). This is the wiring a GPU runs: the runner's block tables and lengths
for decode rows, one varlen call for every prefill chunk of a step (chunked prefill, later chunks over a cached context,
prefix-cache hits), preemption, and the CUDA graphs' static decode path keyed by batch size only. float32 (the
interpreter is wrong for bf16 tensors; bf16 is checked on the GPU by bench/gpu_check.sh). The model is a random Llama
with head_dim 32 and 3 query heads per KV head (the kernels take head_dim 32, 64 and 128)."""

from __future__ import annotations

import pytest
import torch

from inferd import kernels
from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from parity import PEAKED_INIT, assert_same_rows, run_staggered

MAX_NEW = 8
PROMPT_LENS = [3, 21, 9, 33]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def gqa3_weights():
    """A 2-layer random Llama's weights as transformers names them, and its config: hidden 96, 3 query heads over 1
    KV head of 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from inferd.models.config import ModelConfig

    torch.manual_seed(5)
    hf_cfg = LlamaConfig(vocab_size=384, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256, eos_token_id=2,
                         bos_token_id=1, tie_word_embeddings=True, initializer_range=PEAKED_INIT)
    return LlamaForCausalLM(hf_cfg).eval().state_dict(), ModelConfig.from_hf_dict(hf_cfg.to_dict())


@pytest.fixture(scope="module")
def gqa3(gqa3_weights):
    from inferd.models.build import build_model

    state, cfg = gqa3_weights
    return build_model(cfg, state, torch.float32), cfg


def _prompts(vocab: int, shared_prefix: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    prefix = torch.randint(3, vocab, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(gqa3, kernel_mode: str, blocks: int, shared_prefix: int = 0, **kw):
    model, cfg = gqa3
    config = EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.float32) * blocks, record_logits=True,
                          kernels=kernel_mode, max_num_seqs=8, **kw)
    engine = Engine(model, cfg, config, torch.float32)
    assert engine.runner.model.ops.name == ("triton" if kernel_mode == "triton" else "reference")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    reqs, trace = run_staggered(engine, _prompts(cfg.vocab_size, shared_prefix), params, every=2)
    engine.kv_cache.check_no_leaks()
    return [(list(r.output_token_ids), [x.float() for x in r.debug_logits]) for r in reqs], engine, trace


def _assert_same_greedy(ours, ref, label):
    for i, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(ours, ref)):
        assert len(tokens) == len(ref_tokens) == MAX_NEW
        assert_same_rows(tokens, logits, ref_tokens, ref_logits, f"{label} prompt {i}")


def test_select_triton():
    ops = kernels.select("cpu", torch.float32, torch.float32, "triton")
    assert ops.name == "triton" and ops.decode_in_place and ops.prefill_varlen
    assert kernels.select("cuda", torch.bfloat16, torch.float8_e4m3fn).name == "triton"  # fp8 read in the kernel
    assert kernels.select("cuda", torch.bfloat16, torch.bfloat16, "reference") is kernels.REFERENCE
    assert not kernels.select("cpu", torch.float32, torch.float32).prefill_varlen  # the CPU keeps its own path


@pytest.mark.parametrize("scenario", ["chunked", "prefix-cache", "preemption"])
def test_triton_engine_as_reference(gqa3, scenario):
    """chunked: a 16-token budget, so prompts arrive in several chunks beside other rows' decodes (later chunks read
    the context cached before them); prefix-cache: every prompt starts with the same 32 tokens, so later prompts
    begin at a cache hit; preemption: a pool too small for all of them."""
    kw = {"chunked": dict(max_num_batched_tokens=16, blocks=128),
          "prefix-cache": dict(max_num_batched_tokens=32, blocks=128, shared_prefix=32, enable_prefix_caching=True),
          "preemption": dict(max_num_batched_tokens=32, blocks=6)}[scenario]
    ref, _, _ = _run(gqa3, "reference", **kw)
    ours, engine, trace = _run(gqa3, "triton", **kw)
    assert any(d > 0 and p > 0 for d, p, _ in trace)  # decodes shared steps with prefill chunks
    if scenario == "prefix-cache":
        assert engine.kv_cache.stats.hits > 0  # prompt tokens taken from the cache
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0
    _assert_same_greedy(ours, ref, scenario)


def test_static_decode_path_keyed_by_batch_only(gqa3):
    """The CUDA graphs' static-shape path (run uncaptured here) over the Triton decode kernel: one table width (the
    whole context), so one shape per batch size; the same tokens as the reference engine."""
    ref, _, _ = _run(gqa3, "reference", blocks=128, max_num_batched_tokens=64, max_model_len=128)
    ours, engine, _ = _run(gqa3, "triton", blocks=128, max_num_batched_tokens=64, max_model_len=128,
                           static_decode=True)
    graphs = engine.runner.decode_graphs
    assert graphs.in_place and graphs.buckets == [128 // 16]
    assert sum(graphs.steps.values()) > 0 and len({b for b, _ in graphs.steps}) >= 2
    _assert_same_greedy(ours, ref, "static")


def test_lora_adapters_on_the_triton_kernels(gqa3_weights, tmp_path):
    """LoRA rows through kernels/triton_lora.py inside the engine (the slots' buffers, a step's row slots, base rows
    beside two adapters), against the same engine on the torch references."""
    import json

    from lora_adapters import write_adapter

    from inferd.models.build import build_model
    from inferd.models.lora_format import read_adapter

    weights, cfg = gqa3_weights
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": cfg.num_hidden_layers}))
    loras = [None]
    for i, modules in enumerate((("q_proj", "v_proj", "down_proj"), ("k_proj", "o_proj", "gate_proj", "up_proj"))):
        spec = read_adapter(str(write_adapter(tmp_path / f"a{i}", folder, rank=4, seed=40 + i, modules=modules,
                                              std=0.2)), cfg, max_rank=4, max_bytes=1 << 30)
        loras.append([f"a{i}", spec.path, spec.digest])
    results = {}
    for mode in ("reference", "triton"):
        model = build_model(cfg, weights, torch.float32)  # a model of its own: the engine attaches slots to it
        config = EngineConfig(kv_cache_bytes=kv_bytes_per_block(cfg, 16, torch.float32) * 64, record_logits=True,
                              kernels=mode, max_num_seqs=8, max_num_batched_tokens=32, enable_lora=True,
                              max_loras=2, max_lora_rank=4)
        engine = Engine(model, cfg, config, torch.float32)
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, lora=loras[i % 3])
                  for i in range(3)]
        reqs, _ = run_staggered(engine, _prompts(cfg.vocab_size, 0)[:3], params, every=1)
        results[mode] = [(list(r.output_token_ids), [x.float() for x in r.debug_logits]) for r in reqs]
    _assert_same_greedy(results["triton"], results["reference"], "lora")

"""`--batch-invariant` (inferd/models/batch_invariant.py), in bf16: a sequence's logits are BITWISE the same alone,
in a batch with other sequences of other lengths, with its prompt prefilled in chunks of another size, and when it
is replayed as prompt + generated tokens (prefill) instead of decoded: the failover case. On the tiny Llama and on
the default model. Each model is loaded for this module alone (the mode changes its layers)."""

from __future__ import annotations

import random

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams

NEW = 8


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model(request, tiny_llama_dir, smollm2_gguf_path):
    from inferd.models.build import load_model

    path = tiny_llama_dir if request.param == "tiny" else smollm2_gguf_path
    return request.param, load_model(str(path), dtype=torch.bfloat16)


def _engine(model, **kw) -> Engine:
    _, (m, cfg, tok) = model
    config = EngineConfig(dtype="bfloat16", kv_cache_bytes=32 << 20, record_logits=True, batch_invariant=True,
                          enable_prefix_caching=False, **kw)
    return Engine(m, cfg, config, torch.bfloat16, tok)


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], order: list[int],
         num_prompt_tokens: dict[int, int] | None = None) -> dict[int, object]:
    """Adds the prompts in `order`, one per step (so batches mix prefill chunks and decodes), runs to the end."""
    reqs, pending = {}, list(order)
    while pending or engine.has_unfinished_requests():
        if pending:
            i = pending.pop(0)
            rid = engine.add_request(prompts[i], params[i], num_prompt_tokens=(num_prompt_tokens or {}).get(i))
            reqs[i] = engine.requests[rid]
        engine.step()
    return reqs


def _same(a: list[torch.Tensor], b: list[torch.Tensor], label: str) -> None:
    assert len(a) == len(b), label
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{label}: logits of position {i} differ by {float((x - y).abs().max()):.3g}"


def test_logits_do_not_depend_on_the_batch_nor_on_prefill_vs_decode(model):
    name, (_, cfg, _) = model
    prompts = _prompts(cfg.vocab_size, [37, 5, 61, 18], seed=3)
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=NEW, temperature=0.9, top_k=40, seed=7, ignore_eos=True)
    params = [greedy, seeded, greedy, seeded]
    # alone, in one prefill chunk
    alone = {i: _run(_engine(model), prompts, params, [i])[i] for i in (0, 1)}
    # batched with the others (other lengths, arriving while it decodes), prompts in chunks of 7 tokens
    batched = _run(_engine(model, max_num_batched_tokens=7, max_num_seqs=4), prompts, params, [2, 0, 3, 1])
    for i in (0, 1):
        _same(batched[i].debug_logits, alone[i].debug_logits, f"{name} request {i}: batched and chunked vs alone")
        assert batched[i].output_token_ids == alone[i].output_token_ids
    # a replay after k tokens (the failover path): prompt + the first k outputs prefilled, beside other work
    for i in (0, 1):
        k = 3
        out = alone[i].output_token_ids
        replay_prompts = {**dict(enumerate(prompts)), i: prompts[i] + out[:k]}
        replayed = _run(_engine(model, max_num_batched_tokens=16, max_num_seqs=4), replay_prompts, params,
                        [3, i, 2], num_prompt_tokens={i: len(prompts[i])})[i]
        assert replayed.output_token_ids == out
        _same(replayed.debug_logits, alone[i].debug_logits[k:], f"{name} request {i}: replayed after {k}")


def test_batch_invariant_mode_refuses_what_it_does_not_cover(tiny_llama_dir):
    with pytest.raises(ValueError, match="batch-invariant"):
        Engine.from_config(EngineConfig(model=str(tiny_llama_dir), batch_invariant=True, tensor_parallel=2))
    with pytest.raises(ValueError, match="batch-invariant"):
        Engine.from_config(EngineConfig(model=str(tiny_llama_dir), batch_invariant=True, quantize="int8",
                                        dtype="bfloat16"))

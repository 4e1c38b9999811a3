"""`--task embed` on a decoder model: one varlen prefill pass through our own model and paged KV cache, pooled (last
token or mean) and normalized, equal to Hugging Face's LlamaModel on the same weights (cosine >= 0.9999 per input),
whatever the batch it ran in."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.embedding import EmbedEngine
from inferd.models.embedding_models import is_decoder_model
from inferd.models.pooling import pool, resolve_pooling

INPUTS = [[1, 2, 3, 4, 5, 6, 7], [42], list(range(100, 160)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] * 3, [500, 501]]


@pytest.fixture(scope="module")
def hf_hidden(tiny_llama_dir):
    """HF's final hidden states (after the last norm) of each input, run alone in float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([ids])).last_hidden_state[0].double().numpy() for ids in INPUTS]


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def run(engine: EmbedEngine, inputs: list[list[int]]) -> list[np.ndarray]:
    ids = [engine.add_request(x) for x in inputs]
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < len(ids) and time.monotonic() < deadline:
        for out in engine.step():
            got[out.request_id] = np.asarray(out.embedding)
    return [got[i] for i in ids]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_equal_hugging_face_batched_or_alone(tiny_llama_dir, hf_hidden, pooling):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=16, max_num_seqs=8)
    engine = EmbedEngine.from_config(config, max_wait_s=0.0, max_batch_tokens=64, pooling=pooling)
    assert engine.embedder.pooling.normalize and not engine.embedder.padded
    expected = [h[-1] if pooling == "last" else h.mean(0) for h in hf_hidden]
    alone = [run(engine, [x])[0] for x in INPUTS]
    engine.max_wait_s = 0.3  # now the inputs wait for each other: fewer passes (within the token budget)
    passes = engine.num_passes
    together = run(engine, INPUTS)
    assert engine.num_passes - passes < len(INPUTS)  # batched: fewer passes than inputs (budget 64 tokens)
    for a, t, e in zip(alone, together, expected):
        assert cosine(a, e) >= 0.9999 and cosine(t, e) >= 0.9999
        assert abs(np.linalg.norm(t) - 1.0) < 1e-5
    snap = engine.snapshot()
    assert snap.kv_blocks_free == snap.kv_num_blocks  # nothing is kept


def test_pooling_resolution_and_the_pool_function(tiny_llama_dir, tmp_path):
    assert is_decoder_model(str(tiny_llama_dir)) and is_decoder_model("x.gguf")
    assert not is_decoder_model(str(tmp_path))
    assert resolve_pooling(str(tiny_llama_dir), True).mode == "lasttoken"
    assert resolve_pooling(str(tiny_llama_dir), True, "mean", "off") == resolve_pooling(
        str(tiny_llama_dir), True, "mean", "off")
    assert not resolve_pooling(str(tiny_llama_dir), True, "mean", "off").normalize
    assert resolve_pooling(str(tmp_path), False).mode == "mean"  # an encoder without a config: mean, as ST does
    (tmp_path / "modules.json").write_text('[{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]')
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="decoder"):
        resolve_pooling(str(tmp_path), True)  # max pooling over a causal model is refused, not guessed at
    h = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    assert pool(h, [1, 2, 3], "lasttoken").tolist() == [[0, 1], [4, 5], [10, 11]]
    assert pool(h, [1, 2, 3], "mean").tolist() == [[0, 1], [3, 4], [8, 9]]

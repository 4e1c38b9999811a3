"""/v1/embeddings against a real `inferd serve --embedding-model default --embedding-model TINY` (the tiny Llama as its
chat model, and again as a decoder embedding model run by our own engine), with
the official `openai` client: vectors equal sentence-transformers' on the same weights (cosine >= 0.9999 per text)
for strings, lists and token ids; 64 concurrent requests served in fewer model passes than requests with the same
vectors as one at a time; a chat and an embedding model behind one server; bad inputs are 400s."""

from __future__ import annotations

import asyncio
import base64
import struct
import time

import httpx
import numpy as np
import openai
import pytest

from batch_util import jsonl, wait_status

pytestmark = pytest.mark.timeout(300)

ADMIN = "embeddings-admin-key"
TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog", "inferd serves embeddings",
         "Paris is the capital of France. " * 6, "x"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    from servers import kill_group, start_server

    log = tmp_path_factory.mktemp("embed") / "serve.log"
    srv = start_server(tiny_llama_dir, log, "--max-model-len", "256", "--kv-cache-bytes", "32M", "--state-dir",
                       str(log.parent / "state"),
                       "--embedding-model", "default", "--embedding-model", str(tiny_llama_dir),
                       "--heartbeat-interval", "0.1", "--embed-max-wait-ms", "20", "--admin-key", ADMIN,
                       model_name="tiny")
    yield srv
    kill_group(srv.proc)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    from inferd.models.embedding_models import default_embedding_model_path

    return SentenceTransformer(default_embedding_model_path(), device="cpu")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_vectors_equal_sentence_transformers(client, reference, server):
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[0])
    assert len(one.data) == 1 and one.model == "all-MiniLM-L6-v2" and one.usage.prompt_tokens > 0
    assert cosine(one.data[0].embedding, expected[0]) >= 0.9999
    many = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    for d, e in zip(many.data, expected):
        assert len(d.embedding) == 384 and cosine(d.embedding, e) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-4  # the folder's Normalize module
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    by_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids)
    for d, e in zip(by_ids.data, expected):
        assert cosine(d.embedding, e) >= 0.9999
    single_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=ids[1])
    assert cosine(single_ids.data[0].embedding, expected[1]) >= 0.9999
    assert many.usage.prompt_tokens == sum(len(x) for x in ids)
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[2], "encoding_format": "base64"},
                     timeout=60).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert cosine(struct.unpack(f"<{len(packed) // 4}f", packed), expected[2]) >= 0.9999


def _passes(server) -> float:
    return server.metrics().get("inferd_embedding_model_passes", 0.0)


def _settled_passes(server) -> float:
    """The passes gauge once heartbeats stopped moving it (it is read from them: eventually consistent)."""
    last = _passes(server)
    deadline = time.monotonic() + 30
    while True:
        time.sleep(0.5)
        now = _passes(server)
        if now == last:
            return now
        assert time.monotonic() < deadline
        last = now


def test_concurrent_requests_are_batched_with_the_same_vectors(server):
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'dogs'} and more" + " words" * (i % 7)
             for i in range(64)]
    url = server.url + "/v1/embeddings"
    alone = [httpx.post(url, json={"input": t}, timeout=60).json()["data"][0]["embedding"] for t in texts[:8]]
    before = _settled_passes(server)

    async def all_at_once():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(url, json={"input": t}) for t in texts))

    responses = asyncio.run(all_at_once())
    assert all(r.status_code == 200 for r in responses)
    passes = _settled_passes(server) - before
    assert 1 <= passes < 64, passes  # batched: fewer forward passes than requests
    for r, a in zip(responses[:8], alone):
        v = r.json()["data"][0]["embedding"]
        assert cosine(v, a) >= 0.99999 and np.max(np.abs(np.asarray(v) - np.asarray(a))) < 1e-5


def test_a_chat_and_an_embedding_model_behind_one_server(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids[:2] == ["tiny", "all-MiniLM-L6-v2"] and len(ids) == 3
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "wrong_model_kind" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="hi")
    assert e.value.body["code"] == "wrong_model_kind"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=128)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 400)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=[[10 ** 6]])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="all-MiniLM-L6-v2", input="")
    assert client.embeddings.create(model="all-MiniLM-L6-v2", input="still fine").data


def embedding_batch(client, bodies: list[dict]):
    """A /v1/embeddings batch of these bodies (custom ids e0, e1, ...), once it has ended."""
    import io

    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
             for i, body in enumerate(bodies)]
    f = client.files.create(file=("e.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    return wait_status(client, b.id, ("completed", "failed"))


def test_a_batch_of_embeddings(client, reference):
    """The Batch API's /v1/embeddings endpoint: lines through the same service, vectors as sentence-transformers'."""
    import json

    b = embedding_batch(client, [{"model": "all-MiniLM-L6-v2", "input": t} for t in TEXTS])
    assert b.status == "completed" and b.request_counts.completed == len(TEXTS)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    expected = reference.encode(TEXTS, convert_to_numpy=True)
    for o, e in zip(sorted(out, key=lambda o: int(o["custom_id"][1:])), expected):
        assert cosine(o["response"]["body"]["data"][0]["embedding"], e) >= 0.9999


def test_a_batch_of_embeddings_answers_as_the_endpoint_does(client, server, tiny_llama_dir):
    """Each line of a /v1/embeddings batch gets the answer /v1/embeddings gives the same body (the workers run in
    float32: start_server's --dtype): the same model, indices and usage, vectors within 1e-5 of each other (what
    batching with other inputs may move them), base64 as asked, and an invalid line the endpoint's 400."""
    import json

    bodies = [{"model": "all-MiniLM-L6-v2", "input": TEXTS[0]},
              {"model": "all-MiniLM-L6-v2", "input": TEXTS[1:4]},
              {"model": "all-MiniLM-L6-v2", "input": [[101, 7592, 2088, 102], [101, 2088, 102]]},
              {"model": tiny_llama_dir.name, "input": TEXTS[:2]},
              {"input": TEXTS[4], "encoding_format": "base64"},
              {"model": "all-MiniLM-L6-v2", "input": TEXTS[2], "dimensions": 8},
              {"model": "all-MiniLM-L6-v2", "input": []}]
    b = embedding_batch(client, bodies)
    assert b.status == "completed" and b.request_counts.total == len(bodies)
    results = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    if b.error_file_id:
        results += [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    by_id = {r["custom_id"]: r["response"] for r in results}

    def vectors(answer: dict) -> list[np.ndarray]:
        out = []
        for d in answer["data"]:
            v = d["embedding"]
            out.append(np.frombuffer(base64.b64decode(v), "<f4") if isinstance(v, str) else np.asarray(v, "<f4"))
        return out

    for i, body in enumerate(bodies):
        direct = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
        got = by_id[f"e{i}"]
        assert got["status_code"] == direct.status_code, (body, got, direct.text)
        want, have = direct.json(), got["body"]
        if direct.status_code != 200:
            assert have == want  # the same error, message and code
            continue
        assert {k: v for k, v in have.items() if k != "data"} == {k: v for k, v in want.items() if k != "data"}
        assert [d["index"] for d in have["data"]] == [d["index"] for d in want["data"]]
        assert all(isinstance(d["embedding"], str) == (body.get("encoding_format") == "base64")
                   for d in have["data"])
        for x, y in zip(vectors(have), vectors(want), strict=True):
            assert x.shape == y.shape and (body.get("dimensions") is None or x.shape == (body["dimensions"],))
            assert np.max(np.abs(x - y)) <= 1e-5, (body, np.max(np.abs(x - y)))


def test_a_decoder_model_embeds_through_our_engine(client, server, tiny_llama_dir):
    """The second --embedding-model is a decoder (our engine's): last-token pooling, normalized, equal to Hugging
    Face's LlamaModel on the same weights; `model` picks it, no `model` picks the first one."""
    import torch
    from transformers import AutoModel

    from inferd.models.tokenizer import load_tokenizer

    name = tiny_llama_dir.name
    assert [m.id for m in client.models.list().data] == ["tiny", "all-MiniLM-L6-v2", name]
    assert client.models.retrieve(name).id == name
    got = client.embeddings.create(model=name, input=TEXTS[:4])
    tokenizer = load_tokenizer(tiny_llama_dir)
    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for d, text in zip(got.data, TEXTS[:4]):
        ids = tokenizer.encode(text)
        with torch.inference_mode():
            last = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
        assert len(d.embedding) == model.config.hidden_size and cosine(d.embedding, last) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-4
    assert got.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS[:4])
    first = httpx.post(server.url + "/v1/embeddings", json={"input": "no model named"}, timeout=60).json()
    assert first["model"] == "all-MiniLM-L6-v2" and len(first["data"][0]["embedding"]) == 384  # the first one's


def test_a_client_that_disconnects_mid_request_aborts_its_inputs(server, client):
    """1,000 inputs of ~250 tokens (tens of seconds of MiniLM work on these cores): the client gives up once they
    are in the worker; every input is aborted there (its streams drop to none long before the work could have
    ended) and the server serves the next request."""
    def streams() -> int:
        cards = httpx.get(server.url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"},
                          timeout=10).json()["embedding_workers"]["all-MiniLM-L6-v2"]
        return sum(c["streams"] for c in cards)

    async def give_up():
        async with httpx.AsyncClient(timeout=120) as c:
            task = asyncio.ensure_future(c.post(server.url + "/v1/embeddings", json={
                "model": "all-MiniLM-L6-v2", "input": [f"{i} " + "word " * 240 for i in range(1000)]}))
            deadline = time.monotonic() + 30
            while streams() < 1000:  # every input dispatched to the worker
                assert not task.done() and time.monotonic() < deadline
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    passes = _settled_passes(server)
    asyncio.run(give_up())
    deadline = time.monotonic() + 10
    while streams():
        assert time.monotonic() < deadline, streams()
        time.sleep(0.05)
    # aborted, not run: the passes stop long before 1,000 long inputs (~30 of them fit a pass) could be done
    assert _settled_passes(server) - passes < 1000 / 30
    assert client.embeddings.create(model="all-MiniLM-L6-v2", input="after").data


def test_big_inputs_are_tokenized_off_the_event_loop(server):
    """4 concurrent requests of ~8 MB each (2,000 inputs of 4,000 characters: under the characters-per-token bound,
    so each is tokenized, then refused for its token count). The event loop keeps answering /health meanwhile: they
    used to be tokenized on it, stalling it for seconds (long enough to have healthy workers declared dead). An input
    too long to ever fit is refused before it is tokenized."""
    big = {"model": "all-MiniLM-L6-v2", "input": [f"{i} " + "word " * 800 for i in range(2000)]}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            posts = [asyncio.ensure_future(c.post(server.url + "/v1/embeddings", json=big)) for _ in range(4)]
            worst = 0.0
            while not all(p.done() for p in posts):
                start = time.monotonic()
                assert (await c.get(server.url + "/health")).status_code == 200
                worst = max(worst, time.monotonic() - start)
                await asyncio.sleep(0.02)
            return [p.result() for p in posts], worst

    def refused() -> float:
        text = httpx.get(server.url + "/metrics").text
        line = next((ln for ln in text.splitlines()
                     if ln.startswith('inferd_refused_after_tokenizing_total{endpoint="embeddings"}')), None)
        return float(line.rsplit(" ", 1)[1]) if line else 0.0

    before = refused()
    answers, worst = asyncio.run(run())
    assert refused() == before + 4  # tokenized, then refused: counted
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "tokens" in r.json()["error"]["message"]  # tokenized, then refused for its length
    assert worst < 1.0, f"/health waited {worst:.2f} s while big inputs were tokenized"
    huge = httpx.post(server.url + "/v1/embeddings", timeout=60,
                      json={"model": "all-MiniLM-L6-v2", "input": "word " * 1_000_000})
    assert huge.status_code == 400 and "characters" in huge.json()["error"]["message"], huge.text

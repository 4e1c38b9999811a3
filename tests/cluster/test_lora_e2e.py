"""LoRA adapters through the whole server (`inferd serve --enable-lora` on the tiny Llama, float32), with real
clients: /v1/models lists each adapter with its parent; a request naming an adapter gets that adapter's output (the
in-process engine's with the same adapter); adapters loaded and unloaded at run time by the admin key only, while
streams run on them; bad adapters refused with a named reason; another tenant's adapter is a 404 like an unknown
model; and a stream whose worker is killed continues exactly on the survivor, which reads the adapter itself."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest
from cluster_util import random_prompts
from lora_adapters import write_adapter
from streams import assert_same_stream, request_body, run_all

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.gateway.tenants import create_key
from inferd.models.loader import load_model_config
from inferd.models.lora_format import read_adapter

pytestmark = pytest.mark.timeout(300)

ADMIN = "lora-admin-key"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("lora-root")
    outside = tmp_path_factory.mktemp("lora-outside")
    a = write_adapter(root / "a", tiny_llama_dir, rank=8, seed=21)
    b = write_adapter(root / "b", tiny_llama_dir, rank=4, seed=22, modules=("q_proj", "v_proj", "down_proj"),
                      std=0.2)
    bad = {
        "shape": write_adapter(root / "wrong-shape", tiny_llama_dir, rank=4, seed=23, modules=("q_proj",),
                               shape_override={"q_proj": (4, 32)}),
        "rank": write_adapter(root / "big-rank", tiny_llama_dir, rank=16, seed=24, modules=("q_proj",)),
        "outside": write_adapter(outside / "c", tiny_llama_dir, rank=4, seed=25, modules=("q_proj",)),
    }
    missing = root / "no-weights"
    shutil.copytree(a, missing)
    (missing / "adapter_model.safetensors").unlink()
    bad["missing"] = missing
    keys = {name: create_key(str(root.parent / "keys.json"), name, adapters=adapters)[0]
            for name, adapters in (("alice", ["a"]), ("bob", None), ("carol", ["*"]))}
    return dict(root=root, a=a, b=b, bad=bad, keys=keys, keys_path=root.parent / "keys.json")


@pytest.fixture(scope="module")
def server(cluster, lora_setup):
    s = lora_setup
    return cluster("--workers", "2", "--threads", "1", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                   "--lora-modules", f"a={s['a']}", "--lora-root", str(s["root"]), "--admin-key", ADMIN,
                   "--keys", str(s["keys_path"]), name="lora")


def offline_text(model_dir, adapter_dir, prompt: list[int], max_tokens: int) -> str:
    spec = read_adapter(str(adapter_dir), load_model_config(model_dir), max_rank=8, max_bytes=1 << 30)
    engine = Engine.from_config(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_bytes=16 << 20,
                                             max_model_len=256, enable_lora=True, max_lora_rank=8))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            lora=["x", spec.path, spec.digest])
    return engine.tokenizer.decode(engine.generate([prompt], params)[0].output_token_ids)


def test_models_list_each_tenants_adapters_with_their_parent(server, lora_setup):
    keys = lora_setup["keys"]
    alice = openai.OpenAI(base_url=server.url + "/v1", api_key=keys["alice"])
    cards = {m.id: m for m in alice.models.list().data}
    assert set(cards) == {"tiny", "a"}
    assert cards["a"].model_extra["parent"] == "tiny"
    bob = openai.OpenAI(base_url=server.url + "/v1", api_key=keys["bob"])
    assert {m.id for m in bob.models.list().data} == {"tiny"}
    # bob may not use alice's adapter: exactly the 404 of a model that does not exist
    with pytest.raises(openai.NotFoundError) as e:
        bob.completions.create(model="a", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as unknown:
        bob.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == unknown.value.body["code"] == "model_not_found"
    assert e.value.body["message"].replace("`a`", "`nope`") == unknown.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        bob.models.retrieve("a")


def test_a_request_naming_an_adapter_gets_its_output(server, lora_setup, tiny_llama_dir):
    prompt = random_prompts(1, (20, 30), seed=31)[0]
    alice = openai.OpenAI(base_url=server.url + "/v1", api_key=lora_setup["keys"]["alice"])
    got = alice.completions.create(model="a", prompt=prompt, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    base = alice.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.model == "a"
    assert got.choices[0].text == offline_text(tiny_llama_dir, lora_setup["a"], prompt, 12)
    assert got.choices[0].text != base.choices[0].text
    m = server.metrics(headers=bearer(ADMIN))
    assert m.get('inferd_lora_requests_total{adapter="a"}', 0) >= 1
    assert m.get("inferd_lora_adapters_served") == 1


def test_the_router_prefers_the_workers_that_hold_the_adapter(server, lora_setup):
    """Only the worker that served adapter a holds it: a burst of requests for a all go there (without the
    preference, the least loaded worker takes each, and a burst splits evenly: tests/cluster/test_routing.py)."""
    alice = lora_setup["keys"]["alice"]
    first = httpx.post(server.url + "/v1/completions", json={"model": "a", "prompt": "hello", "max_tokens": 2},
                       headers=bearer(alice), timeout=30)
    holder = first.headers["x-inferd-worker"]
    other = ({"worker-0", "worker-1"} - {holder}).pop()
    # the holder's heartbeat lists it; the other worker never read it
    server.wait_metrics(lambda m: m.get(f'inferd_worker_lora_adapters{{worker="{holder}"}}', 0) >= 1)
    assert server.metrics().get(f'inferd_worker_lora_adapters{{worker="{other}"}}', 0) == 0

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=bearer(alice), timeout=60) as client:
            return await asyncio.gather(*(client.post(server.url + "/v1/completions", json={
                "model": "a", "prompt": p, "max_tokens": 16, "ignore_eos": True})
                for p in random_prompts(8, (10, 20), seed=37)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 8
    assert {r.headers["x-inferd-worker"] for r in responses} == {holder}


def admin_post(server, path: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=bearer(key), timeout=30)


def test_bad_adapters_are_400s_with_a_named_reason(server, lora_setup):
    bad = lora_setup["bad"]
    for what, code in (("shape", "adapter_shape_mismatch"), ("rank", "adapter_rank_too_large"),
                       ("missing", "adapter_not_found"), ("outside", "adapter_path_forbidden")):
        r = admin_post(server, "/v1/load_lora_adapter", {"lora_name": f"bad-{what}", "lora_path": str(bad[what])})
        assert r.status_code == 400, (what, r.text)
        assert r.json()["error"]["code"] == code, (what, r.json())
    r = admin_post(server, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": str(lora_setup["b"])})
    assert r.status_code == 400  # the base model's name
    for body in ({"lora_name": "../b", "lora_path": str(lora_setup["b"])},  # not a name
                 {"lora_name": "x" * 129, "lora_path": str(lora_setup["b"])},
                 {"lora_name": "x"}, {"lora_name": "x", "lora_path": str(lora_setup["b"]), "extra": 1},
                 {"lora_name": "x", "lora_path": "a" * 5000}):
        r = admin_post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == 400 and "error" in r.json(), (body, r.text)
    # a tenant's key does not open it
    r = admin_post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(lora_setup["b"])},
                   key=lora_setup["keys"]["carol"])
    assert r.status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_load_and_unload_while_streams_run_on_the_adapter(server, lora_setup):
    """Streams on adapter b run while b is unloaded: every one completes; after the unload b is a 404; loaded again,
    it serves again."""
    carol = lora_setup["keys"]["carol"]
    r = admin_post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(lora_setup["b"])})
    assert r.status_code == 200, r.text
    assert admin_post(server, "/v1/load_lora_adapter",
                      {"lora_name": "b", "lora_path": str(lora_setup["b"])}).json()["error"]["code"] == \
        "adapter_already_loaded"
    prompts = random_prompts(4, (10, 30), seed=33)

    async def run() -> list:
        async with httpx.AsyncClient(headers=bearer(carol), timeout=60) as client:
            async def one(p):
                body = {"model": "b", "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                chunks = []
                async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks.append(json.loads(line[6:]))
                            if len(chunks) == 3:
                                started.set()
                return chunks

            started = asyncio.Event()
            tasks = [asyncio.create_task(one(p)) for p in prompts]
            await started.wait()
            unloaded = await client.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "b"},
                                         headers=bearer(ADMIN))
            assert unloaded.status_code == 200, unloaded.text
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    for chunks in results:
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 10
        assert all("error" not in c for c in chunks)
    after = httpx.post(server.url + "/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2},
                       headers=bearer(carol), timeout=30)
    assert after.status_code == 404
    assert admin_post(server, "/v1/unload_lora_adapter", {"lora_name": "b"}).status_code == 404
    assert admin_post(server, "/v1/load_lora_adapter",
                      {"lora_name": "b", "lora_path": str(lora_setup["b"])}).status_code == 200
    again = httpx.post(server.url + "/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2},
                       headers=bearer(carol), timeout=30)
    assert again.status_code == 200, again.text
    # nothing the streams held is left: the gateway's room and the engines' running sequences come back
    server.wait_metrics(lambda m: m["inferd_gateway_in_flight_sequences"] == 0
                        and sum(v for k, v in m.items() if k.startswith("inferd_worker_requests_running")) == 0)


def test_a_stream_on_an_adapter_survives_its_workers_death(cluster, lora_setup):
    """Two workers; worker-0 kills itself (kill -9) in decode while it serves streams on adapters a and b (greedy and
    seeded): each continues on worker-1, which reads the adapter from disk itself, exactly as the same request
    run again undisturbed (the fault acts in a worker's first life only)."""
    s = lora_setup
    server = cluster("--workers", "2", "--threads", "1", "--heartbeat-timeout", "1.0", "--enable-lora",
                     "--max-lora-rank", "8", "--lora-modules", f"a={s['a']}", f"b={s['b']}",
                     env={"INFERD_FAULT": "action=crash,phase=decode,step=6,worker=worker-0"}, name="lora-replay")
    prompts = random_prompts(6, (20, 60), seed=35)
    bodies = [request_body("ab"[i % 2], p, 24, None if i % 3 else 500 + i) for i, p in enumerate(prompts)]
    ours = asyncio.run(run_all(server.url, bodies))
    m = server.metrics()
    assert m.get('inferd_replays_total{reason="worker_lost"}', 0) >= 1, "the fault never hit a running stream"
    again = asyncio.run(run_all(server.url, bodies))
    for i, (x, y) in enumerate(zip(ours, again)):
        assert_same_stream(x, y, bodies[i], len(prompts[i]))
    # the survivor wrote both adapters into its slots (it heartbeats its counts)
    server.wait_metrics(lambda mm: mm.get('inferd_worker_lora_loads_total{worker="worker-1"}', 0) >= 2)

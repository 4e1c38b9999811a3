"""Embeddings per second through HTTP (/v1/embeddings, one text per request) at several concurrencies, against
sentence-transformers' own `encode` (batch 64) on the same texts and weights, on this machine, one after the other.

    .venv/bin/python bench/embeddings.py [--texts 512] [--concurrencies 1,16,64] [--wait-ms 5]

The server is `inferd serve --echo --embedding-model default` (echo workers for the chat side: no second model
competing for the CPU); its embedding worker gets every core (--threads = cores), as sentence-transformers does.
Prints a table, the ratio at each concurrency, and JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _servers import start_server  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while inferd serves embeddings for search and retrieval of "
         "documents about cats dogs cities rivers mountains and the weather in paris").split()


def texts(n: int) -> list[str]:
    """Sentences of 8 to 40 words (11-50 tokens), deterministic."""
    out = []
    for i in range(n):
        k = 8 + (i * 7) % 33
        out.append(" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(k)))
    return out


async def run(url: str, items: list[str], concurrency: int) -> float:
    """Seconds to embed every item with `concurrency` requests in flight."""
    queue = list(enumerate(items))
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            while queue:
                _, text = queue.pop()
                r = await client.post(url + "/v1/embeddings", json={"input": text})
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--concurrencies", default="1,16,64")
    ap.add_argument("--wait-ms", type=float, default=5.0)
    args = ap.parse_args()
    items = texts(args.texts)
    cores = os.cpu_count() or 1

    from sentence_transformers import SentenceTransformer
    import torch

    from inferd.engine.embedding import default_embedding_model_path

    torch.set_num_threads(cores)
    st = SentenceTransformer(default_embedding_model_path(), device="cpu")
    st.encode(items[:64], batch_size=64)  # warm-up
    t0 = time.perf_counter()
    st.encode(items, batch_size=64)
    st_rate = len(items) / (time.perf_counter() - t0)
    del st

    server = start_server(None, ["--echo", "--embedding-model", "default", "--threads", str(cores), "--state-dir",
                                 "", "--embed-max-wait-ms", str(args.wait_ms)], "embeddings")
    result = {"texts": len(items), "sentence_transformers_per_s": st_rate, "http": {}}
    try:
        asyncio.run(run(server.url, items[:64], 16))  # warm-up
        for c in [int(x) for x in args.concurrencies.split(",")]:
            seconds = asyncio.run(run(server.url, items, c))
            result["http"][c] = {"per_s": len(items) / seconds, "ratio": len(items) / seconds / st_rate}
        metrics = httpx.get(server.url + "/metrics").text
        passes = next((float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("inferd_embedding_model_passes ")), None)
        result["model_passes"] = passes
    finally:
        server.kill()
    print(f"sentence-transformers encode (batch 64): {st_rate:.1f} texts/s ({len(items)} texts, {cores} threads)")
    print(f"{'concurrency':>12} {'texts/s':>9} {'vs ST':>7}")
    for c, r in result["http"].items():
        print(f"{c:>12} {r['per_s']:>9.1f} {r['ratio']:>7.2f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

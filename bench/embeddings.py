"""Embeddings per second through HTTP (/v1/embeddings, one text per request) at several concurrencies, against
sentence-transformers' own `encode` (batch 64) on the same texts and weights, on this machine, one after the other.

    .venv/bin/python bench/embeddings.py [--texts 512] [--concurrencies 1,16,64] [--wait-ms 5] [--dtype auto]

The server is `inferd serve --echo --embedding-model default --dtype DTYPE` (echo workers for the chat side: no
second model competing for the CPU); its embedding worker gets every core (--threads = cores), as
sentence-transformers does. The load comes from RawClient (a lean keep-alive client, as wrk; see there why), and
for comparison from httpx. sentence-transformers runs in its default float32 and, when the server's dtype is
another (auto = bf16 on CPUs with native bf16), also in that dtype: the ratio is printed against both.
Prints a table, the ratios at each concurrency, and JSON."""

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


class RawClient:
    """A lean HTTP/1.1 keep-alive client (what wrk does): one connection per concurrent sender, a hand-built POST,
    the response read by Content-Length. httpx costs 3-7 ms of CPU per request at c=64 on these 2 cores, which
    the server then lacks; this one a fraction of a millisecond. Answers must be 200 (else RuntimeError)."""

    def __init__(self, url: str):
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.conn = None

    async def post_json(self, path: str, body: dict) -> bytes:
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.conn
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        payload = await reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {payload[:200]!r}")
        return payload

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()


async def run_raw(url: str, items: list[str], concurrency: int) -> float:
    """run() with RawClient connections."""
    queue = list(enumerate(items))
    clients = [RawClient(url) for _ in range(concurrency)]

    async def worker(client: RawClient):
        while queue:
            _, text = queue.pop()
            json.loads(await client.post_json("/v1/embeddings", {"input": text}))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in clients))
    finally:
        for c in clients:
            c.close()
    return time.perf_counter() - t0


async def run(url: str, items: list[str], concurrency: int) -> float:
    """Seconds to embed every item with `concurrency` requests in flight (httpx)."""
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
    ap.add_argument("--dtype", default="auto", help="the server's --dtype (auto: what `make serve` runs)")
    args = ap.parse_args()
    items = texts(args.texts)
    cores = os.cpu_count() or 1

    import torch
    from sentence_transformers import SentenceTransformer

    from inferd.config import resolve_dtype
    from inferd.models.embedding_models import default_embedding_model_path

    torch.set_num_threads(cores)
    dtype = resolve_dtype(args.dtype)
    st_rates = {}
    for st_dtype in dict.fromkeys([torch.float32, dtype]):
        st = SentenceTransformer(default_embedding_model_path(), device="cpu").to(st_dtype)
        st.encode(items[:64], batch_size=64)  # warm-up
        t0 = time.perf_counter()
        st.encode(items, batch_size=64)
        st_rates[str(st_dtype).removeprefix("torch.")] = len(items) / (time.perf_counter() - t0)
        del st
    st_rate = st_rates["float32"]
    same = st_rates[str(dtype).removeprefix("torch.")]

    server = start_server(None, ["--echo", "--embedding-model", "default", "--threads", str(cores), "--state-dir",
                                 "", "--embed-max-wait-ms", str(args.wait_ms), "--dtype", args.dtype], "embeddings")
    result = {"texts": len(items), "server_dtype": str(dtype).removeprefix("torch."),
              "sentence_transformers_per_s": st_rates, "http": {}}
    try:
        asyncio.run(run(server.url, items[:64], 16))  # warm-up
        for c in [int(x) for x in args.concurrencies.split(",")]:
            rates = {}
            for client, fn in (("raw", run_raw), ("httpx", run)):
                rates[client] = len(items) / asyncio.run(fn(server.url, items, c))
            result["http"][c] = {"per_s": rates["raw"], "ratio": rates["raw"] / st_rate,
                                 "ratio_same_dtype": rates["raw"] / same, "httpx_per_s": rates["httpx"]}
        metrics = httpx.get(server.url + "/metrics").text
        passes = next((float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("inferd_embedding_model_passes ")), None)
        result["model_passes"] = passes
    finally:
        server.kill()
    for name, rate in st_rates.items():
        print(f"sentence-transformers encode (batch 64, {name}): {rate:.1f} texts/s ({len(items)} texts, {cores} "
              "threads)")
    print(f"server dtype {result['server_dtype']}")
    print(f"{'concurrency':>12} {'texts/s':>9} {'vs ST fp32':>11} {'vs ST same dtype':>17} {'httpx client':>13}")
    for c, r in result["http"].items():
        print(f"{c:>12} {r['per_s']:>9.1f} {r['ratio']:>11.2f} {r['ratio_same_dtype']:>17.2f} "
              f"{r['httpx_per_s']:>13.1f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

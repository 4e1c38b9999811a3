"""The load of bench/peers.sh: streaming chat completions at a fixed concurrency for a fixed time, the same body for
every OpenAI-compatible server (inferd, vLLM, llama-server) plus its own extra fields, and the table of the results.

    python bench/peers_load.py --url http://127.0.0.1:8000 --concurrency 16 --seconds 30 --max-tokens 128 \
        --extra-json '{"ignore_eos": true}' --label inferd --output inferd-c16.json     # prints the JSON too
    python bench/peers_load.py --table DIR        # the table of DIR/*.json, with the ratios inferd / the others

inferd's own load generator (inferd/bench/loadgen.py, `inferd bench`) sends token-id prompts to /v1/completions
with a fixed request count; this one sends text chat requests for a fixed time, with extra body fields
(`cache_prompt: false` for llama-server), and reuses its SSE parser.

Each of the --concurrency clients sends a request as soon as its previous one ended, until --seconds have passed;
the requests still running then are let finish (within --drain-timeout) so that their TTFT and TPOT count.
Every prompt is unique from its first tokens (a system message naming the request), so that no server's prefix cache
helps. Reported:
  - tok_s: output tokens that arrived inside the window (from the first request sent to --seconds later) per second:
    the steady-state throughput at that concurrency. A chunk's tokens are counted from the usage chunk
    (`stream_options.include_usage`) when the server sends one, spread over its content chunks, else one per chunk.
  - ttft_*_ms (request sent to first content chunk), tpot_*_ms ((last content chunk - first) / (tokens - 1)), over
    the requests that finished; failed requests and their first errors.
The warm-up (--warmup requests, one by one, not counted) runs first.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from inferd.bench.loadgen import SSEParser  # noqa: E402  (no torch: starts fast)

WORDS = ("river mountain lantern harbor violin comet meadow engine orchard glacier falcon library canyon ember "
         "compass island thunder garden pepper marble velvet castle forest mirror rocket saddle tunnel whisper "
         "anchor blossom cobalt desert feather harvest ivory jungle kettle lagoon nectar opal prairie quartz "
         "summit timber umbrella valley walnut yarrow zephyr").split()
TIMEOUT = httpx.Timeout(3600.0, connect=30.0)


@dataclass
class Result:
    index: int
    start: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of each content chunk
    usage_tokens: int | None = None
    end: float = 0.0
    error: str | None = None
    done: bool = False

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else sum(n for _, n in self.chunks)

    @property
    def ok(self) -> bool:
        return self.error is None and self.done and bool(self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.start if self.chunks else None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.tokens < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.tokens - 1)

    def tokens_until(self, t: float) -> float:
        """Output tokens that had arrived by time t (the usage count spread evenly over the content chunks)."""
        counted = sum(n for _, n in self.chunks)
        if not counted:
            return 0.0
        scale = (self.usage_tokens / counted) if self.usage_tokens is not None else 1.0
        return scale * sum(n for when, n in self.chunks if when <= t)


def messages(label: str, nonce: int, i: int) -> list[dict]:
    rng = random.Random(f"{label}-{nonce}-{i}")
    topic = ", ".join(rng.sample(WORDS, 4))
    return [{"role": "system", "content": f"Session {nonce}-{i}. You are a helpful assistant who writes long stories."},
            {"role": "user", "content": f"Request {i}: write a long, detailed story about {topic}."}]


def request_body(args: argparse.Namespace, extra: dict, i: int, max_tokens: int | None = None) -> dict:
    return {"model": args.model, "messages": messages(args.label, args.nonce, i),
            "max_tokens": max_tokens or args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def _chunk_tokens(chunk: dict) -> int:
    """Tokens a streamed chat chunk carries: token ids if any, else 1 per choice with content (a role-only first
    chunk and a finish_reason-only last chunk carry none)."""
    n = 0
    for choice in chunk.get("choices") or []:
        if choice.get("token_ids"):
            n += len(choice["token_ids"])
            continue
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or choice.get("text"):
            n += 1
    return n


async def send(client: httpx.AsyncClient, args: argparse.Namespace, body: dict, result: Result) -> Result:
    """Sends one request, filling `result` in place as the stream arrives (a cancelled one keeps what it got)."""
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", args.url.rstrip("/") + "/v1/chat/completions", json=body,
                                 headers=args.headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            parser = SSEParser()
            async for raw in resp.aiter_bytes():
                now = time.perf_counter()
                for data in parser.feed(raw):
                    if data.strip() == "[DONE]":
                        result.done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                        continue
                    if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                        result.usage_tokens = int(chunk["usage"]["completion_tokens"])
                    if n := _chunk_tokens(chunk):
                        result.chunks.append((now, n))
            if not result.done and result.error is None:
                result.error = "the stream ended before data: [DONE]"
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end = time.perf_counter()
    if result.error is None and not result.chunks:
        result.error = "no content received"
    return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 2)


async def run_load(args: argparse.Namespace) -> dict:
    extra = json.loads(args.extra_json)
    if not isinstance(extra, dict):
        raise SystemExit("--extra-json must be a JSON object")
    limits = httpx.Limits(max_connections=args.concurrency + 1, max_keepalive_connections=args.concurrency + 1)
    async with httpx.AsyncClient(limits=limits, timeout=TIMEOUT, trust_env=False) as client:
        if args.model is None:
            resp = await client.get(args.url.rstrip("/") + "/v1/models", headers=args.headers)
            resp.raise_for_status()
            args.model = resp.json()["data"][0]["id"]
        counter = 0
        for _ in range(args.warmup):
            index = -1 - counter
            warm = await send(client, args, request_body(args, extra, index, args.warmup_tokens), Result(index))
            counter += 1
            if not warm.ok:
                raise SystemExit(f"peers_load: the warm-up request failed: {warm.error}")
        t0 = time.perf_counter()
        deadline = t0 + args.seconds
        results: list[Result] = []
        next_index = 0

        async def client_loop() -> None:
            nonlocal next_index
            while time.perf_counter() < deadline:
                result, next_index = Result(next_index), next_index + 1
                results.append(result)
                await send(client, args, request_body(args, extra, result.index), result)

        tasks = [asyncio.create_task(client_loop()) for _ in range(args.concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=args.seconds + args.drain_timeout)
        for task in pending:  # past the drain timeout: abandon (closing the stream aborts the request)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        t_end = time.perf_counter()
        for r in results:
            if not r.done and r.error is None:
                r.error = f"abandoned after --drain-timeout {args.drain_timeout:g} s"

    ok = [r for r in results if r.ok]
    failed = [r for r in results if r.error is not None]
    window_end = min(deadline, t_end)
    window_tokens = sum(r.tokens_until(window_end) for r in results)
    errors = list(dict.fromkeys(r.error for r in failed))[:5]
    return {
        "server": args.label, "url": args.url, "model": args.model, "concurrency": args.concurrency,
        "seconds": args.seconds, "max_tokens": args.max_tokens, "extra": extra,
        "requests": len(results), "completed": len(ok), "failed": len(failed), "errors": errors,
        "window_s": round(window_end - t0, 3), "drain_s": round(max(0.0, t_end - deadline), 3),
        "output_tokens": sum(r.tokens for r in ok),
        "mean_output_tokens": round(sum(r.tokens for r in ok) / len(ok), 2) if ok else None,
        "tok_s": round(window_tokens / (window_end - t0), 2) if window_end > t0 else None,
        "ttft_p50_ms": _ms(percentile([r.ttft for r in ok], 50)),
        "ttft_p90_ms": _ms(percentile([r.ttft for r in ok], 90)),
        "tpot_p50_ms": _ms(percentile([r.tpot for r in ok if r.tpot is not None], 50)),
        "tpot_p90_ms": _ms(percentile([r.tpot for r in ok if r.tpot is not None], 90)),
        "e2e_p50_ms": _ms(percentile([r.end - r.start for r in ok], 50)),
    }


# ---------------------------------------------------------------------------------------------------------------
# The table


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b in (None, 0) else f"{a / b:.2f}"


def table(folder: str) -> str:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except ValueError:
                continue
        if isinstance(d, dict) and "server" in d and "concurrency" in d:
            rows.append(d)
    if not rows:
        return f"no results in {folder}\n"
    order = {"inferd": 0, "vllm": 1, "llama-server": 2}
    rows.sort(key=lambda d: (d["concurrency"], order.get(d["server"], 9), d["server"]))
    by = {(d["server"], d["concurrency"]): d for d in rows}
    levels = sorted({d["concurrency"] for d in rows})
    out = ["| c | server | tok/s | TTFT p50 ms | TPOT p50 ms | requests ok / failed |",
           "|---:|---|---:|---:|---:|---:|"]
    for d in rows:
        out.append(f"| {d['concurrency']} | {d['server']} | {_f(d.get('tok_s'))} | {_f(d.get('ttft_p50_ms'), 0)} | "
                   f"{_f(d.get('tpot_p50_ms'))} | {d.get('completed', 0)} / {d.get('failed', 0)} |")
    peers = [p for p in ("vllm", "llama-server") if any(s == p for s, _ in by)]
    if "inferd" in {s for s, _ in by} and peers:
        out += ["", "inferd / peer (tok/s: above 1 is inferd faster; TTFT, TPOT: below 1 is inferd faster)", ""]
        head = "| c |" + "".join(f" tok/s inferd/{p} | TTFT inferd/{p} | TPOT inferd/{p} |" for p in peers)
        out += [head, "|---:|" + "---:|" * (3 * len(peers))]
        for c in levels:
            me = by.get(("inferd", c), {})
            cells = []
            for p in peers:
                other = by.get((p, c), {})
                cells += [_ratio(me.get(k), other.get(k)) for k in ("tok_s", "ttft_p50_ms", "tpot_p50_ms")]
            out.append(f"| {c} | " + " | ".join(cells) + " |")
    failed = [d for d in rows if d.get("errors")]
    for d in failed:
        out.append(f"\n{d['server']} c={d['concurrency']}: {d['failed']} failed, first errors: {d['errors']}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", metavar="DIR", help="print the table of DIR/*.json instead of running a load")
    p.add_argument("--url", help="the server's base URL (POST {url}/v1/chat/completions)")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default="server", help="the server's name in the results")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--seconds", type=float, default=30.0, help="time the clients keep sending new requests")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-json", default="{}", help="fields added to every request body (a JSON object)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests, one by one, not counted")
    p.add_argument("--warmup-tokens", type=int, default=16, help="max_tokens of a warm-up request")
    p.add_argument("--drain-timeout", type=float, default=300.0,
                   help="s the requests running at the end of --seconds may take to finish")
    p.add_argument("--nonce", type=int, default=None, help="makes the prompts (default: from the clock)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.table:
        sys.stdout.write(table(args.table))
        return 0
    if not args.url:
        p.error("--url is needed (or --table DIR)")
    if args.concurrency < 1 or args.seconds <= 0 or args.max_tokens < 1:
        p.error("--concurrency, --seconds and --max-tokens must be positive")
    args.nonce = args.nonce if args.nonce is not None else time.time_ns() % 1_000_000_007
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = asyncio.run(run_load(args))
    text = json.dumps(result, indent=2)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""A victim's latency beside the hardening issue's ambiguous grammar (finding 6), through a real `inferd serve` of the
default model (fp32, its default budgets), run from the root of the tree to measure (old or new code):

    .venv/bin/python bench/grammar_hostile.py [--seconds 60] [--reach 175]

1. The victim alone: a 16-token greedy completion, 5 times (median).
2. The hostile request: `root ::= x*`, `x ::= "a" | "aa" | "aaa" | x x` (42 characters), streamed, with logit_bias
   forcing the "aaaa" token, so that its matcher's cost per token grows ~n^3.
3. Victims sent back to back from the hostile's start, for --seconds or until the hostile has --reach tokens.
Prints the medians, the hostile's token count and error, and the timeline (seconds: hostile tokens [x once it ended]:
victim latency), as JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import start_server  # noqa: E402

HOSTILE = 'root ::= x*\nx ::= "a" | "aa" | "aaa" | x x'


def victim(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=600, json={"prompt": "Once upon a time", "max_tokens": 16,
                                                                "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--reach", type=int, default=175)
    args = ap.parse_args()
    server = start_server(None, ["--kv-cache-bytes", "256M"], "grammar-hostile")
    try:
        url = server.url
        from inferd.models.loader import default_model_path
        from inferd.models.tokenizer import load_tokenizer

        aaaa = load_tokenizer(default_model_path()).hf.convert_tokens_to_ids("aaaa")
        victim(url)
        alone = [victim(url) for _ in range(5)]
        state = {"tokens": 0, "error": None, "ended": False}
        stop = threading.Event()

        def hostile() -> None:
            body = {"prompt": "Write the letter a many times:", "max_tokens": 400, "temperature": 0, "stream": True,
                    "logit_bias": {str(aaaa): 100}, "structured_outputs": {"grammar": HOSTILE}}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
                    for line in r.iter_lines():
                        if stop.is_set():
                            return
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if "error" in event:
                                state["error"] = event["error"]
                            else:
                                state["tokens"] += 1
            finally:
                state["ended"] = True

        threading.Thread(target=hostile, daemon=True).start()
        t0 = time.perf_counter()
        timeline = []
        while time.perf_counter() - t0 < args.seconds and state["tokens"] < args.reach:
            at, tokens, ended = time.perf_counter() - t0, state["tokens"], state["ended"]
            timeline.append((at, tokens, ended, victim(url)))
        stop.set()
        latencies = [t[3] for t in timeline]
        print(json.dumps({"alone_median_s": statistics.median(alone), "victims": len(latencies),
                          "beside_median_s": statistics.median(latencies), "beside_max_s": max(latencies),
                          "hostile_tokens": state["tokens"], "hostile_error": state["error"],
                          "timeline": " ".join(f"{a:.1f}s:{n}{'x' if e else ''}:{v:.2f}" for a, n, e, v in timeline)},
                         indent=1))
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compact JSON, measured (issue 31): JSON-schema structured output with whitespace of the model's choosing (xgrammar's
any_whitespace, bounded to JSON_MAX_WHITESPACE in a row) against compact (vLLM's disable_any_whitespace: separators
", " and ": ", nothing else), on the default model at temperature 1.

    .venv/bin/python bench/compact_json.py [--samples 40] [--max-tokens 160] [--concurrency 8]

`inferd serve` on the default model (float32); --samples seeded chat completions per mode (the same seeds both
ways), each asked for a small `strict` JSON schema (shown in the prompt) through structured_outputs.json with
structured_outputs.disable_any_whitespace false or true. Prints, per mode: the share of outputs that parse and
validate (jsonschema), the share cut off by max_tokens, and the mean output length in tokens; then compact/any.
A measure of quality, not of time: the host's load does not change it (seeded sampling)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import start_server  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPT = ("Invent a person. Answer with only a JSON object of this schema, nothing else:\n" + json.dumps(SCHEMA))
MODES = {"any_whitespace": False, "compact": True}  # mode -> disable_any_whitespace


def ask(url: str, seed: int, compact: bool, max_tokens: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "temperature": 1.0, "seed": seed,
            "max_tokens": max_tokens,
            "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": compact}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    text = out["choices"][0]["message"]["content"] or ""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {"valid": valid, "tokens": out["usage"]["completion_tokens"],
            "length": out["choices"][0]["finish_reason"] == "length", "text": text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--model", default=None, help="default: the default model")
    args = ap.parse_args()
    server = start_server(args.model, ["--served-model-name", "m", "--kv-cache-bytes", "256M"], "compact-json")
    try:
        jobs = [(mode, seed) for seed in range(args.samples) for mode in MODES]  # interleaved: same load both ways
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda job: (job[0], ask(server.url, job[1], MODES[job[0]], args.max_tokens)),
                                    jobs))
    finally:
        server.kill()
    summary = {}
    for mode in MODES:
        rs = [r for m, r in results if m == mode]
        summary[mode] = {"samples": len(rs), "valid": sum(r["valid"] for r in rs) / len(rs),
                         "cut_by_max_tokens": sum(r["length"] for r in rs) / len(rs),
                         "mean_tokens": statistics.mean(r["tokens"] for r in rs),
                         "example": next((r["text"] for r in rs if r["valid"]), rs[0]["text"])[:200]}
    a, c = summary["any_whitespace"], summary["compact"]
    print(f"{'mode':<16}{'valid':>8}{'cut':>8}{'mean tokens':>13}")
    for mode, s in summary.items():
        print(f"{mode:<16}{s['valid']:>8.0%}{s['cut_by_max_tokens']:>8.0%}{s['mean_tokens']:>13.1f}")
    print(f"{'compact/any':<16}{c['valid'] / a['valid'] if a['valid'] else float('inf'):>8.2f}{'':>8}"
          f"{c['mean_tokens'] / a['mean_tokens']:>13.2f}")
    print(json.dumps({"max_tokens": args.max_tokens, **summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

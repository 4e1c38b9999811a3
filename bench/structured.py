"""Structured outputs, measured (issue 16): what a constrained row adds to a decode step, what a grammar costs to
compile, and how often the default model's JSON validates with and without the constraint.

    .venv/bin/python bench/structured.py [--dtype auto] [--batches 1,32] [--steps 24] [--rounds 3] [--samples 32]

1. Step overhead: B requests decoding side by side, all constrained by a JSON schema or none, alternating rounds;
   the median decode step (engine.step() once every row is past its prefill) and the ratio constrained/plain. The
   constrained rows fill their bitmask (on the grammar threads, beside the forward pass), apply it and advance their
   matcher every step; the plain rows do not. The step thread's share of that grammar work is also timed on its own
   inside the constrained steps (median per step, and as a share of the plain step): the steadier figure on a noisy
   host.
2. Compile: the same schema on a fresh compiler (first) and again (cached), and the tokenizer info built once.
3. Validity at temperature 1: `--samples` seeded chat completions asked for a JSON object of the schema (shown in
   the prompt), with the constraint and without; the share that parse and validate (jsonschema).
Prints a table and JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferd.config import EngineConfig, resolve_dtype  # noqa: E402
from inferd.engine import Engine, SamplingParams  # noqa: E402
from inferd.engine.structured import compile_constraint  # noqa: E402
from inferd.models.build import load_model  # noqa: E402
from inferd.models.loader import default_model_path  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
}


class GrammarClock:
    """Seconds the step's own thread spends on grammars: starting the mask fills (they run on the grammar threads
    beside the forward pass), waiting for what is left of them and applying the masks, and advancing the matchers
    (the engine's Grammars: start_masks, apply_masks, accept). On a noisy shared host this is a steadier measure of the
    overhead than the difference of two step times."""

    def __init__(self, engine: Engine):
        self.seconds = 0.0
        for name in ("start_masks", "apply_masks", "accept"):
            setattr(engine.grammars, name, self._timed(getattr(engine.grammars, name)))

    def _timed(self, inner):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def decode_steps(engine: Engine, prompt: list[int], batch: int, steps: int, constrained: bool,
                 clock: GrammarClock | None = None, grammar: list | None = None) -> list[float]:
    """Seconds of each decode step of `batch` rows (after every prefill), greedy, `steps` of them; the grammar
    seconds of those steps are appended to `grammar`."""
    structured = ("json", json.dumps(SCHEMA)) if constrained else None
    # ignore_eos keeps plain rows running; constrained ones run as long as their grammar lasts (bounded below)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=not constrained,
                            structured=structured)
    ids = [engine.add_request(prompt, params) for _ in range(batch)]
    times = []
    while engine.has_unfinished_requests():
        running = [engine.requests[i] for i in ids if i in engine.requests]
        decoding = len(running) == batch and all(r.num_computed_tokens >= len(prompt) for r in running)
        g0 = clock.seconds if clock else 0.0
        t0 = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t0)
            if grammar is not None and clock is not None:
                grammar.append(clock.seconds - g0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=32)
    args = ap.parse_args()
    dtype = resolve_dtype(args.dtype, "cpu")
    model, config, tok = load_model(default_model_path(), dtype=dtype)
    engine = Engine(model, config, EngineConfig(dtype=args.dtype, kv_cache_bytes=512 << 20), dtype, tok)
    result: dict = {"dtype": str(dtype).removeprefix("torch."), "overhead": {}}

    # 2. compile: the work of a compile process (grammar_compile.py) in this one, and a cached schema in the engine's
    # compile service (first its process starts and compiles it)
    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tok.hf, vocab_size=config.vocab_size,
                                                   stop_token_ids=sorted(engine.eos_token_ids))
    info_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compile_constraint(xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False), "json", json.dumps(SCHEMA))
    first_s = time.perf_counter() - t0
    service = engine.grammars.compiler()
    service.submit("json", json.dumps(SCHEMA)).result()
    t0 = time.perf_counter()
    service.submit("json", json.dumps(SCHEMA)).result()
    cached_s = time.perf_counter() - t0
    result["compile"] = {"tokenizer_info_s": info_s, "first_s": first_s, "cached_s": cached_s}

    # 1. step overhead
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a user of our system as JSON."}],
                                     add_generation_prompt=True)
    clock = GrammarClock(engine)
    decode_steps(engine, prompt, 2, 4, True)  # warm-up: the compiler, the kernels
    for batch in [int(b) for b in args.batches.split(",")]:
        plain, constrained, grammar = [], [], []
        for _ in range(args.rounds):
            plain += decode_steps(engine, prompt, batch, args.steps, False)
            constrained += decode_steps(engine, prompt, batch, args.steps, True, clock, grammar)
        p, c, g = statistics.median(plain), statistics.median(constrained), statistics.median(grammar)
        result["overhead"][batch] = {"plain_ms": p * 1e3, "constrained_ms": c * 1e3, "ratio": c / p,
                                     "grammar_ms": g * 1e3, "grammar_share_of_plain": g / p,
                                     "steps": [len(plain), len(constrained)]}

    # 3. validity at temperature 1
    import jsonschema

    ask = tok.apply_chat_template([{"role": "user", "content": "Reply with only a JSON object following this JSON "
                                    f"schema: {json.dumps(SCHEMA)}"}], add_generation_prompt=True)
    validity = {}
    for label, structured in (("constrained", ("json", json.dumps(SCHEMA))), ("plain", None)):
        params = [SamplingParams(max_tokens=200, temperature=1.0, seed=7000 + i, structured=structured)
                  for i in range(args.samples)]
        ok = 0
        for req in engine.generate([ask] * args.samples, params):
            text = tok.decode([t for t in req.output_token_ids if t not in engine.eos_token_ids]).strip()
            if text.startswith("```"):  # be generous to the unconstrained model: a fenced block counts
                text = text.strip("`").removeprefix("json").strip()
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                ok += 1
            except Exception:
                pass
        validity[label] = ok / args.samples
    result["validity"] = validity

    print(f"dtype {result['dtype']}; compile: tokenizer info {info_s * 1e3:.0f} ms (once), schema first "
          f"{first_s * 1e3:.1f} ms, cached {cached_s * 1e3:.3f} ms")
    print(f"{'batch':>6} {'plain ms':>10} {'constrained ms':>15} {'ratio':>7} {'grammar ms':>11} {'grammar/plain':>14}")
    for batch, r in result["overhead"].items():
        print(f"{batch:>6} {r['plain_ms']:>10.2f} {r['constrained_ms']:>15.2f} {r['ratio']:>7.3f} "
              f"{r['grammar_ms']:>11.2f} {r['grammar_share_of_plain']:>14.1%}")
    print(f"valid JSON at temperature 1 ({args.samples} samples): constrained {validity['constrained']:.0%}, "
          f"plain {validity['plain']:.0%}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

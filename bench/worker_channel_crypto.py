"""What sealing the worker channel costs (inferd/worker/sealing.py), per frame and per token, next to what the same
frame's JSON already costs.

Frames, built with the protocol's own constructors as the worker and the gateway build them: a heartbeat; an
`outputs` frame of one decode step for 1, 16 and 64 sequences (one new token each, as a plain decode step sends);
an `add` with a 2,048-token prompt. For each: its JSON encode + decode (encode_body + decode_message: what every
frame paid before sealing), seal + open with the channel's AES-256-GCM (Sealer / Opener: counters, nonces, the
ratchet accounting), and, for comparison, ChaCha20-Poly1305 on the same bytes. Each cell is the best over --rounds of
the mean of --iterations; per token divides the frame's cost by the tokens it carries (sequences for outputs, prompt
tokens for the add).

    .venv/bin/python bench/worker_channel_crypto.py [--iterations 2000] [--rounds 7]

Timings on a shared machine are noisy: the load average is printed; compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305  # noqa: E402

from inferd.engine.outputs import RequestOutput  # noqa: E402
from inferd.engine.request import SamplingParams  # noqa: E402
from inferd.worker.protocol import (  # noqa: E402
    CLIENT_MESSAGE_TYPES,
    OUTPUTS,
    WORKER_MESSAGE_TYPES,
    WorkerStats,
    add_message,
    decode_message,
    encode_body,
    heartbeat_message,
    new_nonce,
    output_entry,
)
from inferd.worker.sealing import channel  # noqa: E402

VOCAB = 49152  # SmolLM2's


def outputs_frame(num_seqs: int, rng: random.Random) -> dict:
    entries = [output_entry(RequestOutput(request_id=f"cmpl-{rng.getrandbits(96):024x}-0",
                                          new_token_ids=[rng.randrange(VOCAB)], num_prompt_tokens=900 + i,
                                          num_output_tokens=40 + i, num_cached_tokens=512), epoch=1)
               for i in range(num_seqs)]
    return {"type": OUTPUTS, "step": 123456, "step_s": 0.0213, "outputs": entries, "bytes": 270_000_000,
            "flops": 17_000_000_000, "prefill_tokens": 0, "decode_tokens": num_seqs}


def frames(rng: random.Random) -> list[tuple[str, dict, int, frozenset]]:
    """(name, message, tokens it carries, the type set its reader decodes with)."""
    stats = WorkerStats(running=37, waiting=3, kv_blocks_in_use=1234, kv_blocks_free=2000, kv_num_blocks=4096,
                        prefix_cache_hits=123456, prefix_cache_queries=234567, num_steps=99999,
                        step_seconds_total=1234.5, step_tokens=64, step_in_progress_s=0.004)
    prompt = [rng.randrange(VOCAB) for _ in range(2048)]
    return [("heartbeat", heartbeat_message(4242, 12345.678, stats), 0, WORKER_MESSAGE_TYPES),
            *[(f"outputs, {n} seq", outputs_frame(n, rng), n, WORKER_MESSAGE_TYPES) for n in (1, 16, 64)],
            ("add, 2k-token prompt", add_message("cmpl-0123456789abcdef-0", 1, prompt, SamplingParams(max_tokens=256)),
             2048, CLIENT_MESSAGE_TYPES)]


def best_mean(fn, iterations: int, rounds: int) -> float:
    """Seconds per call: the best round's mean."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, (time.perf_counter() - start) / iterations)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(0)
    secret, worker_nonce, client_nonce = os.urandom(32).hex().encode(), new_nonce(), new_nonce()
    sealer, _ = channel(secret, worker_nonce, client_nonce, worker_side=True)
    _, opener = channel(secret, worker_nonce, client_nonce, worker_side=False)
    chacha = ChaCha20Poly1305(os.urandom(32))
    nonce = bytes(12)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; best of {args.rounds} rounds x "
          f"{args.iterations} iterations; microseconds")
    header = (f"{'frame':<22} {'bytes':>7} {'JSON enc+dec':>13} {'AES-GCM seal+open':>18} {'ratio':>6} "
              f"{'per token':>10} {'ChaCha20 seal+open':>19}")
    print(header)
    print("-" * len(header))
    for name, message, tokens, types in frames(rng):
        body = encode_body(message)
        json_s = best_mean(lambda message=message, types=types: decode_message(encode_body(message), types),
                           args.iterations, args.rounds)

        def seal_open(body=body):
            assert opener.open(sealer.seal(body)) is not None  # the same counters on both ends, in step

        aes_s = best_mean(seal_open, args.iterations, args.rounds)
        chacha_s = best_mean(lambda body=body: chacha.decrypt(nonce, chacha.encrypt(nonce, body, None), None),
                             args.iterations, args.rounds)
        per_token = f"{aes_s / tokens * 1e6:10.3f}" if tokens else f"{'-':>10}"
        print(f"{name:<22} {len(body):>7} {json_s * 1e6:13.2f} {aes_s * 1e6:18.2f} {aes_s / json_s:6.2f} "
              f"{per_token} {chacha_s * 1e6:19.2f}")


if __name__ == "__main__":
    main()

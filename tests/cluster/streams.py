"""Streams as a client sees them (token ids, their logprobs, arrival times, errors), and their comparison with the
same request on an undisturbed server by the exactness rule (tests/parity.py):

- on every compared position the chosen token's logprob and the top-20 logprobs both streams list agree within the
  float32 bound (at the scale of the reference's top-20 logprobs);
- greedy: a divergence is accepted only at a position where the reference's top-2 logprob gap (= logit gap) is below
  that bound;
- seeded sampling: only where the position's uniform draw lies within 1e-3 of a boundary of the CDF of the filtered
  distribution, rebuilt from the reference's top-20 logprobs (the requests use top_k <= 20, so those hold every
  token the sampler could pick, and softmax is shift-invariant: logprobs give the same distribution as logits).
Nothing after the first divergence can be compared; never fewer tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import torch

from inferd.engine.request import SamplingParams
from parity import FP32, assert_sampling_match, greedy_divergence, scale_of, top2_gap
from servers import aiter_sse

TOP = 20  # logprobs asked for: the whole filtered distribution when top_k <= 20


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of every chunk with tokens
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)
    done: bool = False
    headers: dict = field(default_factory=dict)
    prompt_logprobs: list = field(default_factory=list)  # every copy received (vLLM's field, when asked for)

    @property
    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


def request_body(model: str, prompt: list[int], max_tokens: int, seed: int | None, **extra) -> dict:
    """greedy when seed is None, else seeded sampling (temperature 0.9, top_k 20)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "logprobs": TOP,
            "return_tokens_as_token_ids": True, "ignore_eos": True, **extra}
    if seed is None:
        body["temperature"] = 0
    else:
        body.update(temperature=0.9, top_k=TOP, seed=seed)
    return body


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> Stream:
    out = Stream()
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        out.headers = dict(response.headers)
        assert response.status_code == 200, (response.status_code, await response.aread())
        async for chunk in aiter_sse(response):
            if chunk == "[DONE]":
                out.done = True
                break
            if "error" in chunk:
                out.errors.append(chunk["error"])
                continue
            choice = chunk["choices"][0]
            if choice.get("logprobs") and choice["logprobs"]["tokens"]:
                out.arrivals.append(time.monotonic())
            add_choice(out, choice)
    return out


def add_choice(out: Stream, choice: dict) -> Stream:
    """Adds a completion choice's (or a streamed chunk's) tokens, logprobs and finish reason to out."""
    lp = choice.get("logprobs")
    if lp and lp["tokens"]:
        for tok, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            out.tokens.append(int(tok.removeprefix("token_id:")))
            out.logprobs.append(logprob)
            out.tops.append({int(k.removeprefix("token_id:")): v for k, v in top.items()})
    if choice.get("finish_reason"):
        out.finish_reason = choice["finish_reason"]
    if choice.get("prompt_logprobs") is not None:
        out.prompt_logprobs.append(choice["prompt_logprobs"])
    return out


async def run_all(url: str, bodies: list[dict]) -> list[Stream]:
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(*(stream_completion(client, url, b) for b in bodies))


def assert_same_stream(ours: Stream, ref: Stream, body: dict, num_prompt_tokens: int) -> None:
    """ours equals ref by the exactness rule (module docstring): complete, no error, no duplicate or gap."""
    assert ours.done and not ours.errors, ours.errors
    assert ref.done and not ref.errors, ref.errors
    assert len(ours.tokens) == len(ref.tokens) == body["max_tokens"], (len(ours.tokens), len(ref.tokens))
    assert ours.finish_reason == ref.finish_reason == "length"
    if body.get("prompt_logprobs") is not None:  # once (a replay's copy is dropped), every position within the bound
        assert len(ours.prompt_logprobs) == len(ref.prompt_logprobs) == 1, len(ours.prompt_logprobs)
        assert_same_prompt_logprobs(ours.prompt_logprobs[0], ref.prompt_logprobs[0], num_prompt_tokens)
    if body.get("seed") is None:
        greedy_divergence(ours.tokens, ref.tokens, lambda i: top2_gap(list(ref.tops[i].values())),
                          lambda i: logprob_diff(ours, ref, i), "greedy stream",
                          scale_at=lambda i: scale_of(list(ref.tops[i].values())))
        return
    params = SamplingParams(max_tokens=1, temperature=body["temperature"], top_k=body["top_k"],
                            top_p=body.get("top_p", 1.0), seed=body["seed"])
    assert_sampling_match(ours.tokens, ref.tokens, [top_logits(top) for top in ref.tops], params, body["seed"],
                          num_prompt_tokens, "seeded stream", diff_at=lambda i: logprob_diff(ours, ref, i))


def assert_same_prompt_logprobs(ours: list, ref: list, num_prompt_tokens: int) -> None:
    """Two responses' prompt_logprobs (vLLM's shape) agree: one entry per prompt position, the first None, and at
    each position the same tokens' logprobs within the float32 bound (the scale: the largest logprob magnitude)."""
    assert len(ours) == len(ref) == num_prompt_tokens and ours[0] is None and ref[0] is None
    for p, (a, b) in enumerate(zip(ours[1:], ref[1:]), 1):
        common = a.keys() & b.keys()
        assert common, f"prompt position {p}: no token in common"
        diff = max(abs(a[t]["logprob"] - b[t]["logprob"]) for t in common)
        assert diff <= 2 * FP32.tolerance(scale_of([v["logprob"] for v in b.values()])), \
            f"prompt position {p}: logprobs {diff} apart"


def logprob_diff(ours: Stream, ref: Stream, i: int) -> float:
    """How far position i's logprobs are apart: the chosen token's, and those of the tokens both top lists hold (a
    token at the edge of one top-20 may be missing from the other)."""
    common = ours.tops[i].keys() & ref.tops[i].keys()
    assert common, f"position {i}: the top logprobs share no token"
    return max([abs(ours.logprobs[i] - ref.logprobs[i])] + [abs(ours.tops[i][t] - ref.tops[i][t]) for t in common])


def top_logits(top: dict[int, float]) -> torch.Tensor:
    """Logits over the vocabulary rebuilt from a position's top logprobs (the rest -inf: never drawn)."""
    logits = torch.full((max(top) + 1,), float("-inf"))
    for token, logprob in top.items():
        logits[token] = logprob
    return logits

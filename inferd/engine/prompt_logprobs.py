"""Prompt logprobs: every prompt position's logprob under the model (and its top-n), what lm-evaluation-harness's
loglikelihood tasks read through /v1/completions' `echo`.

Position p's logprob is that of token p under the logits of position p - 1 (the first position has none). A request
asking for them (SamplingParams.prompt_logprobs) has every row of its prefill chunks kept
(ScheduledRequest.num_prompt_logits): the model's final hidden states of those rows go through the LM head here,
a slice at a time so that a large step budget cannot make a [tokens x vocabulary] float32 tensor, and the entries
are collected on the request (Request.prompt_logprobs) across chunked prefill until its first output carries them.

The prefix cache: a cached block holds KV, not hidden states, and a position's logprob needs its hidden state. Such a
request therefore takes no prefix-cache hit (KVCacheManager.match_prefix) and runs its whole prompt; its blocks
are still published for the requests after it. The cost is one prefill of the prompt, measured in
docs/benchmarks.md (bench/prompt_logprobs.py). The alternative, keeping every cached position's logits, would cost
a vocabulary of floats per cached token for the rare request that reads them.

Logprobs are of the model's own logits (before logit_bias, penalties and temperature), as vLLM's and as
transformers' reference computes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .outputs import TokenLogprob
from .request import Request
from .scheduler import SchedulerOutput

PROMPT_LOGPROBS_SLICE_ROWS = 128  # rows through the LM head at once: bounds the float32 [rows x vocab] temporary


class PromptRows(NamedTuple):
    """One request's rows of a step that give prompt logprobs: the step rows [row, row + count), at positions
    [position, position + count) (each predicting the token after it)."""
    request: Request
    row: int
    position: int
    count: int


def plan(sched: SchedulerOutput) -> list[PromptRows]:
    """The step's rows that give prompt logprobs (empty for nearly every step)."""
    out, row = [], 0
    for s in sched.scheduled:
        n = s.num_prompt_logits
        if n:
            out.append(PromptRows(s.request, row, s.request.num_computed_tokens, n))
        row += s.num_tokens
    return out


def compute(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
            rows: list[PromptRows]) -> list[tuple[Request, int, list[TokenLogprob]]]:
    """hidden: the final hidden states of every planned row, concatenated in plan order. Returns, per planned
    request, (request, the position of its first entry, its entries): entry k is position `position + k + 1`'s."""
    targets, tops = [], []
    for r in rows:
        ids = r.request.token_ids
        targets += ids[r.position + 1:r.position + r.count + 1]
        tops += [r.request.params.prompt_logprobs or 0] * r.count
    top_n = max(tops, default=0)
    target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    chosen_parts, rank_parts, top_v_parts, top_i_parts = [], [], [], []
    for lo in range(0, hidden.shape[0], PROMPT_LOGPROBS_SLICE_ROWS):
        hi = lo + PROMPT_LOGPROBS_SLICE_ROWS
        lp = torch.log_softmax(compute_logits(hidden[lo:hi]), dim=-1)
        chosen = lp.gather(1, target[lo:hi, None])
        chosen_parts.append(chosen.squeeze(1))
        rank_parts.append((lp > chosen).sum(dim=1) + 1)
        if top_n:
            v, i = torch.topk(lp, top_n, dim=-1)
            top_v_parts.append(v)
            top_i_parts.append(i)
    chosen = torch.cat(chosen_parts).tolist()
    ranks = torch.cat(rank_parts).tolist()
    top_v = torch.cat(top_v_parts).tolist() if top_n else []
    top_i = torch.cat(top_i_parts).tolist() if top_n else []
    out, at = [], 0
    for r in rows:
        entries = []
        for _ in range(r.count):
            n = tops[at]
            top = list(zip(top_i[at][:n], top_v[at][:n])) if n else []
            entries.append(TokenLogprob(targets[at], chosen[at], top, ranks[at]))
            at += 1
        out.append((r.request, r.position, entries))
    return out


def collect(request: Request, position: int, entries: list[TokenLogprob]) -> None:
    """Adds a step's entries to the request's, each once: a chunk recomputed after a preemption repeats entries it
    has, and a replayed request (prompt + its earlier output) has rows past its original prompt, which have none."""
    have = request.prompt_logprobs
    if have is None or request.prompt_logprobs_sent:
        return
    for k, entry in enumerate(entries):
        p = position + k + 1
        if p == len(have) and p < request.num_prompt_tokens:
            have.append(entry)


def take(request: Request) -> list[TokenLogprob | None] | None:
    """The request's prompt logprobs for its first output (once): None when it asked for none or sent them."""
    if request.prompt_logprobs is None or request.prompt_logprobs_sent:
        return None
    out, request.prompt_logprobs = request.prompt_logprobs, None
    request.prompt_logprobs_sent = True
    return out

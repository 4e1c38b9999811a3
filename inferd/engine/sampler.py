"""Sampler: greedy, temperature, top-k, top-p, and logprobs.

Randomness is a pure function of (request seed, token position): the draw for position p is a uniform number from
a counter-based generator (SplitMix64), and a token is picked by inverse CDF over the filtered distribution sorted
by probability. So a request replayed from any prefix of its own output samples the same tokens, whatever batch it
shares, in whatever process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_draw(seed: int, position: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, position)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 11) * (1.0 / (1 << 53))


def filtered_sorted_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """For one row of logits: (probabilities after temperature/top-k/top-p, sorted descending and renormalised;
    the token ids in that order)."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_k > 0:
        sorted_p, sorted_ids = torch.topk(probs, min(params.top_k, probs.shape[-1]))
    else:
        sorted_p, sorted_ids = torch.sort(probs, descending=True)
    if params.top_p < 1.0:
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p * sorted_p.sum(), 0.0)
    return sorted_p / sorted_p.sum(), sorted_ids


def sample_row(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    probs, ids = filtered_sorted_probs(logits, params)
    cdf = torch.cumsum(probs, dim=-1)
    target = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    idx = int(torch.searchsorted(cdf, target, right=True))
    return int(ids[min(idx, int((probs > 0).sum()) - 1)])


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> None:
    """In place on one row. Output tokens are those after the original prompt, so a replayed request (whose
    prompt includes its earlier outputs) is penalised exactly as the original was."""
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        seen[torch.tensor(prompt_ids + output_ids, dtype=torch.long, device=logits.device)] = True
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab).to(logits)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token id, logprob), most likely first


class Sampler:
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               positions: list[int], raw_logits: torch.Tensor | None = None
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [N, V] float32, one row per sampling request, after penalties; raw_logits: the model's own,
        for logprobs (default: logits). positions: index the new token will have."""
        tokens = [0] * len(params)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            if len(greedy_rows) == len(params):
                tokens = logits.argmax(dim=-1).tolist()
            else:
                best = logits[greedy_rows].argmax(dim=-1).tolist()
                for i, t in zip(greedy_rows, best):
                    tokens[i] = t
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = sample_row(logits[i], p, uniform_draw(seeds[i], positions[i]))
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax((logits if raw_logits is None else raw_logits)[want], dim=-1)
            for row, i in enumerate(want):
                n = params[i].logprobs
                top_v, top_i = torch.topk(lp[row], n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
                logprobs[i] = TokenLogprob(tokens[i], float(lp[row, tokens[i]]),
                                           list(zip(top_i.tolist(), top_v.tolist())))
        return tokens, logprobs

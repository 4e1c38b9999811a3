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


SAMPLE_TOP_FIRST = 256  # candidates a batched draw orders first; rows it cannot resolve try 16x as many, and so on
SAMPLE_TOP_GROWTH = 16


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], us: list[float],
                first: int = SAMPLE_TOP_FIRST) -> list[int]:
    """The draws of several rows at once without sorting each whole vocabulary: one batched topk takes every row's
    `first` most likely tokens, which hold nearly all of a trained model's mass (SmolLM2 at temperature 1: median
    0.994 for 256), in a canonical order (probability descending, then token id); the draw is resolved among them,
    and the rows whose draw, top-k cut or top-p cut lands past the trusted candidates are drawn again among
    SAMPLE_TOP_GROWTH times as many, up to the whole vocabulary. The draw semantics are sample_row's: the CDF over
    tokens sorted by probability after temperature, top-k and top-p. Its float sums are taken in another order (a
    token moves only for a draw within a few ulps of a CDF boundary), and tokens of exactly equal probability are
    ordered by token id (sample_row's sort orders them arbitrarily). Each row's token depends on that row alone.
    64 rows of SmolLM2's vocabulary: ~9 ms against ~180 ms for a sort per row (docs/benchmarks.md)."""
    R, V = logits.shape
    dev = logits.device
    k = min(V, max([first] + [p.top_k for p in params]))
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    if k == V:  # the whole vocabulary: a stable sort is the canonical order (probability, then token id)
        vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    else:
        vals, ids = torch.topk(probs, k, dim=-1)
        # a canonical order, probability descending then token id: topk's order of equal values depends on the batch
        by_id = torch.argsort(ids, dim=-1)
        vals, ids = vals.gather(-1, by_id), ids.gather(-1, by_id)
        order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
        vals, ids = vals.gather(-1, order), ids.gather(-1, order)
    # candidates equal to the last one may be part of a group of equal values that the cut at k splits (which of
    # its members topk kept depends on the batch): only the positions before that group are trusted
    trusted = (vals > vals[:, -1:]).sum(-1) if k < V else torch.full((R,), V, device=dev)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=dev)
    vals = vals.masked_fill(torch.arange(k, device=dev)[None, :] >= top_k[:, None], 0.0)
    # the mass of the row before top-p: its top-k (all among the candidates), or all of it
    total = torch.where(top_k < V, vals.sum(-1), probs.sum(-1))
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    mass_before = torch.cumsum(vals, dim=-1) - vals
    cut = mass_before >= (top_p * total)[:, None]
    vals = vals.masked_fill(cut, 0.0)
    inside = (top_k < V) | cut.any(-1)  # every token the row keeps is a candidate
    kept = torch.where(inside, vals.sum(-1), total)
    cdf = torch.cumsum(vals / kept[:, None], dim=-1)
    # where the row's whole CDF ends: its last candidate when everything kept is one, else (all kept) ~1
    ends = torch.where(inside, cdf[:, -1], torch.ones_like(kept))
    target = torch.tensor(us, dtype=torch.float32, device=dev) * ends
    idx = torch.searchsorted(cdf, target[:, None].contiguous(), right=True).squeeze(1)
    nonzero = (vals > 0).sum(-1)
    tokens: list[int] = [0] * R
    again = []  # rows these candidates cannot resolve: the draw, the top-k cut or the top-p cut past the trusted
    rows = zip(idx.tolist(), nonzero.tolist(), inside.tolist(), trusted.tolist(), params)
    for r, (i, n, whole, t, p) in enumerate(rows):
        if k < V and ((not whole and p.top_p < 1.0) or i >= t or (whole and n > t) or (0 < p.top_k and p.top_k > t)):
            again.append(r)
        else:
            tokens[r] = int(ids[r, min(i, n - 1)])
    if again:  # SAMPLE_TOP_GROWTH times as many candidates, up to the whole vocabulary (every candidate trusted)
        drawn = sample_rows(logits[again], [params[r] for r in again], [us[r] for r in again],
                            min(V, k * SAMPLE_TOP_GROWTH))
        for r, token in zip(again, drawn):
            tokens[r] = token
    return tokens


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
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:  # one batched draw (sample_rows), not a full sort per row
            drawn = sample_rows(logits[sampled], [params[i] for i in sampled],
                                [uniform_draw(seeds[i], positions[i]) for i in sampled])
            for i, t in zip(sampled, drawn):
                tokens[i] = t
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

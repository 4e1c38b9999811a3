"""Sampler: greedy, temperature, top-k, top-p, and logprobs.

Randomness is a pure function of (request seed, token position): the draw for position p is a uniform number from
a counter-based generator (SplitMix64), and a token is picked by inverse CDF over the filtered distribution sorted
by probability. So a request replayed from any prefix of its own output samples the same tokens, whatever batch it
shares, in whatever process.
"""

from __future__ import annotations

import torch

from .outputs import TokenLogprob  # noqa: F401 (its home before outputs.py)
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
    tokens, again = draw_rows(logits, params, us, first)
    return redraw(logits, params, us, first, tokens.tolist(), again.tolist())


def draw_rows(logits: torch.Tensor, params: list[SamplingParams], us: list[float],
              first: int = SAMPLE_TOP_FIRST) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_rows' first round, on the logits' device without a sync: (tokens [R] long, again [R] bool), again
    marking the rows these candidates cannot resolve (their tokens are then meaningless; redraw() draws them)."""
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
    top_k_asked = torch.tensor([p.top_k for p in params], device=dev)  # 0: none
    top_k = torch.where(top_k_asked > 0, top_k_asked, V)
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
    tokens = ids.gather(1, torch.minimum(idx, nonzero - 1).clamp(min=0)[:, None]).squeeze(1)
    if k == V:  # every candidate trusted
        return tokens, torch.zeros(R, dtype=torch.bool, device=dev)
    # the draw, the top-k cut or the top-p cut past the trusted candidates
    again = ((~inside & (top_p < 1.0)) | (idx >= trusted) | (inside & (nonzero > trusted))
             | ((top_k_asked > 0) & (top_k_asked > trusted)))
    return tokens, again


def redraw(logits: torch.Tensor, params: list[SamplingParams], us: list[float], first: int, tokens: list[int],
           again: list[bool]) -> list[int]:
    """draw_rows' tokens, with the rows it could not resolve drawn again among SAMPLE_TOP_GROWTH times as many
    candidates (sample_rows, recursively; up to the whole vocabulary, where every candidate is trusted)."""
    rows = [r for r, a in enumerate(again) if a]
    if not rows:
        return tokens
    V = logits.shape[1]
    k = min(V, max([first] + [p.top_k for p in params]))
    drawn = sample_rows(logits[rows], [params[r] for r in rows], [us[r] for r in rows], min(V, k * SAMPLE_TOP_GROWTH))
    tokens = list(tokens)
    for r, token in zip(rows, drawn):
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


class PenaltyState:
    """One request's penalty inputs, kept on the logits' device and brought up to date with the tokens added since
    the last step (not its whole history copied to the device every step): which tokens its prompt and output hold
    (repetition penalty) and how often each occurs in its output (presence and frequency). Preemption keeps it
    valid (the tokens do not change); a replayed request is a new Request and builds its own."""

    def __init__(self, vocab: int, device: torch.device):
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.accounted = 0  # token_ids[:accounted] are in seen (and, past the prompt, in counts)

    def update(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        if self.accounted == len(token_ids):
            return
        dev = self.seen.device
        new = torch.tensor(token_ids[self.accounted:], dtype=torch.long, device=dev)
        self.seen[new] = True
        first_output = max(0, num_prompt_tokens - self.accounted)
        if first_output < new.numel():
            self.counts.index_add_(0, new[first_output:], torch.ones(new.numel() - first_output, device=dev))
        self.accounted = len(token_ids)


def apply_penalties_batch(logits: torch.Tensor, rows: list[int], states: list[PenaltyState],
                          params: list[SamplingParams]) -> None:
    """apply_penalties for several rows at once, in place, from their PenaltyStates (the same arithmetic, so the
    same logits)."""
    dev = logits.device
    index = torch.tensor(rows, dtype=torch.long, device=dev)
    x = logits.index_select(0, index)
    seen = torch.stack([s.seen for s in states])
    counts = torch.stack([s.counts for s in states]).to(x.dtype)
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
    penalised = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(seen & (rep != 1.0), penalised, x)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype, device=dev)[:, None]
    x = x - (freq * counts + pres * (counts > 0).to(x.dtype))
    logits.index_copy_(0, index, x)


class Sampler:
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               positions: list[int], raw_logits: torch.Tensor | None = None
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [N, V] float32, one row per sampling request, after penalties; raw_logits: the model's own,
        for logprobs (default: logits). positions: index the new token will have.

        Everything runs on the logits' device and comes back in one transfer (one sync on a GPU): greedy argmaxes,
        the batched draw's first round, the chosen tokens' logprobs and the top-n. Only the uniforms are drawn on
        the host (SplitMix64 of seed and position, so that replays reproduce them) and sent as one tensor. A row
        whose draw lands past the first candidates (flat distributions; rare on a trained model) costs a second
        round (redraw) and its logprob a second read."""
        R = len(params)
        dev = logits.device
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(greedy_rows) == R:
            tokens_dev = logits.argmax(dim=-1)
        else:
            tokens_dev = torch.zeros(R, dtype=torch.long, device=dev)
            if greedy_rows:
                tokens_dev[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
        parts = [tokens_dev]
        us = [uniform_draw(seeds[i], positions[i]) for i in sampled]
        if sampled:  # one batched draw (sample_rows' first round), not a full sort per row
            drawn, again = draw_rows(logits[sampled], [params[i] for i in sampled], us)
            tokens_dev[sampled] = drawn
            parts.append(again)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        top_n = max((params[i].logprobs for i in want), default=0)
        if want:
            lp = torch.log_softmax((logits if raw_logits is None else raw_logits)[want], dim=-1)
            parts.append(lp.gather(1, tokens_dev[want][:, None]).squeeze(1))
            if top_n:
                top_v, top_i = torch.topk(lp, top_n, dim=-1)
                parts += [top_i.flatten(), top_v.flatten()]
        # one transfer: token ids (< 2^53), flags and float32 logprobs are all exact in float64
        host = torch.cat([x.to(torch.float64) for x in parts]).tolist()
        tokens = [int(x) for x in host[:R]]
        at = R
        if sampled:
            again = [bool(x) for x in host[at:at + len(sampled)]]
            at += len(sampled)
            if any(again):
                sub = redraw(logits[sampled], [params[i] for i in sampled], us, SAMPLE_TOP_FIRST,
                             [tokens[i] for i in sampled], again)
                for i, token in zip(sampled, sub):
                    tokens[i] = token
        logprobs: list[TokenLogprob | None] = [None] * R
        if want:
            chosen = host[at:at + len(want)]
            at += len(want)
            top_i = host[at:at + len(want) * top_n]
            top_v = host[at + len(want) * top_n:at + 2 * len(want) * top_n]
            redrawn = set(i for i, a in zip(sampled, again) if a) if sampled else set()
            for row, i in enumerate(want):
                n = params[i].logprobs
                lo = row * top_n
                value = float(lp[row, tokens[i]]) if i in redrawn else chosen[row]
                logprobs[i] = TokenLogprob(tokens[i], value,
                                           [(int(t), v) for t, v in zip(top_i[lo:lo + n], top_v[lo:lo + n])])
        return tokens, logprobs

"""Speculative decoding by prompt lookup (n-gram drafts), verified exactly.

The proposer looks for the most recent earlier occurrence of the sequence's last n tokens (n from ngram_max down to
ngram_min, the longest match wins) in its own tokens, prompt and output so far, and proposes the (up to) num_draft
tokens that followed it. No draft model, no extra weights: text that copies from its context (code edits, quoting,
summaries, structured output) is where it pays.

Proposal (NgramProposer.propose, the first stage of Engine.step) attaches each decoding sequence's drafts to it
before the scheduler runs; the scheduler gives them rows when the budget allows. Verification runs the pending token
and the drafts through the model in one forward pass, samples each position with the request's own sampler (greedy,
or the seeded draw of that position) and keeps drafts while they equal the sampled token (accept_drafts); the first
mismatch is replaced by the sampled token, and when every draft is kept the last row gives one more token. Because
sampling is a pure function of (logits, seed, position), the accepted tokens are
exactly the ones plain decoding would have produced: greedy and seeded outputs are unchanged (up to floating-point
near-ties, the exactness rule), only faster when drafts are accepted and a little slower when they are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, MAX_NUM_DRAFT, SPECULATIVE_METHODS, EngineConfig

if TYPE_CHECKING:
    from .request import Request


def check_speculative(config: EngineConfig) -> None:
    """ValueError for speculative settings that can't run (before anything loads)."""
    if config.speculative is None:
        return
    if config.speculative not in SPECULATIVE_METHODS:
        raise ValueError(f"unknown speculative method {config.speculative!r} (choose {', '.join(SPECULATIVE_METHODS)})")
    if not 1 <= config.num_draft <= MAX_NUM_DRAFT:
        raise ValueError(f"num_draft must be in [1, {MAX_NUM_DRAFT}], got {config.num_draft}")
    if not 1 <= config.ngram_min <= config.ngram_max:
        raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {config.ngram_min} and {config.ngram_max}")
    if config.speculative_max_batch < 1:
        raise ValueError(f"speculative_max_batch must be at least 1, got {config.speculative_max_batch}")


@dataclass
class NgramIndex:
    """Positions of every token of one sequence, grown incrementally (the sequence only ever grows)."""
    positions: dict[int, list[int]] = field(default_factory=dict)
    indexed: int = 0  # tokens [0, indexed) are in positions

    def update(self, token_ids: list[int]) -> None:
        if len(token_ids) < self.indexed:  # the sequence was replaced: start again
            self.positions.clear()
            self.indexed = 0
        for i in range(self.indexed, len(token_ids)):
            self.positions.setdefault(token_ids[i], []).append(i)
        self.indexed = len(token_ids)


def propose_ngram(token_ids: list[int], index: NgramIndex, num_draft: int, ngram_min: int = DEFAULT_NGRAM_MIN,
                  ngram_max: int = DEFAULT_NGRAM_MAX) -> list[int]:
    """Up to num_draft tokens that followed an earlier occurrence of the longest suffix of token_ids of length in
    [ngram_min, ngram_max]: among the occurrences of that length the most recent one followed by num_draft tokens
    (in a run of one repeated token the latest occurrence is followed by one token only), else the one followed by
    the most. [] when there is none."""
    n_tokens = len(token_ids)
    if num_draft < 1 or n_tokens < ngram_min + 1:
        return []
    index.update(token_ids)
    last = token_ids[-1]
    best_end, best_n = -1, 0
    for end in reversed(index.positions.get(last, ())):  # earlier positions of the last token, most recent first
        if end >= n_tokens - 1:
            continue  # the last position itself
        # length of the common suffix of token_ids[:end + 1] and token_ids, at most ngram_max
        n = 1
        while n < ngram_max and end - n >= 0 and token_ids[end - n] == token_ids[n_tokens - 1 - n]:
            n += 1
        # an older occurrence is followed by more tokens: it wins a tie while the best one is short of num_draft
        if n > best_n or (n == best_n and n_tokens - 1 - best_end < num_draft):
            best_end, best_n = end, n
        if best_n == ngram_max and n_tokens - 1 - best_end >= num_draft:
            break
    if best_n < ngram_min:
        return []
    return token_ids[best_end + 1:best_end + 1 + num_draft]


class NgramProposer:
    """The step's propose stage: prompt-lookup drafts for the running sequences about to decode."""

    def __init__(self, config: EngineConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, running: list[Request]) -> None:
        """Sets draft_token_ids of every running sequence about to decode. None for a request whose logits are
        changed by what it generated (penalties, min_tokens still blocking EOS: its draft rows would need the drafts
        as outputs), nor in a step with more decoding sequences than speculative_max_batch."""
        cfg = self.config
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        if len(decoding) > cfg.speculative_max_batch:
            for r in decoding:
                r.draft_token_ids = []
            return
        for r in decoding:
            room = min(cfg.num_draft, r.params.max_tokens - r.num_output_tokens - 1,
                       self.max_model_len - r.num_tokens - 1)
            if room < 1 or r.params.has_penalties or r.num_output_tokens < r.params.min_tokens:
                r.draft_token_ids = []
                continue
            if r.spec_state is None:
                r.spec_state = NgramIndex()
            r.draft_token_ids = propose_ngram(r.token_ids, r.spec_state, room, cfg.ngram_min, cfg.ngram_max)


def accept_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a request keeps of its sampled rows (one per draft verified, and one more): row j's token is kept
    when every draft before it was right (equal to the token sampled at its position), so the kept tokens are the
    drafts up to the first one that differs from its sampled token, then that sampled token (all of them, and the
    last row's token, when every draft was right)."""
    if not drafts:  # the common case: one row, its token
        return sampled[:1]
    kept = []
    for j, token in enumerate(sampled):
        kept.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return kept

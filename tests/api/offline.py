"""The offline engine as the reference for what a server returns, compared by the exactness rule of
DEVELOPERS.md: tokens must be equal; a divergence is accepted only at a position where the offline run's top-2 logit
gap is below max(1e-3, 10x the largest logprob difference seen between the two runs on the matched positions)."""

from __future__ import annotations

import torch

from inferd.engine import SamplingParams


def offline_greedy(engine, prompt: list[int], max_tokens: int, **params) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the raw logits of every position, from the offline engine (alone in its batch)."""
    [req] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))
    return req.output_token_ids, req.debug_logits


def token_ids(logprob_tokens: list[str]) -> list[int]:
    """Token ids from logprob entries of a request made with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in logprob_tokens]


def assert_same_greedy(served: list[int], served_logprobs: list[float], offline: list[int],
                       offline_logits: list[torch.Tensor], label: str = "", prefix: bool = False) -> int:
    """The number of positions compared exactly (all of them unless a near-tie let the runs part). prefix: served
    may be shorter than offline (a stop ended it)."""
    if prefix:
        assert len(served) <= len(offline), f"{label}: served {len(served)} tokens, offline {len(offline)}"
    else:
        assert len(served) == len(offline), f"{label}: served {len(served)} tokens, offline {len(offline)}"
    max_diff = 0.0
    for i, (a, b) in enumerate(zip(served, offline)):
        row = offline_logits[i].float()
        if a != b:
            top2 = torch.topk(row, 2).values
            gap = float(top2[0] - top2[1])
            allowed = max(1e-3, 10 * max_diff)
            assert gap < allowed, (f"{label}: token {i} is {a}, offline {b}; offline top-2 gap {gap:.3g} is no "
                                   f"near-tie (allowed {allowed:.3g})")
            return i
        offline_logprob = float(torch.log_softmax(row, dim=-1)[b])
        max_diff = max(max_diff, abs(served_logprobs[i] - offline_logprob))
    return len(served)

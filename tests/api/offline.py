"""The offline engine as the reference for what a server returns, compared by the exactness rule (tests/parity.py):
the served logprob of every compared token is within the float32 bound of the offline run's, and a divergence is
accepted only where the offline run's top-2 logit gap is below that bound."""

from __future__ import annotations

import torch

from inferd.engine import SamplingParams
from parity import greedy_divergence, scale_of, top2_gap


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
    def logprob_diff(i: int) -> float:
        offline_logprob = float(torch.log_softmax(offline_logits[i].float(), dim=-1)[offline[i]])
        return abs(served_logprobs[i] - offline_logprob)

    # the scale: the offline logits' (a logprob is a logit less the row's logsumexp: rounded at that scale)
    return greedy_divergence(served, offline, lambda i: top2_gap(offline_logits[i]), logprob_diff, label,
                             scale_at=lambda i: scale_of(offline_logits[i]))

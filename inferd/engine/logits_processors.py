"""The processors a step applies to its logits rows before the draw, besides the grammar masks (grammars.py):
logit_bias first, then penalties and min_tokens. Each row belongs to one request (a request verifying k drafts has
k + 1 rows, in order)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .request import Request
from .sampler import PenaltyState, apply_penalties_batch


@torch.inference_mode()
def apply_logit_bias(logits: torch.Tensor, row_requests: list[Request]) -> None:
    """OpenAI's logit_bias, added in place (before the grammar masks, penalties, logprobs and the draw)."""
    bias_rows, bias_cols, bias_vals = [], [], []
    for row, req in enumerate(row_requests):
        for token, bias in req.params.logit_bias:
            bias_rows.append(row)
            bias_cols.append(token)
            bias_vals.append(float(bias))
    if bias_rows:
        dev = logits.device
        logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev)),
                          torch.tensor(bias_vals, dtype=logits.dtype, device=dev), accumulate=True)


@torch.inference_mode()
def apply_penalties_and_min_tokens(logits: torch.Tensor, reqs: list[Request], eos_token_ids: Iterable[int]
                                   ) -> torch.Tensor:
    """Penalties and min_tokens, in place on the rows that ask for them. Returns the raw logits (a copy when any row
    changed): logprobs and recorded logits are those of the model, as in vLLM."""
    # min_tokens does not apply to constrained rows: their grammar decides where the output may end
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties
            or (r.num_output_tokens < r.params.min_tokens and r.constraint is None)]
    if not rows:
        return logits
    raw = logits.clone()
    penalised = [i for i in rows if reqs[i].params.has_penalties]
    if penalised:  # batched, from each request's state on the device (brought up to date, not rebuilt)
        states = []
        for i in penalised:
            req = reqs[i]
            if req.penalty_state is None:
                req.penalty_state = PenaltyState(logits.shape[1], logits.device)
            req.penalty_state.update(req.token_ids, req.num_prompt_tokens)
            states.append(req.penalty_state)
        apply_penalties_batch(logits, penalised, states, [reqs[i].params for i in penalised])
    for i in rows:
        req = reqs[i]
        if req.num_output_tokens < req.params.min_tokens and req.constraint is None:
            blocked = list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else list(eos_token_ids))
            if blocked:
                logits[i, blocked] = float("-inf")
    return raw

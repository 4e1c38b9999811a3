"""What the engine hands out per step, without torch: the worker protocol (and so the API process) reads these."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token id, logprob), most likely first
    rank: int | None = None  # 1 + the tokens more likely than it (prompt logprobs give it)


@dataclass
class RequestOutput:
    """What one step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_text: str = ""  # only when the engine has a tokenizer
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's vector (inferd/engine/embedding.py)
    # every prompt position's logprob (the first None), in the request's first output when it asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None

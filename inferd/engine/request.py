"""Request and SamplingParams: what one generation asks for, and its state inside the engine."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from ..config import MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS
from .errors import InvalidRequestError
from .structured import check_spec

GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no top-k
    seed: int | None = None  # None: the engine draws one, so the request can still be replayed
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: the sampled token's and the top-n
    # None: none; n >= 0: every prompt position's logprob (the first has none) and its top-n, computed across chunked
    # prefill (inferd/engine/prompt_logprobs.py) and sent with the first output
    prompt_logprobs: int | None = None
    priority: int = 0  # lower value = more important (served first, preempted last)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF/vLLM: logits of tokens in prompt or output divided (>0) / multiplied (<0)
    min_tokens: int = 0  # EOS and stop token ids are blocked until this many tokens were generated
    cache_salt: str = ""  # the prefix cache's salt (the tenant's): prefixes are shared only under the same salt
    # a grammar the output must follow: (kind, text), kind in structured.KINDS (inferd/engine/structured.py)
    structured: tuple[str, str] | list | None = None
    # OpenAI's logit_bias as [token id, bias] pairs (JSON has no integer keys): added to the logits before the
    # grammar mask, penalties and sampling
    logit_bias: list = field(default_factory=list)
    # the LoRA adapter to run with, as the gateway checked it: [name, path, digest] (inferd/engine/lora.py); None:
    # the base model
    lora: list | None = None

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2.0 <= v <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 10):
            raise InvalidRequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.logit_bias, list) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(f"logit_bias must have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for entry in self.logit_bias:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], int)
                    and not isinstance(entry[0], bool) and isinstance(entry[1], (int, float))
                    and not isinstance(entry[1], bool) and -100 <= entry[1] <= 100):
                raise InvalidRequestError(f"logit_bias entries must be [token id, bias in [-100, 100]], got {entry!r}")
        if self.lora is not None and not (isinstance(self.lora, (list, tuple)) and len(self.lora) == 3 and all(
                isinstance(v, str) and 0 < len(v) <= 4096 for v in self.lora)):
            raise InvalidRequestError("lora must be [name, path, digest]")
        if self.structured is not None:
            if not (isinstance(self.structured, (list, tuple)) and len(self.structured) == 2):
                raise InvalidRequestError("structured must be [kind, text]")
            check_spec(self.structured[0], self.structured[1])

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflows float32: such a temperature means greedy (as in vLLM)
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def constrained(self) -> bool:
        return self.structured is not None

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int = 0  # order of arrival, for FCFS inside a priority
    # original prompt length: a replayed request (prompt + tokens generated before) still counts its outputs from
    # here, so max_tokens, usage and sampling positions are those of the original request
    num_prompt_tokens: int = -1
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)  # its block table (in KV cache group 0: kv_groups.py)
    window_block_ids: list[list[int]] = field(default_factory=list)  # its tables in groups 1.. (sliding windows)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of the full blocks of token_ids
    status: RequestStatus = RequestStatus.WAITING
    admitted_seq: int = -1  # order of admission into running (preemption picks the latest first)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    debug_logits: list | None = None  # every sampled row's logits, when the engine records them
    # speculative decoding: the tokens proposed to follow token_ids, verified by the next step (never part of
    # token_ids until accepted), and the proposer's state (inferd/engine/speculative.py)
    draft_token_ids: list[int] = field(default_factory=list)
    spec_state: object | None = None
    penalty_state: object | None = None  # sampler.PenaltyState, for requests with penalties
    constraint: object | None = None  # structured.Constraint once its grammar is compiled (constrained requests)
    # while the request awaits its grammar: the compile in flight (a Future), then for a replay its earlier tokens
    # going through its new matcher (the Future of a grammar_budget.Job)
    grammar_future: object | None = None
    grammar_seconds: float = 0.0  # its grammar's work so far (fills, accepts), against its budget (grammar_budget.py)
    lora_slot: int = -1  # the model's slot of its LoRA adapter while it runs (engine/lora.py)
    # prompt logprobs (params.prompt_logprobs): entry p is position p's (None for the first), collected as prefill
    # chunks run, until they leave with the first output (prompt_logprobs_sent)
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to be computed or sent: its prompt runs whole (no prefix-cache hit)."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


def validate_request(prompt_token_ids: list[int], params: SamplingParams, num_prompt_tokens: int | None,
                     vocab_size: int, max_model_len: int) -> int:
    """The checks every engine makes before it takes a request (InvalidRequestError); returns the tokens it may
    reach (original prompt + max_tokens)."""
    params.validate()
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty")
    # min_tokens indexes the logits with the stop ids: one out of range would fail the whole step
    for name, ids in (("prompt", prompt_token_ids), ("stop", params.stop_token_ids),
                      ("logit_bias", [e[0] for e in params.logit_bias])):
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise InvalidRequestError(f"{name} token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    orig = len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
    if not 0 < orig <= len(prompt_token_ids):
        raise InvalidRequestError(f"num_prompt_tokens={orig} must be in [1, {len(prompt_token_ids)}]")
    if len(prompt_token_ids) - orig >= params.max_tokens:
        raise InvalidRequestError("a replayed request already has max_tokens output tokens")
    total = orig + params.max_tokens
    if orig >= max_model_len or total > max_model_len:
        raise InvalidRequestError(
            f"this model's context window is {max_model_len} tokens; the request needs {total} "
            f"({orig} in the prompt, {params.max_tokens} in the completion)")
    return total

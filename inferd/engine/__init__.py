"""The continuous-batching engine: imports nothing but torch, numpy and the tokenizer/loader libraries."""

from .async_engine import AsyncEngine
from .engine import Engine, RequestOutput
from .kv_cache import KVCacheManager, hash_block_tokens, hash_prompt_blocks
from .request import FinishReason, InvalidRequestError, Request, RequestStatus, SamplingParams
from .sampler import Sampler, TokenLogprob, uniform_draw
from .scheduler import Scheduler, SchedulerOutput

__all__ = [
    "AsyncEngine", "Engine", "FinishReason", "InvalidRequestError", "KVCacheManager", "Request", "RequestOutput",
    "RequestStatus", "Sampler", "SamplingParams", "Scheduler", "SchedulerOutput", "TokenLogprob",
    "hash_block_tokens", "hash_prompt_blocks", "uniform_draw",
]

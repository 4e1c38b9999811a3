"""The continuous-batching engine: imports nothing but torch, numpy and the tokenizer/loader libraries.

The names below load on first use (PEP 562): the API process imports `inferd.engine.request` (SamplingParams, for
the worker protocol) and must not pay for torch, which importing the engine itself would load (1.3 s of every
server start)."""

import importlib

_WHERE = {
    "AsyncEngine": ".async_engine", "Engine": ".engine", "RequestOutput": ".engine", "KVCacheManager": ".kv_cache",
    "hash_block_tokens": ".kv_cache", "hash_prompt_blocks": ".kv_cache", "FinishReason": ".request",
    "InvalidRequestError": ".errors", "Request": ".request", "RequestStatus": ".request",
    "SamplingParams": ".request", "Sampler": ".sampler", "TokenLogprob": ".sampler", "uniform_draw": ".sampler",
    "Scheduler": ".scheduler", "SchedulerOutput": ".scheduler",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value

"""Tokenizing off the event loop: one small pool of threads for the API process's long inputs (prompts, chat
messages, embedding inputs), so that an 8 MiB input never stalls every stream, and so that together they take at
most TOKENIZE_THREADS threads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..config import TOKENIZE_THREADS

_pool: ThreadPoolExecutor | None = None


async def off_the_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on the tokenizing threads (made at the first call)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="inferd-tokenize")
    return await asyncio.get_running_loop().run_in_executor(_pool, fn, *args)

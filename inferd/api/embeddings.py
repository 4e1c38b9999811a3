"""/v1/embeddings: OpenAI's shapes over embedding workers (`inferd worker --task embed`), behind their own router
and waiting line but the same tenants and quotas (the inputs' tokens count as prompt tokens)."""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..config import (EMBED_MAX_CHARS_PER_TOKEN, MAX_EMBEDDING_INPUTS, MAX_IDENTIFIER_CHARS, MAX_REPLAYS_PER_REQUEST,
                      TOKENIZE_INLINE_MAX_CHARS)
from ..engine.request import SamplingParams
from ..worker.client import WorkerUnavailable
from .errors import APIError, invalid
from .tokenizing import off_the_loop

TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 31) - 1)]
Identifier = Annotated[StrictStr, Field(max_length=MAX_IDENTIFIER_CHARS)]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Identifier | None = None
    input: (StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                        Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: Identifier | None = None


class EmbeddingService:
    def __init__(self, router, gateway, encode, model_name: str, metrics=None):
        self.router = router
        self.gateway = gateway
        self.encode = encode  # text -> token ids: the embedding model's own tokenizer (models/embedding_models.py)
        self.model_name = model_name
        self.num_requests = 0
        self.metrics = metrics

    async def inputs(self, req: EmbeddingRequest) -> list[list[int]]:
        """The inputs as token ids, checked against the model. Texts too long to ever fit are refused before they
        are tokenized, and long ones are tokenized off the event loop (4 concurrent 8 MB requests stalled it ~4 s,
        long enough for the workers to be declared dead)."""
        hello = self.router.hello
        if hello is None:
            raise APIError(503, f"no embedding worker is available: {self.router.not_ready_reason}",
                           code="not_ready", headers={"Retry-After": "1"})
        raw = req.input
        if isinstance(raw, str):
            texts, ids = [raw], None
        elif isinstance(raw[0], str):
            texts, ids = raw, None
        elif isinstance(raw[0], int):
            texts, ids = None, [list(raw)]
        else:
            texts, ids = None, [list(x) for x in raw]
        if texts is not None:
            longest = hello.max_model_len * EMBED_MAX_CHARS_PER_TOKEN
            for i, text in enumerate(texts):
                if not text:
                    raise invalid("an input is empty", param="input")
                if len(text) > longest:
                    raise invalid(f"input {i} has {len(text)} characters, more than this model's maximum context "
                                  f"length of {hello.max_model_len} tokens can hold", param="input",
                                  code="context_length_exceeded")
            if sum(len(t) for t in texts) <= TOKENIZE_INLINE_MAX_CHARS:
                ids = [self.encode(t) for t in texts]
            else:
                ids = await off_the_loop(lambda: [self.encode(t) for t in texts])
        try:
            self._check_ids(ids, hello)
        except APIError:
            if self.metrics is not None:  # refused after the tokenizing: work spent, nothing served
                self.metrics.refused_after_tokenizing.labels("embeddings").inc()
            raise
        if req.dimensions is not None and req.dimensions != hello.embedding_dim:
            raise invalid(f"{self.model_name} does not support dimensions other than its own "
                          f"({hello.embedding_dim}); its vectors cannot be truncated", param="dimensions")
        return ids

    @staticmethod
    def _check_ids(ids: list[list[int]], hello) -> None:
        for i, x in enumerate(ids):
            if len(x) > hello.max_model_len:
                raise invalid(f"input {i} has {len(x)} tokens; this model's maximum context length is "
                              f"{hello.max_model_len} tokens", param="input", code="context_length_exceeded")
            bad = next((t for t in x if t >= hello.vocab_size), None)
            if bad is not None:
                raise invalid(f"input token id {bad} is outside the vocabulary [0, {hello.vocab_size})",
                              param="input")

    async def create(self, req: EmbeddingRequest, tenant, band: int, queue_timeout, cache_salt: str) -> dict:
        ids = await self.inputs(req)
        tokens = sum(len(x) for x in ids)
        ticket = await self.gateway.admit(tenant, band, tokens, tokens, queue_timeout, prompt=None,
                                          num_seqs=len(ids), cache_salt=cache_salt)
        used = 0
        try:
            worker = ticket.worker or await ticket.wait()
            base = "emb-" + uuid.uuid4().hex

            async def one(i: int, x: list[int]) -> list[float]:
                """An input's vector; an input whose worker is lost (died, hung, drained) runs again on the
                worker the gateway rebinds the request to (an embedding has no state to carry over)."""
                nonlocal used
                bound = worker
                for attempt in range(MAX_REPLAYS_PER_REQUEST + 1):
                    request_id = f"{base}-{i}" + (f".r{attempt}" if attempt else "")
                    stream = self.router.generate(request_id, x, SamplingParams(max_tokens=1, temperature=0.0,
                                                                               cache_salt=cache_salt), bound)
                    try:
                        async for out in stream:
                            if out.finished:
                                if out.embedding is None:
                                    raise APIError(500, "the embedding worker answered without a vector",
                                                   code="engine_error")
                                used += len(x)
                                ticket.on_output(1)
                                return out.embedding
                    except WorkerUnavailable as e:
                        if attempt == MAX_REPLAYS_PER_REQUEST:
                            raise
                        bound = await ticket.rebind(bound, e, started=False)
                        continue
                    finally:
                        await stream.aclose()
                    break
                raise APIError(503, "the embedding worker ended the request", code="worker_lost",
                               headers={"Retry-After": "1"})

            vectors = await asyncio.gather(*(one(i, x) for i, x in enumerate(ids)))
        finally:
            ticket.finish(used)
        self.num_requests += 1
        data = []
        for i, vec in enumerate(vectors):
            if req.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            else:
                value = vec
            data.append({"object": "embedding", "index": i, "embedding": value})
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

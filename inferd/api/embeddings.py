"""/v1/embeddings' models: OpenAI's shapes over embedding workers (`inferd worker --task embed`), behind their own
router and queue but the same tenants and quotas (the inputs' tokens count as prompt tokens)."""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..config import EMBED_MAX_CHARS_PER_TOKEN, MAX_EMBEDDING_INPUTS, MAX_IDENTIFIER_CHARS, TOKENIZE_INLINE_MAX_CHARS
from .errors import INVALID_REQUEST, APIError, invalid
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


class EmbeddingModel:
    """An embedding model served beside the generation model: its workers' router and gateway, its tokenizer, and
    OpenAI's shapes of its requests (inputs in, vectors out). Running a request is the generation service's
    (inferd/api/generation.py `GenerationService.embed`)."""

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

    def response(self, req: EmbeddingRequest, vectors: list[list[float]], tokens: int) -> dict:
        """OpenAI's embedding response: the vectors in order (base64: little-endian float32), the tokens used."""
        data = []
        for i, vec in enumerate(vectors):
            if req.encoding_format == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            else:
                value = vec
            data.append({"object": "embedding", "index": i, "embedding": value})
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def embedding_model(state, model: str | None) -> EmbeddingModel:
    """The EmbeddingModel `model` names (None: the first one served); else the 4xx that says why not."""
    models = state.embeddings
    if model is None and models:
        return next(iter(models.values()))
    if model in models:
        return models[model]
    names = ", ".join(f"`{name}`" for name in models)
    if model == state.model_name:
        raise invalid(f"`{model}` is a generation model; /v1/embeddings needs an embedding model"
                      + (f" ({names})" if names else ""), param="model", code="wrong_model_kind")
    raise APIError(404, f"The model `{model}` does not exist (embedding models here: {names})" if models else
                   "this server serves no embedding model (start it with --embedding-model)",
                   INVALID_REQUEST, param="model", code="model_not_found")

"""/v1/completions and /v1/chat/completions: the request prepared (validated and tokenized: inferd/api/serving.py),
then admitted and delivered as JSON or a stream (inferd/api/delivery.py over the generation service)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..delivery import respond
from ..middleware.auth import TENANT
from ..middleware.request_context import RECEIVED_AT
from ..schemas import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse
from . import documented_errors

router = APIRouter()

# One server-sent event, documented the way FastAPI documents its own event streams (OpenAPI 3.2's `itemSchema`: the
# schema of each event, not of the whole body): `data` is a JSON chunk, an in-band {"error": ...} or "[DONE]".
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer", "minimum": 0}}}


def _generation_responses(model) -> dict:
    return {200: {"model": model, "description": "The response, or with stream=true a text/event-stream of chunks",
                  "content": {"text/event-stream": {"itemSchema": _SSE_EVENT}}},
            **documented_errors(400, 401, 404, 413, 429, 503)}  # 429: the tenant's limits, its queue share


@router.post("/v1/completions", response_model=None, responses=_generation_responses(CompletionResponse))
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _generate(body, request)


@router.post("/v1/chat/completions", response_model=None, responses=_generation_responses(ChatCompletionResponse))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _generate(body, request)


async def _generate(body, request: Request) -> Response:
    serving = request.app.state.inferd.require_serving()
    tenant = request.scope[TENANT]
    prep = await serving.prepare(body, request.scope[RECEIVED_AT], tenant.allow_grammar, tenant)
    return await respond(request, prep, tenant)

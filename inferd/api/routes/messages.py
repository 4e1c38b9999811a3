"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what coding agents call), translated into a
chat request (inferd/api/anthropic_messages.py) and served through the same preparation, admission, quotas, tiers,
failover and cancel-on-disconnect as /v1/chat/completions (inferd/api/delivery.py), written in Anthropic's shape.
Errors on these paths are in Anthropic's shape too (inferd/api/anthropic_errors.py, through errors.response_for)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ...gateway.admission import RateLimited
from ...gateway.limits import LimiterUnavailable
from ..anthropic_messages import complete, error_event, error_response, stream, to_chat_request
from ..anthropic_schemas import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from ..delivery import Shape, respond
from ..middleware.auth import TENANT
from ..middleware.request_context import RECEIVED_AT
from ..refusals import worker_error

router = APIRouter()

MESSAGES = Shape(complete, stream, lambda e: [error_event(e)], error_response)

# one server-sent event: `event` names its type, `data` is its JSON payload (which names it again)
_SSE_EVENT = {"type": "object", "required": ["event", "data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def _errors(*codes: int) -> dict:
    return {code: {"model": AnthropicErrorResponse} for code in codes}


@router.post("/v1/messages", response_model=None, responses={
    200: {"model": MessageResponse, "description": "The Message, or with stream=true a text/event-stream of events",
          "content": {"text/event-stream": {"itemSchema": _SSE_EVENT}}},
    **_errors(400, 401, 404, 413, 429, 503)})
async def messages(body: MessagesRequest, request: Request) -> Response:
    serving = request.app.state.inferd.require_serving()
    tenant = request.scope[TENANT]
    prep = await serving.prepare(to_chat_request(body), request.scope[RECEIVED_AT], tenant.allow_grammar, tenant)
    return await respond(request, prep, tenant, MESSAGES)


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse,
             responses=_errors(400, 401, 404, 413, 429, 503))
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    """The prompt's tokens as /v1/messages would count them (its chat template, tools included), without
    generating: prepared (and so checked) like a request for one token."""
    state = request.app.state.inferd
    serving = state.require_serving()
    tenant = request.scope[TENANT]
    try:  # it costs the server work: it counts against the tenant's request rate (as /tokenize does)
        await state.gateway.charge_request(tenant)
    except (RateLimited, LimiterUnavailable) as e:  # 429, 503
        raise worker_error(e) from None
    chat = to_chat_request(body).model_copy(update={"max_tokens": 1})
    prep = await serving.prepare(chat, request.scope[RECEIVED_AT], tenant.allow_grammar, tenant)
    return {"input_tokens": prep.prompt_tokens}

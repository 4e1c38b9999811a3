"""/v1/responses (OpenAI's Responses API): the request translated into a chat completion request
(inferd/api/responses_api.py), prepared and delivered as chat completions are (admission, quotas, tiers, failover,
cancellation on disconnect: inferd/api/delivery.py), and written as a Response object or its event stream. Nothing is
stored: GET and DELETE /v1/responses/{id} are a 404 that says so."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..delivery import Shape, respond
from ..errors import APIError
from ..middleware.auth import TENANT
from ..middleware.request_context import RECEIVED_AT
from ..responses_api import ResponseHead, complete, response_head, responses_param, to_chat_request
from ..responses_schema import ResponsesRequest
from ..responses_stream import EventWriter
from . import documented_errors

router = APIRouter()

# one server-sent event of the stream (OpenAPI 3.2's `itemSchema`): `event` is the type, `data` the JSON event
_SSE_EVENT = {"type": "object", "required": ["event", "data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


def response_shape(head: ResponseHead) -> Shape:
    """The delivery Shape of one Responses request (its id and settings are in every body and event)."""
    writer = EventWriter(head)
    return Shape(lambda generation: complete(head, generation), writer.stream, writer.failed_before_start,
                 lambda e: e.response())


@router.post("/v1/responses", response_model=None,
             responses={200: {"description": "The Response object, or with stream=true a text/event-stream of "
                                             "Responses events (`event: TYPE`, `data: JSON`)",
                              "content": {"text/event-stream": {"itemSchema": _SSE_EVENT}}},
                        **documented_errors(400, 401, 404, 413, 429, 503)})
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    serving = request.app.state.inferd.require_serving()
    tenant = request.scope[TENANT]
    try:
        chat = to_chat_request(body)
        prep = await serving.prepare(chat, request.scope[RECEIVED_AT], tenant.allow_grammar, tenant)
    except APIError as e:  # serving speaks chat: name the parameter as this request does
        e.param = responses_param(e.param)
        raise
    return await respond(request, prep, tenant, response_shape(response_head(body, prep)))


@router.get("/v1/responses/{response_id}", response_model=None, responses=documented_errors(404))
@router.delete("/v1/responses/{response_id}", response_model=None, responses=documented_errors(404))
async def stored_response(response_id: str) -> Response:
    raise APIError(404, f"No response with id '{response_id[:64]}' found: inferd stores no responses (every response "
                   "says \"store\": false)", param="response_id", code="response_not_found")

"""/v1/embeddings: the model looked up, then the request run by the generation service (admitted in that model's
own gateway, released on every way out); a client that disconnects cancels it."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from ..delivery import ClientGone, until_disconnect
from ..embeddings import EmbeddingRequest, embedding_model
from ..middleware.auth import TENANT
from ..refusals import worker_error
from ..request_tier import requested_tier_rank, requested_timeout
from . import documented_errors

router = APIRouter()


@router.post("/v1/embeddings", response_model=None, responses=documented_errors(400, 401, 404, 413, 429, 503))
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = request.app.state.inferd
    model = embedding_model(state, body.model)
    tenant = request.scope[TENANT]
    tier_rank = requested_tier_rank(request, tenant)
    try:
        # a client that disconnects cancels the request: its inputs are aborted in the worker, its slot freed
        out = await until_disconnect(request.receive, state.generation.embed(
            model, body, tenant, tier_rank, requested_timeout(request, tier_rank)))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    except Exception as e:  # an APIError as it is; the gateway's refusals and worker failures as the client sees them
        raise worker_error(e) from None
    state.metrics.embedding_requests.inc()
    state.metrics.embedding_inputs.inc(len(out["data"]))
    return JSONResponse(out)  # straight to JSON: FastAPI's encoder walks every float of every vector

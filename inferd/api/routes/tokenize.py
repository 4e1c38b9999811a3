"""/tokenize and /detokenize: the generation model's tokenizer (and chat template) as a service."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ...gateway.admission import RateLimited
from ...gateway.limits import LimiterUnavailable
from ..errors import invalid
from ..middleware.auth import TENANT
from ..refusals import worker_error
from ..schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from . import documented_errors

router = APIRouter()


# 429: a tokenization counts against the tenant's request rate (charge_request); /detokenize charges nothing
@router.post("/tokenize", response_model=TokenizeResponse,
             responses=documented_errors(400, 401, 404, 413, 429, 503))
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = request.app.state.inferd
    serving = state.require_serving()
    serving.check_model(body.model)
    try:  # it costs the server work: it counts against the tenant's request rate
        await state.gateway.charge_request(request.scope[TENANT])
    except (RateLimited, LimiterUnavailable) as e:  # 429, 503
        raise worker_error(e) from None
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give either prompt or messages", param="prompt")
    if body.prompt is not None:
        tokens = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        tokens = serving.chat_prompt(body.messages, body.add_generation_prompt is not False)
    hello = state.router.hello
    return {"tokens": tokens, "count": len(tokens), "max_model_len": hello.max_model_len if hello else 0}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=documented_errors(400, 401, 404, 413, 503))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    serving = request.app.state.inferd.require_serving()
    serving.check_model(body.model)
    vocab = serving.tokenizer.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}

"""/v1/models: the generation model and the embedding models served beside it, with their versions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..errors import INVALID_REQUEST, APIError
from ..middleware.auth import TENANT
from ..schemas import ModelCard, ModelList
from . import documented_errors

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=documented_errors(401))
async def models(request: Request) -> dict:
    state = request.app.state.inferd
    return {"object": "list", "data": [_model_card(state)] + _adapter_cards(state, request) + _embedding_cards(state)}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=documented_errors(401, 404))
async def model(model_id: str, request: Request) -> dict:
    state = request.app.state.inferd
    card = next((c for c in _embedding_cards(state) + _adapter_cards(state, request) if c["id"] == model_id), None)
    if card is not None:
        return card
    if model_id != state.model_name:
        raise APIError(404, f"The model `{model_id}` does not exist", INVALID_REQUEST, param="model",
                       code="model_not_found")
    return _model_card(state)


def _adapter_cards(state, request: Request) -> list[dict]:
    """The LoRA adapters the caller's tenant may use (another tenant's do not exist for it), each with its base."""
    if state.lora is None:
        return []
    tenant = request.scope.get(TENANT)
    hello = state.router.hello
    return [{"id": a.name, "object": "model", "created": a.created, "owned_by": "inferd", "parent": state.model_name,
             "root": a.spec.path, "max_model_len": hello.max_model_len if hello else None}
            for a in state.lora.adapters() if tenant is None or tenant.may_use_adapter(a.name)]


def _embedding_cards(state) -> list[dict]:
    cards = []
    for model in state.embeddings.values():
        hello = model.router.hello
        cards.append({"id": model.model_name, "object": "model", "created": state.started, "owned_by": "inferd",
                      "max_model_len": hello.max_model_len if hello else None, "versions": model.router.versions()})
    return cards


def _model_card(state) -> dict:
    hello = state.router.hello
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "inferd",
            "max_model_len": hello.max_model_len if hello else None, "versions": state.router.versions()}

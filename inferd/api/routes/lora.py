"""LoRA adapters at run time, at vLLM's paths and in its shapes (admin key only: api/middleware/auth.py):
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`. A bad
adapter is a 400 whose `code` names the reason (models/lora_format.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from ...models.lora_format import AdapterError
from ..errors import INVALID_REQUEST, APIError

router = APIRouter()


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=128)
    lora_path: str = Field(max_length=4096)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=128)
    lora_int_id: int | None = None  # vLLM's clients may send it; the name is what counts here


def _catalog(request: Request):
    catalog = request.app.state.inferd.lora
    if catalog is None:
        raise APIError(400, "this server serves no LoRA adapters (start it with --enable-lora)", INVALID_REQUEST,
                       code="lora_disabled")
    return catalog


@router.post("/v1/load_lora_adapter", include_in_schema=False)
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
    catalog = _catalog(request)
    try:
        adapter = await catalog.load(body.lora_name, body.lora_path)
    except AdapterError as e:
        raise APIError(400, str(e), INVALID_REQUEST, param="lora_path" if "path" in e.code else None,
                       code=e.code) from None
    metrics = request.app.state.inferd.metrics
    metrics.lora_loaded.set(len(catalog.adapters()))
    return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")


@router.post("/v1/unload_lora_adapter", include_in_schema=False)
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
    catalog = _catalog(request)
    if not catalog.unload(body.lora_name):
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", INVALID_REQUEST,
                       param="lora_name", code="adapter_not_found")
    request.app.state.inferd.metrics.lora_loaded.set(len(catalog.adapters()))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

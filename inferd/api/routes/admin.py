"""The admin API (/admin/..., its own key: inferd/api/middleware/auth.py): the workers and their state, and model
rollouts (start, promote, abort; local workers only). Not in the OpenAPI document."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from ..errors import INVALID_REQUEST, APIError

router = APIRouter()


class RolloutStartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    version: str
    path: str
    canary: float | None = None  # percent of new requests


@router.get("/admin/workers", include_in_schema=False)
async def admin_workers(request: Request) -> dict:
    state = request.app.state.inferd
    return {"workers": [_worker_card(w) for w in state.router.workers],
            "affinity": {"hits": state.router.affinity_hits, "queries": state.router.affinity_queries},
            "embedding_workers": {name: [_worker_card(w) for w in model.router.workers]
                                  for name, model in state.embeddings.items()}}


@router.get("/admin/rollout", include_in_schema=False)
async def rollout_status(request: Request) -> dict:
    return _rollout(request).describe()


@router.post("/admin/rollout/start", include_in_schema=False)
async def rollout_start(body: RolloutStartRequest, request: Request) -> dict:
    return await _rollout_call(_rollout(request).start(body.model, body.version, body.path, body.canary))


@router.post("/admin/rollout/promote", include_in_schema=False)
async def rollout_promote(request: Request) -> dict:
    return await _rollout_call(_rollout(request).promote())


@router.post("/admin/rollout/abort", include_in_schema=False)
async def rollout_abort(request: Request) -> dict:
    return await _rollout_call(_rollout(request).abort())


def _rollout(request: Request):
    rollout = request.app.state.inferd.rollout
    if rollout is None:
        raise APIError(409, "rollouts need local workers (inferd serve); this server has none", code="no_rollouts")
    return rollout


async def _rollout_call(coro) -> dict:
    from ...cluster.rollout import RolloutError

    try:
        return await coro
    except RolloutError as e:
        raise APIError(e.status, str(e), INVALID_REQUEST, code="rollout_conflict" if e.status == 409 else None) \
            from None


def _worker_card(w) -> dict:
    hello, stats = w.hello, w.latest_stats
    return {"worker_id": hello.worker_id if hello else None, "version": hello.version if hello else None,
            "pid": hello.pid if hello else None, "address": f"{w.address[0]}:{w.address[1]}" if w.address else None,
            "usable": w.usable, "draining": w.draining, "unresponsive": w.unresponsive,
            "dead": str(w.dead) if w.dead else None, "streams": w.num_streams,
            "running": stats.running if stats else None,
            "prefix_cache_hits": stats.prefix_cache_hits if stats else None,
            "prefix_cache_queries": stats.prefix_cache_queries if stats else None,
            "stale_outputs": w.num_stale_outputs, "given_up": w.num_given_up}

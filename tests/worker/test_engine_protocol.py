"""The engines a worker drives (the model's, the embedding one, the echo one) implement EngineProtocol
(inferd/engine/protocol.py), the only interface the worker's loop and server use: every method it declares, with the
parameters it declares."""

from __future__ import annotations

import inspect

import pytest

from inferd.engine.embedding import EmbedEngine
from inferd.engine.engine import Engine
from inferd.engine.protocol import EngineProtocol
from inferd.worker.echo import EchoEngine


def declared_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(EngineProtocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def test_the_protocol_covers_what_the_worker_calls():
    assert {"add_request", "abort", "step", "has_unfinished_requests", "take_pending_outputs", "take_failed",
            "unfinished_request_ids", "num_waiting", "failed_step_request_ids", "on_schedule", "info", "snapshot",
            "close"} <= set(declared_methods())


@pytest.mark.parametrize("engine_class", [Engine, EmbedEngine, EchoEngine])
def test_every_engine_implements_the_protocol(engine_class):
    for name, declared in declared_methods().items():
        method = getattr(engine_class, name, None)
        assert inspect.isfunction(method), f"{engine_class.__name__} has no method {name}"
        assert list(inspect.signature(method).parameters) == list(declared.parameters), \
            f"{engine_class.__name__}.{name}{inspect.signature(method)} is not the protocol's {name}{declared}"

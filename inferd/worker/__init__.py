"""The worker process (one engine behind a TCP connection) and the gateway's client for it.

protocol.py: framing and message types; engine_loop.py: the step thread that owns the engine; server.py: the worker
process (listener, connections, heartbeats, signals); client.py: the asyncio client a gateway uses.
"""

from .client import RequestFailed, RequestRejected, WorkerClient, WorkerClientError, WorkerDead
from .protocol import PROTOCOL_VERSION, WorkerHello, WorkerOutput, WorkerStats

__all__ = [
    "PROTOCOL_VERSION", "RequestFailed", "RequestRejected", "WorkerClient", "WorkerClientError", "WorkerDead",
    "WorkerHello", "WorkerOutput", "WorkerStats",
]

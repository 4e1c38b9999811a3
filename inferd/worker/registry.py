"""Worker registration in Redis, for gateways that find their workers there (`inferd worker --register URL`,
`inferd gateway --redis URL`).

A registered worker keeps one key, `inferd:worker:<worker id>`, holding its address, model and version as JSON,
with a TTL of WORKER_REGISTRATION_TTL_S renewed every heartbeat interval from its own thread: a worker that dies
(or hangs) vanishes from the registry within the TTL; one that stops cleanly deletes its key at once. Gateways poll
the keys (`discover`) and connect to the workers they do not know yet.
"""

from __future__ import annotations

import json
import logging
import threading

from ..config import MAX_HELLO_STRING, WORKER_REGISTRATION_TTL_S
from .address import parse_address
from .protocol import WorkerHello

log = logging.getLogger("inferd.worker")

KEY_PREFIX = "inferd:worker:"


class Registration:
    def __init__(self, url: str, hello: WorkerHello, address: str, interval: float,
                 ttl: float = WORKER_REGISTRATION_TTL_S):
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=max(1.0, interval))
        self.key = KEY_PREFIX + hello.worker_id
        self.value = json.dumps({"address": address, "worker_id": hello.worker_id, "model": hello.model,
                                 "version": hello.version})
        self.interval = min(interval, ttl / 3)
        self.ttl_ms = int(ttl * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inferd-registration", daemon=True)

    def start(self) -> None:
        self.client.set(self.key, self.value, px=self.ttl_ms)  # fails loudly at start-up if Redis is unreachable
        log.info("registered as %s in Redis", self.key)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.client.delete(self.key)
        except Exception as e:  # the TTL removes it anyway
            log.warning("could not remove %s from Redis: %s", self.key, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.client.set(self.key, self.value, px=self.ttl_ms)
            except Exception as e:  # Redis briefly away: keep trying; gateways keep the connection they have
                log.warning("registration renewal failed: %s", e)


async def discover(client) -> dict[str, dict]:
    """The registered workers (an async redis client): worker id -> {address, worker_id, model, version}. An entry
    that is not what a worker writes (not JSON, fields missing or of the wrong type, an address that is not
    HOST:PORT, a key holding another Redis type) is skipped and logged: it never stops discovery."""
    found = {}
    async for key in client.scan_iter(match=KEY_PREFIX + "*", count=100):
        try:
            raw = await client.get(key)
        except Exception as e:  # noqa: BLE001 - e.g. WRONGTYPE: someone else's key under our prefix
            log.warning("ignoring the registration at %r: %s", key, e)
            continue
        if raw is None:
            continue
        problem, entry = _validate_entry(raw)
        if problem is not None:
            log.warning("ignoring a malformed registration at %r: %s", key, problem)
            continue
        found[entry["worker_id"]] = entry
    return found


def _validate_entry(raw) -> tuple[str | None, dict]:
    try:
        entry = json.loads(raw)
    except (ValueError, TypeError, UnicodeDecodeError):
        return "not JSON", {}
    if not isinstance(entry, dict):
        return "not a JSON object", {}
    for name in ("address", "worker_id"):
        value = entry.get(name)
        if not isinstance(value, str) or not value or len(value) > MAX_HELLO_STRING:
            return f"{name} must be a non-empty string", {}
    for name in ("model", "version"):
        if not isinstance(entry.get(name, ""), str):
            return f"{name} must be a string", {}
    try:
        parse_address(entry["address"])
    except ValueError as e:
        return str(e), {}
    return None, entry

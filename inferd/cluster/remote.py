"""Workers on other machines: `inferd gateway --worker HOST:PORT` (a fixed list) or `--redis URL` (workers that
registered themselves with `inferd worker --register URL`).

A RemoteWorker keeps one connection to its worker: it connects (retrying with back-off while the worker is not up,
refuses us, or announces another model than the one this gateway serves), attaches the client to the router, and
reconnects (backing off again) when the connection dies. Nobody here can kill a remote worker, so a silent one is
given up (its streams move) but its connection is kept: if it speaks again it takes work again and whatever it still
sends for the given-up streams is dropped by epoch (see WorkerClient). Registry entries announcing another model are
not even connected to, and neither are those whose address is outside --worker-allow (resolved once, off the event
loop; the worker is then reached at the address that was checked): whoever can write to Redis cannot point a gateway
at any host it likes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket

from ..config import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_WORKER_ALLOW,
    WORKER_DISCOVERY_POLL_S,
    WORKER_RECONNECT_BACKOFF_S,
    WORKER_STABLE_CONNECTION_S,
)
from ..gateway.router import Router
from ..worker.address import parse_address
from ..worker.client import WorkerClient, WorkerDead
from ..worker.registry import discover

log = logging.getLogger("inferd.cluster")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow(text: str) -> tuple[Network, ...]:
    """--worker-allow: comma-separated CIDRs or addresses (10.0.0.0/8,fd00::/8,192.0.2.7). ValueError otherwise."""
    networks = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
        except ValueError:
            raise ValueError(f"--worker-allow takes CIDRs or IP addresses, got {item!r}") from None
    if not networks:
        raise ValueError("--worker-allow is empty: give the networks the workers are in")
    return tuple(networks)


DEFAULT_ALLOW = parse_allow(",".join(DEFAULT_WORKER_ALLOW))


def allowed(address: str, networks: tuple[Network, ...]) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:10.1.2.3 is 10.1.2.3
    return any(ip.version == net.version and ip in net for net in networks)


async def resolve_allowed(host: str, networks: tuple[Network, ...]) -> tuple[str | None, str]:
    """(the IP to connect to, "") when every address host resolves to is in networks; (None, why) otherwise.
    OSError when it does not resolve (now: try again later)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    ips = list(dict.fromkeys(info[4][0] for info in infos))
    outside = [ip for ip in ips if not allowed(ip, networks)]
    if outside or not ips:
        return None, f"{', '.join(outside) or host} is outside --worker-allow"
    return ips[0], ""


class Backoff:
    """Pauses that double from first up to longest (WORKER_RECONNECT_BACKOFF_S); reset() starts over."""

    def __init__(self, first: float, longest: float):
        self.first, self.longest = first, longest
        self.current = first

    def next(self) -> float:
        """The pause to take now (the next one doubles, up to longest)."""
        pause = self.current
        self.current = min(self.current * 2, self.longest)
        return pause

    def reset(self) -> None:
        self.current = self.first


class RemoteWorker:
    def __init__(self, address: str, router: Router, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                 on_attach=None, secret: bytes = b"", model: str | None = None, task: str | None = None,
                 connect_host: str | None = None):
        """model: the name a worker must announce to be attached (the model this gateway serves); None: any.
        task: the task it must announce (generate | embed); None: any. connect_host: the IP to reach it at (the one
        the allow list checked), instead of resolving address's host again."""
        self.address = address
        self.secret = secret
        self.model = model
        self.task = task
        self.host, self.port = parse_address(address)
        if connect_host is not None:
            self.host = connect_host
        self.router = router
        self.heartbeat_timeout = heartbeat_timeout
        self.on_attach = on_attach
        self.client: WorkerClient | None = None
        self.connected = asyncio.Event()  # set while attached
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        """Connects, attaches, waits for the end, again; every retry backs off (a worker that refuses us, or whose
        connections keep dropping, is never hammered), reset once a connection has lived a while."""
        backoff = Backoff(*WORKER_RECONNECT_BACKOFF_S)
        loop = asyncio.get_running_loop()
        while True:
            try:
                client = await WorkerClient.connect(self.host, self.port, self.heartbeat_timeout,
                                                    close_on_silence=False, secret=self.secret)
            except WorkerDead as e:
                # not up (yet) is routine; refused by the handshake or a malformed hello is worth a warning
                log.log(logging.DEBUG if "cannot connect" in str(e) else logging.WARNING,
                        "worker %s not reachable: %s", self.address, e)
                await asyncio.sleep(backoff.next())
                continue
            problem = self.incompatibility(client.hello)
            if problem is not None:
                log.error("not attaching the worker at %s: %s", self.address, problem)
                await client.close()
                await asyncio.sleep(backoff.next())
                continue
            attached_at = loop.time()
            self.client = client
            if self.on_attach is not None:
                self.on_attach(client)
            self.router.attach(client)
            self.connected.set()
            log.info("worker %s (%s, %s) attached", client.hello.worker_id, self.address, client.hello.version)
            reason = await client.wait_dead()
            self.connected.clear()
            self.router.detach(client, f"the worker at {self.address} was lost ({reason})")
            if loop.time() - attached_at > WORKER_STABLE_CONNECTION_S:
                backoff.reset()
            pause = backoff.next()
            log.error("worker %s lost: %s; reconnecting in %.1f s", self.address, reason, pause)
            await asyncio.sleep(pause)

    def incompatibility(self, hello) -> str | None:
        """Why this worker may not serve here (None: it may): another model than this gateway's, or one the router
        finds incompatible with the workers attached (vocabulary, stop tokens)."""
        if self.model is not None and hello.model != self.model:
            return f"it serves the model {hello.model!r}, this gateway {self.model!r}"
        if self.task is not None and hello.task != self.task:
            return f"it is a worker of the {hello.task!r} task, wanted here for {self.task!r}"
        return self.router.incompatibility(hello)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.client is not None:
            self.router.detach(self.client, "the gateway is stopping")
            await self.client.close()


class RemoteWorkers:
    """The gateway's remote workers: a fixed list, and those registered in Redis (polled)."""

    def __init__(self, router: Router, addresses: list[str], registry_url: str | None = None,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT, on_attach=None, secret: bytes = b"",
                 model: str | None = None, task: str | None = None, known_models: set[str] = frozenset(),
                 allow: tuple[Network, ...] = DEFAULT_ALLOW):
        """model: the model this gateway serves: a worker announcing another one is not attached (None: any).
        task: the task its workers must announce. known_models: other models this gateway serves through other
        RemoteWorkers (their registered workers are not ours, and not worth a log line). allow: the networks a
        registered worker's address must be in (--worker-allow; the --worker addresses are the operator's own)."""
        self.router = router
        self.allow = allow
        self._refused: set[str] = set()  # registered addresses outside `allow` (logged once each while registered)
        self.num_refused = 0
        self.secret = secret
        self.model = model
        self.task = task
        self.known_models = set(known_models)
        self._other_models: set[str] = set()  # registered workers of another model (logged once each)
        self.heartbeat_timeout = heartbeat_timeout
        self.on_attach = on_attach
        self.registry_url = registry_url
        self.workers: dict[str, RemoteWorker] = {}  # by address
        for address in addresses:
            parse_address(address)  # fail at start-up on a typo
        self._addresses = addresses
        self._discovery: asyncio.Task | None = None
        self._redis = None

    async def start(self) -> None:
        """Starts connecting; returns once at least one worker is attached."""
        for address in self._addresses:
            self._add(address)
        if self.registry_url is not None:
            import redis.asyncio as aioredis

            self._redis = aioredis.Redis.from_url(self.registry_url)
            await self._redis.ping()
            self._discovery = asyncio.create_task(self._discover())
        attached = asyncio.Event()
        self.router.on_change.append(attached.set)
        try:
            while not self.router.workers:
                await attached.wait()
        finally:
            self.router.on_change.remove(attached.set)

    def _add(self, address: str, connect_host: str | None = None) -> None:
        worker = RemoteWorker(address, self.router, self.heartbeat_timeout, self.on_attach, self.secret, self.model,
                              self.task, connect_host)
        self.workers[address] = worker
        worker.start()

    async def _discover(self) -> None:
        while True:
            try:
                found = await discover(self._redis)
            except Exception as e:  # Redis away for a moment: keep the workers we have
                log.warning("worker discovery failed: %s", e)
                found = None
            if found is not None:
                addresses = {entry["address"] for entry in found.values() if self._serves_our_model(entry)}
                self._other_models &= set(found)  # forget the ones gone (logged again if they come back)
                self._refused &= addresses
                for address in addresses - set(self.workers) - self._refused:
                    connect_host = await self._allowed_host(address)
                    if connect_host is not None:
                        log.info("discovered worker at %s", address)
                        self._add(address, connect_host)
                for address in set(self.workers) - addresses - set(self._addresses):
                    worker = self.workers[address]
                    if not worker.connected.is_set():  # deregistered and gone: stop retrying it
                        del self.workers[address]
                        await worker.stop()
            await asyncio.sleep(WORKER_DISCOVERY_POLL_S)

    async def _allowed_host(self, address: str) -> str | None:
        """The IP to reach a registered worker at, if its address is within the allow list; None otherwise (logged
        once while it stays registered) or when it does not resolve now (tried again at the next poll)."""
        host, _ = parse_address(address)
        try:
            ip, problem = await resolve_allowed(host, self.allow)
        except OSError as e:
            log.debug("the registered worker address %s does not resolve: %s", address, e)
            return None
        if ip is None:
            self._refused.add(address)
            self.num_refused += 1
            if self.num_refused <= 16 or self.num_refused & (self.num_refused - 1) == 0:  # a flood logs no flood
                log.warning("not connecting to the registered worker at %s: %s (%s); give --worker-allow to allow "
                            "it (%d registrations refused so far)", address, problem,
                            ",".join(map(str, self.allow)), self.num_refused)
        return ip

    def _serves_our_model(self, entry: dict) -> bool:
        """A registry may hold the workers of several models (each with its gateways): only ours are connected to.
        An entry without a model is connected to, and its hello decides."""
        model = entry.get("model")
        if self.model is None or not model or model == self.model:
            return True
        if model not in self.known_models and entry["worker_id"] not in self._other_models:
            self._other_models.add(entry["worker_id"])
            log.info("not connecting to the registered worker %s at %s: it serves %r, this gateway %r",
                     entry["worker_id"], entry["address"], model, self.model)
        return False

    async def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        await asyncio.gather(*(w.stop() for w in self.workers.values()), return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()

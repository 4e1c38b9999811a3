"""A man in the middle of the worker channel, for the tests: a TCP relay on loopback that knows no secret.

It is what a forged Redis registration could put between a gateway and a real worker: every connection made to it is
relayed to the target, the handshake passes through untouched, and it records every byte each way. It can also
tamper with frames (their lengths travel in the clear, so it can cut each direction into frames): `tamper` is called
with every frame, either way, and returns the payload to send instead.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

_LENGTH = struct.Struct(">I")


TO_WORKER, TO_CLIENT = "to_worker", "to_client"


@dataclass
class Frame:
    """What `tamper` is told about a frame on its way."""
    direction: str  # TO_WORKER or TO_CLIENT
    index: int  # its rank in its direction: to the client 0 is the challenge, 1 the hello; to the worker 0 the auth
    payload: bytes
    relayed: dict[str, int]  # frames relayed so far on this connection, by direction
    earlier: list[bytes] = field(default_factory=list)  # the earlier payloads of its direction on this connection


class Relay:
    def __init__(self, target: tuple[str, int], tamper: Callable[[Frame], bytes] | None = None):
        """tamper(frame) -> the payload to send instead (the frame's own: untouched)."""
        self.target = target
        self.tamper = tamper
        self.recorded = {TO_WORKER: bytearray(), TO_CLIENT: bytearray()}  # every byte relayed (after tampering)
        self.num_tampered = 0  # frames tamper() changed
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def seen(self) -> bytes:
        """Every byte it relayed, both ways."""
        with self._lock:
            return bytes(self.recorded[TO_WORKER] + self.recorded[TO_CLIENT])

    def close(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for sock in sockets:
            _shut(sock)
            sock.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                worker = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            worker.settimeout(None)
            with self._lock:
                self._sockets += [client, worker]
            relayed = {TO_WORKER: 0, TO_CLIENT: 0}
            for source, sink, direction in ((client, worker, TO_WORKER), (worker, client, TO_CLIENT)):
                threading.Thread(target=self._pump, args=(source, sink, direction, relayed), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str, relayed: dict[str, int]) -> None:
        earlier: list[bytes] = []
        try:
            while (payload := _read_frame(source)) is not None:
                out = payload
                if self.tamper is not None:
                    out = self.tamper(Frame(direction, len(earlier), payload, dict(relayed), list(earlier)))
                    self.num_tampered += out != payload
                earlier.append(payload)
                data = _LENGTH.pack(len(out)) + out
                with self._lock:
                    self.recorded[direction] += data
                    relayed[direction] += 1
                sink.sendall(data)
        except OSError:
            pass
        _shut(sink)


def flip_a_bit(payload: bytes) -> bytes:
    """The payload with one bit of its middle byte flipped."""
    middle = len(payload) // 2
    return payload[:middle] + bytes([payload[middle] ^ 0x01]) + payload[middle + 1:]


def _read_frame(sock: socket.socket) -> bytes | None:
    header = _recv_exactly(sock, 4)
    if header is None:
        return None
    body = _recv_exactly(sock, _LENGTH.unpack(header)[0])
    return body


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

"""A worker's address, HOST:PORT (IPv6 hosts in brackets): what a worker listens on and registers, and what a gateway
connects to."""

from __future__ import annotations


def parse_address(text: str, allow_any_port: bool = False) -> tuple[str, int]:
    """HOST:PORT (IPv6 hosts in brackets). allow_any_port: port 0 (pick a free one) is allowed (to listen)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if allow_any_port else 1) <= int(port) < 65536:
        raise ValueError(f"a worker address must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)

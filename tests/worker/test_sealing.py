"""The worker channel's sealing (inferd/worker/sealing.py) as units: a frame opens once, in its place, in its
direction, on its connection (secret and both nonces), and both ends ratchet their keys at the same frame."""

from __future__ import annotations

import pytest

from inferd.worker.protocol import ProtocolError, new_nonce
from inferd.worker.sealing import channel

SECRET = b"unit-secret"


def ends(rekey_bytes: int = 1 << 32, secret: bytes = SECRET, nonces=None):
    worker_nonce, client_nonce = nonces or (new_nonce(), new_nonce())
    worker = channel(secret, worker_nonce, client_nonce, worker_side=True, rekey_bytes=rekey_bytes)
    gateway = channel(secret, worker_nonce, client_nonce, worker_side=False, rekey_bytes=rekey_bytes)
    return (worker_nonce, client_nonce), worker, gateway


def refused(opener, sealed: bytes) -> None:
    with pytest.raises(ProtocolError, match="integrity check") as e:
        opener.open(sealed)
    assert e.value.fatal


def test_both_ends_ratchet_in_step_and_a_frame_opens_only_in_its_place():
    bodies = [b"x" * n for n in (10, 50, 60, 5, 200, 1, 90, 30)]  # crosses a 100-byte ratchet several times
    _, (worker_seal, _), (_, gateway_open) = ends(rekey_bytes=100)
    sealed = [worker_seal.seal(b) for b in bodies]
    assert [gateway_open.open(s) for s in sealed] == bodies
    assert len({s[-16:] for s in sealed}) == len(sealed)
    # the same bodies under a channel that never ratchets: the frames up to the one that crosses 100 sealed bytes
    # (26 + 66 + 76) agree, the next does not
    nonces, (plain_seal, _), _ = ends()
    _, (ratcheting, _), _ = ends(rekey_bytes=100, nonces=nonces)
    assert [plain_seal.seal(b) for b in bodies[:3]] == [ratcheting.seal(b) for b in bodies[:3]]
    assert plain_seal.seal(bodies[3]) != ratcheting.seal(bodies[3])


def test_a_frame_never_opens_twice_out_of_order_the_other_way_or_on_another_connection():
    nonces, (worker_seal, worker_open), (gateway_seal, gateway_open) = ends()
    first, second = worker_seal.seal(b'{"type":"outputs"}'), worker_seal.seal(b'{"type":"heartbeat"}')
    refused(ends(nonces=nonces)[2][1], second)  # out of order (a fresh gateway end expects the first)
    assert gateway_open.open(first) == b'{"type":"outputs"}'
    refused(gateway_open, first)  # replayed
    refused(ends(nonces=nonces)[1][1], first)  # reflected back to the worker (the other direction's key)
    refused(ends()[2][1], first)  # another connection's nonces
    refused(ends(secret=b"another", nonces=nonces)[2][1], first)  # another secret
    flipped = bytearray(gateway_seal.seal(b'{"type":"add"}'))
    flipped[3] ^= 1
    refused(worker_open, bytes(flipped))

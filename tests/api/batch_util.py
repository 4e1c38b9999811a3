"""What the Batch API's tests share: an input file's bytes, and waiting for a batch's status."""

from __future__ import annotations

import json
import time


def jsonl(items: list[dict]) -> bytes:
    return "".join(json.dumps(i) + "\n" for i in items).encode()


def wait_status(client, batch_id: str, statuses: tuple[str, ...], timeout: float = 60.0):
    """The batch, once its status is one of statuses; AssertionError with the batch after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch stayed {b.status} for {timeout} s: {b}"
        time.sleep(0.05)

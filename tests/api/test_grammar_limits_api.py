"""A grammar's cost is bounded, through a real `inferd serve` of the default model (its default budgets):
- an ambiguous grammar of 42 characters, whose matcher costs ~n^3 per token, ends with a 400-shaped
  `grammar_too_slow` SSE error once a step's mask and accept take over its budget, and a request sent after it
  ran as long as the old code would have let it run is served at its usual latency (measured alone in the test);
- a unique 48 KB grammar that compiles for ~12 s ends with `grammar_too_slow` at the compile budget;
- aborting requests whose grammars are compiling kills their compile processes at once, and a new grammar compiles
  without waiting for them."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

import httpx
import pytest

from servers import process_gone
from tests.engine.test_structured import slow_grammar

pytestmark = pytest.mark.timeout(600)

HOSTILE = 'root ::= x*\nx ::= "a" | "aa" | "aaa" | x x'  # the 42 characters
HOSTILE_REACH = 120  # tokens after which the old code spent ~0.4 s per step on the hostile grammar alone


def victim_latency(server) -> float:
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"model": server.model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


class Stream(threading.Thread):
    """A streamed completion read on a thread: .tokens (chunks with text), .error (an in-band error), .ended."""

    def __init__(self, server, **body):
        super().__init__(daemon=True)
        self.server, self.body = server, {"model": server.model, "stream": True, **body}
        self.tokens, self.error, self.status = 0, None, None
        self.ended = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=self.body, timeout=600) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.error = json.loads(r.read())["error"]
                    return
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return  # leaving the block closes the connection: the request is aborted
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]
                    else:
                        self.tokens += sum(1 for c in event["choices"] if c["text"])
        finally:
            self.ended.set()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def test_an_ambiguous_grammar_ends_with_grammar_too_slow_and_spares_the_next_request(smollm2_server,
                                                                                        smollm2_tokenizer):
    server = smollm2_server
    victim_latency(server)  # warm
    alone = victim_latency(server)
    aaaa = smollm2_tokenizer.hf.convert_tokens_to_ids("aaaa")  # the longest run of "a" in one token: the fastest growth
    hostile = Stream(server, prompt="Write the letter a many times:", max_tokens=400, temperature=0,
                     logit_bias={str(aaaa): 100}, structured_outputs={"grammar": HOSTILE})
    hostile.start()
    try:
        wait_for(lambda: hostile.ended.is_set() or hostile.tokens >= HOSTILE_REACH, 500, "the hostile request")
        beside = victim_latency(server)  # where the old code made every step pay the hostile's growing mask
    finally:
        hostile.stop.set()
        hostile.join(600)
    alone = max(alone, victim_latency(server))  # alone before and after: the host's load may change meanwhile
    assert beside <= 2 * alone + 1.0, f"the next request took {beside:.2f} s, {alone:.2f} s alone"
    assert hostile.error is not None, f"the hostile grammar ran on ({hostile.tokens} tokens)"
    assert hostile.error["code"] == "grammar_too_slow" and hostile.error["type"] == "invalid_request_error"
    assert "ms in one step, over its budget of 50 ms" in hostile.error["message"], hostile.error
    assert hostile.tokens < HOSTILE_REACH


def test_a_grammar_that_compiles_too_long_ends_with_grammar_too_slow(smollm2_server):
    server = smollm2_server
    grammar = slow_grammar(3000, seed=uuid.uuid4().int)  # unique: never in a cache; ~12 s to compile
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"model": server.model, "prompt": "Say:", "max_tokens": 4,
                         "structured_outputs": {"grammar": grammar}})
    elapsed = time.perf_counter() - t0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "grammar_too_slow" and "compiling the request's grammar took longer than its budget of " \
        "5 s" in error["message"], error
    assert elapsed < 60


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def compile_processes(server) -> list[int]:
    """The server's grammar compile processes: children of a multiprocessing forkserver among its descendants."""
    children = _children()
    todo, found = [server.proc.pid], []
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                forkserver = b"multiprocessing.forkserver" in f.read()
        except FileNotFoundError:
            continue
        if forkserver:
            found += children.get(pid, [])
        else:
            todo += children.get(pid, [])
    return [p for p in found if not process_gone(p)]


def cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except FileNotFoundError:
        return -1


def open_stream(server, grammar: str) -> socket.socket:
    """A streamed request sent on a raw socket (closing it is the client's disconnect)."""
    body = json.dumps({"model": server.model, "prompt": "Say:", "max_tokens": 4, "stream": True,
                       "structured_outputs": {"grammar": grammar}}).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def small_grammar_latency(server) -> float:
    tag = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"model": server.model, "prompt": "Pick one:", "max_tokens": 32, "temperature": 0,
                         "structured_outputs": {"grammar": f'root ::= "left{tag}" | "right{tag}"'}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in (f"left{tag}", f"right{tag}")
    return time.perf_counter() - t0


def test_aborting_requests_kills_their_compiles_and_frees_the_compilers(smollm2_server):
    server = smollm2_server
    small_grammar_latency(server)  # warm
    alone = small_grammar_latency(server)  # a new grammar: compile (in a warm process) and generation
    before = {p: cpu_ticks(p) for p in compile_processes(server)}
    socks = [open_stream(server, slow_grammar(3000, seed=uuid.uuid4().int)) for _ in range(2)]  # both compilers busy
    try:
        def compiling() -> list[int]:
            return [p for p in compile_processes(server) if cpu_ticks(p) > before.get(p, 0) + 20]  # 0.2 s of CPU

        wait_for(lambda: len(compiling()) >= 2, 60, "two grammar compile processes at work")
        busy = compiling()
    finally:
        for sock in socks:
            sock.close()  # the clients leave: their requests are aborted
    # killed at once, well before their 5 s budget would have ended them
    wait_for(lambda: all(process_gone(p) for p in busy), 2.5, "the abandoned compiles' processes killed")
    after = small_grammar_latency(server)  # a new grammar compiles in a fresh process, waiting for nothing
    assert after <= alone + 2.5, (alone, after)

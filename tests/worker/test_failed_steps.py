"""A failing engine step fails only the requests in that step (issue 13, part 4), on the real engine: the fault
(INFERD_FAULT fail, seed=: the step that runs the marked request, struck once the batch is scheduled) fails the two
requests that step ran, with an error on their streams; the two that waited for a batch slot complete; the worker
serves a later request, and every KV block is free again (no leak: free + evictable == all)."""

from __future__ import annotations

import asyncio

import pytest

from inferd.engine import SamplingParams
from inferd.worker.client import RequestFailed, WorkerClient

VICTIM_SEED = 4242
MAX_TOKENS = 24


def _params(seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, seed=seed)


def test_a_failed_step_fails_its_requests_and_frees_their_blocks(spawn_worker):
    # two batch slots: the victim and its neighbour run (and fail) together, the other two wait for a slot
    proc = spawn_worker("--max-num-seqs", "2", "--heartbeat-interval", "0.1",
                        env={"INFERD_FAULT": f"action=fail,seed={VICTIM_SEED},step=3"})

    async def main():
        async with await WorkerClient.connect(proc.host, proc.port) as client:
            async def run(request_id: str, prompt: list[int], params: SamplingParams):
                got = []
                try:
                    async for out in client.generate(request_id, prompt, params):
                        got.extend(out.new_token_ids)
                        if out.finished:
                            return out.finish_reason, got
                except RequestFailed as e:
                    return str(e), got

            # sent in this order on one connection: the engine admits the first two, the others wait
            results = await asyncio.wait_for(asyncio.gather(
                run("victim", [5, 6, 7, 8], _params(VICTIM_SEED)), run("neighbour", [9, 10, 11], _params()),
                run("waiting-1", [12, 13, 14], _params()), run("waiting-2", [15, 16], _params())), 120)
            later = await asyncio.wait_for(run("later", [17, 18, 19], _params()), 60)
            stats = await client.wait_for_stats(lambda s: s.running == 0 and s.waiting == 0, timeout=30)
            return results, later, stats

    (victim, neighbour, waiting_1, waiting_2), later, stats = asyncio.run(main())
    for reason, got in (victim, neighbour):  # the failed step's two requests: an error, after their first tokens
        assert "engine step failed" in reason, reason
        assert 0 < len(got) < MAX_TOKENS
    for reason, got in (waiting_1, waiting_2, later):
        assert reason == "length" and len(got) == MAX_TOKENS
    assert stats.kv_blocks_in_use == 0 and stats.kv_blocks_free == stats.kv_num_blocks
    log = proc.log()
    assert f"injected fault: fail at seed {VICTIM_SEED} step 3" in log
    assert log.count("engine step failed") == 1  # one step failed, and only once
    assert not proc.is_gone()


class _Peer:
    """A connection as the engine loop sees it (its Peer protocol): what it was sent."""
    closed = False

    def __init__(self):
        self.sent: list[dict] = []

    def send(self, message: dict) -> None:
        self.sent.append(message)


def test_an_abort_just_before_a_failed_step_still_ends_its_stream(tiny_llama_dir):
    """The abort's final output waits for the next step; that step fails: the output still goes out (its stream
    ends, the loop forgets the request) and only the step's own request fails. The loop driven step by step."""
    from inferd.config import EngineConfig
    from inferd.engine import Engine
    from inferd.worker.engine_loop import EngineLoop
    from inferd.worker.faults import FaultInjector, FaultSpec
    from inferd.worker.protocol import AddRequest

    engine = Engine.from_config(EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_bytes=16 << 20,
                                             max_model_len=256))
    loop = EngineLoop(engine, faults=FaultInjector(FaultSpec("fail", seed=VICTIM_SEED, step=2)))
    peer = _Peer()
    loop.add(peer, AddRequest("victim", 0, [5, 6, 7], None, _params(VICTIM_SEED)))
    loop.add(peer, AddRequest("aborted", 0, [8, 9], None, _params()))
    loop._drain_commands()
    loop._publish(loop._step())  # both run their first step
    loop.abort(peer, "aborted")
    loop._drain_commands()  # aborted now; its final output goes out with the next step's
    loop._publish(loop._step())  # the victim's second step: it fails
    ends = {m["request_id"]: m for m in peer.sent if m["type"] == "error"}
    ends.update({e["request_id"]: e for m in peer.sent if m["type"] == "outputs" for e in m["outputs"]
                 if e["finished"]})
    assert "engine step failed" in ends["victim"]["error"]
    assert ends["aborted"]["finish_reason"] == "abort"
    assert not loop._dispatches and not engine.has_unfinished_requests()
    engine.kv_cache.check_no_leaks()


def test_a_seed_fault_counts_only_the_steps_of_its_request():
    from inferd.worker.faults import FaultSpec

    spec = FaultSpec.parse("action=fail,seed=7,step=2,times=0")
    assert (spec.seed, spec.step, spec.times) == (7, 2, 0)
    with pytest.raises(ValueError, match="integers"):
        FaultSpec.parse("action=fail,seed=x")

"""A failing engine step fails only the requests in that step (issue 13, part 4): with one batch slot, three requests
reach the worker together, one runs and two wait in its engine; the injected failure (INFERD_FAULT fail, at the 3rd
decode step) ends the running one with 500 engine_error, the waiting two complete, the worker carries on, and a later
request is served."""

from __future__ import annotations

import asyncio

import httpx


def test_a_failed_step_fails_only_the_requests_in_it(tmp_path, tiny_llama_dir):
    from servers import kill_group, start_server

    server = start_server(tiny_llama_dir, tmp_path / "serve.log", "--echo", "--max-model-len", "256",
                          "--max-num-seqs", "1", "--heartbeat-interval", "0.1", model_name="tiny",
                          env={"INFERD_FAULT": "action=fail,phase=decode,step=3"})
    try:
        async def three():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(
                    client.post(server.url + "/v1/completions",
                                json={"model": server.model, "prompt": f"request {i} a b c", "max_tokens": 20})
                    for i in range(3)))

        responses = asyncio.run(three())
        assert sorted(r.status_code for r in responses) == [200, 200, 500], [r.text for r in responses]
        [failed] = [r for r in responses if r.status_code == 500]
        error = failed.json()["error"]
        assert error["code"] == "engine_error"
        # what failed inside stays in the log; the client gets the request id to quote
        assert "InjectedFault" not in error["message"] and failed.headers["x-request-id"] in error["message"]
        assert failed.headers["x-request-id"] in server.log()
        for r in responses:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 20
        assert "injected fault: fail" in server.log()
        r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "after", "max_tokens": 5},
                       timeout=60)
        assert r.status_code == 200
        server.wait_metrics(lambda m: m.get('inferd_num_requests_running{model="tiny"}') == 0
                            and m.get("inferd_gateway_open_requests") == 0)
    finally:
        kill_group(server.proc)

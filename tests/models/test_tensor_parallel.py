"""Tensor parallelism (inferd/engine/tensor_parallel.py, the shards in inferd/models/parallel.py): an engine
split over 2 processes (rank 1 a child process, gloo) gives the outputs of one process, by the exactness rule of
tests/parity.py; a bad split is refused at start; the child rank ends with the engine and with its parent
process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine import Engine, SamplingParams
from inferd.engine.runner import kv_bytes_per_block
from inferd.models.config import ModelConfig
from inferd.models.parallel import check_tensor_parallel
from parity import Reference, assert_greedy_parity, assert_sampling_match, row_diff, run_staggered

pytestmark = pytest.mark.timeout(120)

PROMPT_LENS = [5, 21, 40, 77, 13]
MAX_NEW = [12, 9, 14, 10, 12]
SAMPLED = 4  # the last prompt samples (seeded); the others are greedy


def params() -> list[SamplingParams]:
    out = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_NEW]
    out[SAMPLED] = SamplingParams(max_tokens=MAX_NEW[SAMPLED], temperature=0.9, top_p=0.95, seed=1234,
                                  ignore_eos=True)
    return out


def config(path, tp: int) -> EngineConfig:
    # a 32-token budget: the 40- and 77-token prompts are prefilled in chunks, beside other sequences' decodes
    return EngineConfig(model=str(path), dtype="float32", kv_cache_bytes=1 << 22, max_num_batched_tokens=32,
                        max_num_seqs=8, record_logits=True, tensor_parallel=tp)


def run(engine: Engine, vocab: int):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    reqs, trace = run_staggered(engine, prompts, params(), every=1)
    engine.kv_cache.check_no_leaks()
    return reqs, trace


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def both(request, tiny_llama_dir, tiny_qwen2_dir):
    """The same requests through a one-process engine, then through a 2-process one (in that order: a TP engine
    gives each rank half of the cores while it lives)."""
    path = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    one = Engine.from_config(config(path, 1))
    ref, ref_trace = run(one, one.model_config.vocab_size)
    tp = Engine.from_config(config(path, 2))
    try:
        yield SimpleNamespace(name=request.param, ref=ref, ref_trace=ref_trace, tp=tp, run=run)
    finally:
        tp.close()


def test_tp2_equals_one_process(both):
    reqs, trace = run(both.tp, both.tp.model_config.vocab_size)
    assert trace == both.ref_trace  # the same schedule: chunked prefills beside decodes
    assert any(d > 0 and p > 0 for d, p, _ in trace)
    for i, (ours, ref) in enumerate(zip(reqs, both.ref)):
        if i == SAMPLED:
            continue
        reference = Reference(ref.output_token_ids, torch.stack(ref.debug_logits).numpy())
        assert_greedy_parity(ours.output_token_ids, ours.debug_logits, reference, f"{both.name} prompt {i}")
    # seeded sampling draws the same tokens from (all but) the same logits
    ours, ref = reqs[SAMPLED], both.ref[SAMPLED]
    assert_sampling_match(ours.output_token_ids, ref.output_token_ids, ref.debug_logits, ours.params,
                          ours.params.seed, ref.num_prompt_tokens, f"{both.name} sampled",
                          diff_at=lambda i: row_diff(ours.debug_logits[i], ref.debug_logits[i]))


def test_each_rank_holds_its_share(both):
    cfg = both.tp.model_config
    runner = both.tp.runner
    assert runner.kv.shape[2] == cfg.num_key_value_heads // 2  # rank 0's KV heads only
    attn = runner.model.layers[0].self_attn
    assert (attn.n_heads, attn.n_kv) == (cfg.num_attention_heads // 2, cfg.num_key_value_heads // 2)
    assert runner.model.layers[0].mlp.inter == cfg.intermediate_size // 2
    # kv_cache_bytes is per device: half the KV heads, twice the blocks
    assert runner.kv.numel() * runner.kv.element_size() <= 1 << 22
    assert both.tp.kv_cache.num_blocks == (1 << 22) // kv_bytes_per_block(cfg, 16, torch.float32, 2)
    assert both.tp.kv_cache.num_blocks >= 2 * ((1 << 22) // kv_bytes_per_block(cfg, 16, torch.float32))


def test_close_ends_the_other_rank(both):
    procs = both.tp.runner.parallel.procs
    assert all(p.poll() is None for p in procs)
    both.tp.close()
    assert [p.returncode for p in procs] == [0]
    both.tp.close()  # idempotent
    both.tp.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="closed"):
        both.tp.step()


def tiny_config(**kw) -> ModelConfig:
    base = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=160,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return replace(base, **kw)


def test_bad_split_is_a_value_error(tiny_llama_dir):
    check_tensor_parallel(tiny_config(), 2)
    for cfg, tp, what in [(tiny_config(), 3, "num_attention_heads=4"),
                          (tiny_config(num_key_value_heads=1), 2, "num_key_value_heads=1"),
                          (tiny_config(intermediate_size=162), 4, "intermediate_size=162"),
                          (tiny_config(num_attention_heads=9, num_key_value_heads=3), 2, "num_attention_heads=9")]:
        with pytest.raises(ValueError, match=what):
            check_tensor_parallel(cfg, tp)
    with pytest.raises(ValueError, match="at least 1"):
        check_tensor_parallel(tiny_config(), 0)
    before = _children()
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide"):
        Engine.from_config(config(tiny_llama_dir, 3))
    assert _children() <= before  # refused from the config alone: no rank process was started


def _children() -> set[int]:
    pid = os.getpid()
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out.update(int(p) for p in f.read().split())
    return out


def test_engine_without_its_ranks_is_refused(both):
    with pytest.raises(ValueError, match="from_config"):
        Engine(both.tp.runner.model, both.tp.model_config, EngineConfig(tensor_parallel=2), torch.float32)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_child_rank_exits_when_the_engine_process_is_killed(tiny_llama_dir):
    script = (
        "import sys, time\n"
        "from inferd.config import EngineConfig\n"
        "from inferd.engine import Engine\n"
        f"e = Engine.from_config(EngineConfig(model={str(tiny_llama_dir)!r}, dtype='float32',"
        " kv_cache_bytes=1 << 22, tensor_parallel=2))\n"
        "print(e.runner.parallel.pids[0], flush=True)\n"
        "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert not _gone(child)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(child):
        assert time.monotonic() < deadline, f"rank 1 (pid {child}) outlived its killed parent"
        time.sleep(0.05)
    if not _gone(child):  # pragma: no cover
        os.kill(child, signal.SIGKILL)


def test_step_encoding_round_trips():
    import io

    from inferd.engine.tensor_parallel import encode_step, read_step
    from inferd.models.step_row import StepRow

    rows = [StepRow([7], 40, [3, 9, 11], True), StepRow(list(range(20)), 0, [5, 6], False),
            StepRow([1, 2], 16, [], False)]
    stream = io.BytesIO(encode_step(rows) + encode_step([]))
    assert read_step(stream) == [r._replace(samples=False) for r in rows]
    assert read_step(stream) == []
    assert read_step(stream) is None  # end of file: the engine is gone
    assert np.frombuffer(encode_step(rows), dtype=np.int64)[0] == 3 * 3 + 1 + 3 + 20 + 2 + 2

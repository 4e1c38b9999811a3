"""Expert parallelism (inferd/models/parallel.py: ExpertParallel, expert_parallel_block): an MoE block's experts
split over 2 processes (gloo, file rendezvous) give the one-process block's output by the float32 bound of
tests/parity.py; each rank holds and reads only its half of the experts. Both ranks are child processes (the test
process never joins a process group), each running all three families."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferd.models.parallel import check_expert_parallel, expert_range

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]

RANK = r"""
import json, sys
import torch
import torch.distributed as dist
from inferd.models.moe import MoESpec, SparseMoE
from inferd.models.parallel import expert_parallel_block
from parity import FP32, scale_of

rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
group = dist.new_group([0, 1])
results = {}
for family in ("mixtral", "qwen3_moe", "gpt_oss"):
    spec = MoESpec(family, 64, 32, 8, 2)
    whole = SparseMoE(spec)
    g = torch.Generator().manual_seed(0)  # the same weights on both ranks
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    # transformers' module-state names (gpt-oss: transposed, gate/up interleaved), as a loader hands them over
    ex = whole.experts
    if family == "gpt_oss":
        I = spec.intermediate_size
        inter = torch.stack([ex.gate_up[:, :I], ex.gate_up[:, I:]], dim=2).flatten(1, 2)  # rows g0 u0 g1 u1 ...
        bias = torch.stack([ex.gate_up_bias[:, :I], ex.gate_up_bias[:, I:]], dim=2).flatten(1, 2)
        state = {"router.weight": whole.router.weight, "router.bias": whole.router.bias,
                 "experts.gate_up_proj": inter.transpose(1, 2), "experts.gate_up_proj_bias": bias,
                 "experts.down_proj": ex.down.transpose(1, 2), "experts.down_proj_bias": ex.down_bias}
    else:
        state = {"gate.weight": whole.router.weight, "experts.gate_up_proj": ex.gate_up,
                 "experts.down_proj": ex.down}
    state = {"model.layers.0.mlp." + k: v.detach() for k, v in state.items()}
    block = expert_parallel_block(spec, state, "model.layers.0.mlp.", 2, rank, group)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)) * 4
    with torch.no_grad():
        ref = whole(x)
        own = block.moe(x)  # this rank's share alone, before the all-reduce
        out = block(x)
    results[family] = {"diff": float((out - ref).abs().max()), "tol": FP32.tolerance(scale_of(ref)),
                       "own_diff": float((own - ref).abs().max()),
                       "held": [block.moe.expert_start, block.moe.expert_stop, block.moe.experts.gate_up.shape[0]],
                       "touched": block.moe.weight_bytes_touched(range(8)) - block.moe.router_bytes(),
                       "whole_touched": whole.weight_bytes_touched(range(8)) - whole.router_bytes()}
dist.destroy_process_group()
print(json.dumps(results), flush=True)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    rdv = tmp_path_factory.mktemp("ep") / "rendezvous"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(rdv)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=90)
        finally:
            p.kill()
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_two_ranks_equal_one_block(ranks, family):
    for rank, results in enumerate(ranks):
        r = results[family]
        assert r["diff"] <= r["tol"], f"rank {rank}: {r['diff']:.3g} beyond the float32 bound {r['tol']:.3g}"
        assert r["own_diff"] > 100 * r["tol"], f"rank {rank}: its own share alone is already the whole output"
        assert r["held"] == [4 * rank, 4 * rank + 4, 4]  # half the experts, whole
        assert 2 * r["touched"] == r["whole_touched"]  # and half their bytes


def test_bad_expert_split_is_a_value_error():
    check_expert_parallel(8, 4)
    assert expert_range(8, 2, 1) == (4, 8)
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the model's num_experts=8"):
        check_expert_parallel(8, 3)
    with pytest.raises(ValueError, match="at least 1"):
        check_expert_parallel(8, 0)

"""The planner and the runtime agree on what is a layout: for layouts sampled from the planner's
search space (llama3-8b/70b/405b, mixtral-8x7b, deepseek-v3 on 8 to 16,384 GPUs), `config check`
(in process, meta-device build included) accepts a layout exactly when the planner counts it
valid. Both call ndtrain.layout.problems(); the config path adds the config validator, -1
resolution, the stage partition and the meta build, so any rule those know and problems() does
not shows up here as a disagreement."""

from __future__ import annotations

import random

import pytest

from ndtrain.config import load_config
from ndtrain.errors import NdtrainError
from ndtrain.layout import Layout
from ndtrain.model.config import preset
from ndtrain.tools.config_check import check_config
from ndtrain.planner.problem import make_problem
from ndtrain.planner.search import _schedules, divisors
from ndtrain.planner.stack import PLANNED_AC

CASES = [  # preset, seq, global batch (sequences)
    ("llama3-8b", 8192, 128), ("llama3-70b", 8192, 512), ("llama3-405b", 8192, 2048),
    ("mixtral-8x7b", 4096, 256), ("deepseek-v3", 4096, 15360),
]
WORLDS = [8, 16, 64, 256, 1024, 2048, 4096, 16384]


def sample_layout(rng: random.Random, pb) -> Layout:
    """One point of the space `planner.search` walks (before its memory and time pruning): every
    mesh of the world (tp up to a node), every dp_shard/dp_replicate split and ep, each ZeRO
    stage, micro-batch, (schedule, v) pair the search generates, and recompute policy."""
    W, sh = pb.world, pb.shape
    t = rng.choice([d for d in divisors(W) if d <= 8])
    c = rng.choice([d for d in divisors(W // t) if d <= 32])
    p = rng.choice([d for d in divisors(W // (t * c)) if d <= sh.layers])
    dp = W // (t * c * p)
    ds = rng.choice(divisors(dp))
    e = rng.choice(divisors(sh.n_experts)) if sh.n_experts else 1
    z = rng.choice((1, 2, 3))
    mb = rng.choice([1 << i for i in range(7)])
    m = max(1, pb.global_batch // max(dp * mb, 1))
    sched, v = rng.choice(list(_schedules(p, m, sh.layers, None, {})))
    return Layout(dp_replicate=dp // ds, dp_shard=ds, tp=t, cp=c, pp=p, ep=e, zero=z, reshard_after_forward=z == 3,
                  micro_batch=mb, pp_virtual_stages=v, activation_checkpoint=rng.choice(PLANNED_AC), sequence_parallel=t > 1, pp_schedule=sched)


def config_check_accepts(name: str, seq: int, batch: int, lay: Layout, world: int) -> bool:
    overrides = lay.config_overrides()
    overrides["model"] = {"preset": name}
    overrides["data"] = {"seq_len": seq}
    overrides["train"].update(global_batch=batch)
    try:
        cfg = load_config(None, overrides)
        check_config(cfg, world)
    except NdtrainError:
        return False
    return True


@pytest.mark.timeout(600)
def test_config_check_accepts_exactly_what_the_planner_counts_valid():
    rng = random.Random(11)
    counts = {"valid": 0, "invalid": 0}
    disagreements = []
    for i in range(520):
        name, seq, batch = CASES[i % len(CASES)]
        world = rng.choice(WORLDS)
        pb = make_problem(preset(name), seq, batch, world, "h100")
        lay = sample_layout(rng, pb)
        planner = pb.why_invalid(lay) is None
        runtime = config_check_accepts(name, seq, batch, lay, world)
        counts["valid" if planner else "invalid"] += 1
        if planner != runtime:
            disagreements.append(f"{name} on {world}: {lay.text()} planner={planner} config check={runtime}")
    assert not disagreements, "\n".join(disagreements[:10])
    # Both outcomes are well represented, so agreement is not vacuous.
    assert counts["valid"] >= 100 and counts["invalid"] >= 100, counts

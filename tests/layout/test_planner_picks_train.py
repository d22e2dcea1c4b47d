"""Every layout the planner may pick on this CPU trains, and matches one process (`verify`).

The planner's top layouts for worlds 1-8 (an 8-layer debug model, 24 sequences of 64 tokens, this
machine as `ndtrain calibrate` profiled it, or its defaults) include uneven pipeline stages,
interleaved zero-bubble schedules with ZeRO-1, GPipe over 5 and 7 stages, HSDP: each must train
with the loss, gradient norm and weights of a single process. Layouts of one world share one
launch of ranks."""

from __future__ import annotations

import pytest

from ndtrain.model.config import preset, replace
from ndtrain.tools.verify import verify
from ndtrain.planner.hardware import from_profile, this_machine
from ndtrain.planner.problem import make_problem
from ndtrain.planner.search import search

TOL = 1e-5
MODEL = {"preset": "debug", "n_layers": 8}


def planner_picks(world: int, top: int, hw) -> list[str]:
    pb = make_problem(replace(preset("debug"), n_layers=8), 64, 24, world, hw, precision="fp32")
    return [p.layout.text() for p in search(pb, top_k=top, mb_options=[1, 2, 3, 4, 6, 8]).top]


def _base(parity_base) -> dict:
    base = {k: dict(v) for k, v in parity_base.items()}
    base["model"] = dict(MODEL)
    base["train"]["global_batch"] = 24
    return base


def _check(results):
    bad = [r for r in results if not r.passed]
    assert not bad, "\n".join(f"{r.layout}: Δloss {r.d_loss:.2e} Δweight {r.d_weight:.2e} "
                              f"grad-norm {r.d_grad_norm:.2e}" for r in bad)


@pytest.mark.timeout(600)
def test_planner_picks_for_5_and_8_ranks_train(parity_base):
    layouts = planner_picks(5, 1, from_profile({})) + planner_picks(8, 1, from_profile({}))
    assert len(layouts) == 2
    _, results = verify(_base(parity_base), layouts, steps=2, tol_loss=TOL, tol_weight=TOL)
    _check(results)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_planner_pick_for_worlds_1_to_8_trains(parity_base, hang_deadline):
    layouts = [lay for world in range(1, 9) for lay in planner_picks(world, 3, this_machine())]
    assert len(layouts) >= 20
    _, results = verify(_base(parity_base), layouts, steps=2, tol_loss=TOL, tol_weight=TOL, timeout_s=hang_deadline(600))
    _check(results)
    assert len(results) == len(layouts)

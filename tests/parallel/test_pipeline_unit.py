"""Pipeline parallel without processes: stage splitting, schedule rules, the simulator and the
published bubble formulas, validation errors (each naming its key), the report CLI."""

from __future__ import annotations

import itertools

import pytest
import torch

from ndtrain.config import load_config
from ndtrain.errors import ConfigError, NdtrainError
from ndtrain.model.config import preset, replace
from ndtrain.parallel import pipeline_schedule as ps
from ndtrain.parallel.dims import checked_layout
from ndtrain.parallel.pipeline import build_stage_module, part_costs, stage_layer_counts, stage_layers


# ---- splitting -----------------------------------------------------------------------------

def _max_cost(counts, costs):
    out, start = [], 0
    for k, c in enumerate(counts):
        out.append(costs.stage(start, start + c, k == 0, k == len(counts) - 1))
        start += c
    return max(out)


def test_balanced_split_is_optimal_and_weighs_the_head():
    # A large vocabulary makes the head (and embedding) cost several layers: the balanced split
    # gives the first and last stage fewer layers, and no contiguous split has a cheaper maximum.
    cfg = replace(preset("debug"), n_layers=10, vocab_size=8192)
    costs = part_costs(cfg, 64)
    counts = stage_layer_counts(cfg, 4, 64, "balanced")
    assert sum(counts) == 10 and min(counts) >= 1
    assert counts[0] < counts[1] and counts[-1] < counts[-2]
    best = min(_max_cost(c, costs) for c in itertools.product(range(1, 8), repeat=4) if sum(c) == 10)
    assert _max_cost(counts, costs) == pytest.approx(best)
    assert _max_cost(counts, costs) < _max_cost(stage_layer_counts(cfg, 4, 64, "uniform"), costs)
    # Identical layers and a negligible head: an even split.
    assert stage_layer_counts(replace(preset("debug"), n_layers=8), 4, 64) == [2, 2, 2, 2]


def test_balanced_split_weighs_time_and_memory_apart():
    # DeepSeek-V3's three dense layers take an MoE layer's time but a tenth of its memory: a stage
    # costs the larger of its FLOP and parameter shares, so the dense layers do not pile up on
    # the first stage as they would if the two were added.
    cfg = preset("deepseek-v3")
    costs = part_costs(cfg, 4096)
    assert costs.params[0] < costs.params[5] / 10 and costs.flops[0] == pytest.approx(costs.flops[5], rel=0.1)
    counts = stage_layer_counts(cfg, 16, 4096)
    assert counts[0] <= max(counts[1:]) and sum(counts) == 61


def test_uniform_llama3_and_explicit_splits():
    # Llama 3 405B: 126 layers on 16 stages, one layer fewer on the first and the last.
    assert stage_layer_counts(preset("llama3-405b"), 16, 8192, "llama3") == [7] + [8] * 14 + [7]
    debug10 = replace(preset("debug"), n_layers=10)
    assert stage_layer_counts(debug10, 4, 64, "uniform") == [2, 3, 3, 2]
    assert stage_layer_counts(debug10, 4, 64, explicit=[1, 4, 4, 1]) == [1, 4, 4, 1]
    assert stage_layers([1, 2, 1]) == [[0], [1, 2], [3]]
    with pytest.raises(NdtrainError):
        stage_layer_counts(debug10, 4, 64, explicit=[1, 4, 4, 2])


def test_stages_keep_canonical_names_and_own_a_partition():
    from ndtrain.model.init import materialize
    from ndtrain.model.llama import build_model

    cfg = replace(preset("debug"), n_layers=4)
    full = materialize(build_model(cfg, "meta"), seed=7)
    full_sd = full.state_dict()
    layers = stage_layers([1, 2, 1])
    seen = {}
    for s, ids in enumerate(layers):
        part = build_stage_module(cfg, ids, s == 0, s == 2)
        assert all(p.is_meta for p in part.parameters())  # nothing allocated before materialize
        materialize(part, seed=7)
        for name, t in part.state_dict().items():
            assert name not in seen, f"{name} in two stages"
            seen[name] = t
            assert torch.equal(t, full_sd[name]), name  # layout-independent init
        assert len(part.state_dict()) < len(full_sd)  # no stage holds the whole model
    assert set(seen) == set(full_sd)


def test_stage_to_rank_mappings():
    assert ps.stage_ranks("Interleaved1F1B", 2, 3) == [0, 1, 0, 1, 0, 1]
    assert ps.stage_ranks("ZBVZeroBubble", 4, 2) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert ps.rank_stages("DualPipeV", 4, 2, 0) == [0, 7]
    assert ps.rank_stages("1F1B", 4, 1, 2) == [2]


# ---- schedules, simulator, formulas --------------------------------------------------------

VALID = [(s, p, v, m) for s in ps.NAMES for p in (2, 4) for v in (1, 2, 3) for m in range(1, 13)
         if not ps.virtual_problem(s, v) and not ps.microbatch_problem(s, p, v, m)]


def test_every_valid_schedule_runs_each_action_once_without_deadlock():
    assert len(VALID) > 150
    for s, p, v, m in VALID:
        orders = ps.action_orders(s, p, v, m)
        owner = ps.stage_ranks(s, p, v)
        seen = [(a.kind, a.stage, a.mb) for r, acts in orders.items() for a in acts]
        assert all(owner[a.stage] == r for r, acts in orders.items() for a in acts)
        assert len(seen) == len(set(seen))
        for stage, mb in itertools.product(range(p * v), range(m)):
            assert ("F", stage, mb) in seen
            assert (("B", stage, mb) in seen) != (("I", stage, mb) in seen and ("W", stage, mb) in seen)
        ps.simulate(orders, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, p * v)  # raises on a deadlock


def test_simulator_detects_a_deadlock():
    orders = ps.action_orders("1F1B", 2, 1, 2)
    orders[1] = list(reversed(orders[1]))  # backward before its forward: can never run
    with pytest.raises(ValueError, match="deadlock"):
        ps.simulate(orders, {"F": 1.0, "B": 2.0}, 2)


@pytest.mark.parametrize("f,b,w", [(1.0, 2.0, 1.0), (1.0, 3.0, 1.5), (2.0, 3.0, 1.0)])
def test_ideal_bubble_matches_the_published_formulas(f, b, w):
    for p, m in itertools.product((2, 4), (4, 8, 16)):
        for s in ("GPipe", "1F1B"):
            r = ps.simulate_schedule(s, p, 1, m, f, b, w)
            assert max(r["idle"].values()) == pytest.approx((p - 1) / (m + p - 1))
            assert r["theory"] == pytest.approx((p - 1) / (m + p - 1))
        r = ps.simulate_schedule("Interleaved1F1B", p, 2, m, f, b, w)
        assert max(r["idle"].values()) == pytest.approx((p - 1) / (2 * m + p - 1))
        if (f, b, w) == (1.0, 2.0, 1.0):  # ZB-H1 with F = I = W: W fills 2/3 of the 1F1B bubble
            r = ps.simulate_schedule("InterleavedZeroBubble", p, 2, m, f, b, w)
            assert max(r["idle"].values()) == pytest.approx(r["theory"])
        for s in ps.V_SHAPED:  # torch's V orders beat the interleaved 1F1B bubble
            if not ps.microbatch_problem(s, p, 2, m):
                r = ps.simulate_schedule(s, p, 2, m, f, b, w)
                assert max(r["idle"].values()) < (p - 1) / (2 * m + p - 1)


def test_peak_activations_per_schedule():
    p, m = 4, 8
    peak = {s: max(ps.simulate_schedule(s, p, 1 if s in ps.SINGLE else 2, m)["peak_activations"].values())
            for s in ps.NAMES}
    assert peak["GPipe"] == m
    assert peak["1F1B"] == p
    assert peak["Interleaved1F1B"] == pytest.approx(p * (1 + (p - 1) / (p * 2)))
    assert peak["ZBVZeroBubble"] == p
    assert peak["DualPipeV"] == p + 0.5


# ---- validation ----------------------------------------------------------------------------

def _resolve(parallel: dict, train: dict | None = None, model: dict | None = None, world: int | None = None):
    cfg = load_config(None, {"model": {"preset": "debug", "n_layers": 8, **(model or {})},
                             "parallel": {"dp_shard": 1, **parallel}, "train": train or {}})
    return checked_layout(cfg.parallel, world or cfg.parallel.pp, cfg.model, 64, cfg.train)


def test_tied_embeddings_and_context_parallel_combine_with_pp():
    # Once refused; the runtime builds both now (parity: test_pipeline_parity.py).
    assert _resolve({"pp": 2}, {"global_batch": 8, "micro_batch": 4}, {"tie_embeddings": True}).pp == 2
    assert _resolve({"pp": 2, "cp": 2}, {"global_batch": 8, "micro_batch": 4}, world=4).cp == 2


ERRORS = [
    ({"pp": 2, "pp_schedule": "Bogus"}, {}, {}, "parallel.pp_schedule"),
    ({"pp": 2, "pp_virtual_stages": 2}, {}, {}, "parallel.pp_virtual_stages"),
    ({"pp": 2, "pp_schedule": "Interleaved1F1B"}, {}, {}, "parallel.pp_virtual_stages"),
    ({"pp": 2, "pp_schedule": "ZBVZeroBubble", "pp_virtual_stages": 3}, {}, {}, "parallel.pp_virtual_stages"),
    ({"pp": 4, "pp_schedule": "1F1B"}, {"global_batch": 8, "micro_batch": 4}, {}, "train.micro_batch"),
    ({"pp": 4, "pp_microbatches": 2}, {"global_batch": 8}, {}, "parallel.pp_microbatches"),
    ({"pp": 4, "pp_schedule": "DualPipeV", "pp_virtual_stages": 2, "pp_microbatches": 4}, {"global_batch": 8}, {},
     "parallel.pp_microbatches"),
    ({"pp": 4, "pp_schedule": "Interleaved1F1B", "pp_virtual_stages": 2}, {"global_batch": 9, "micro_batch": 1}, {},
     "train.micro_batch"),
    ({"pp": 2, "pp_microbatches": 16}, {"global_batch": 8}, {}, "parallel.pp_microbatches"),
    ({"pp": 2, "pp_microbatches": 3}, {"global_batch": 8}, {}, "parallel.pp_microbatches"),
    ({"pp": 2, "pp_microbatches": 4}, {"global_batch": 8, "batch_ramp": [[1000, 6]]}, {}, "parallel.pp_microbatches"),
    ({"pp": 2, "dp_shard": 2}, {"global_batch": 9}, {}, "train.global_batch"),
    ({"pp": 2, "pp_schedule": "ZBVZeroBubble", "pp_virtual_stages": 2, "compile": True}, {}, {}, "parallel.compile"),
    ({"pp": 2, "pp_schedule": "DualPipeV", "pp_virtual_stages": 2, "activation_checkpoint": "selective"}, {}, {},
     "parallel.activation_checkpoint"),
    ({"pp": 4, "pp_split": "llama3"}, {}, {"n_layers": 5}, "parallel.pp_split"),
    ({"pp": 2, "layers_per_stage": [1, 2, 5]}, {}, {}, "parallel.layers_per_stage"),
    ({"pp": 4, "pp_schedule": "Interleaved1F1B", "pp_virtual_stages": 4}, {}, {}, "parallel.pp"),
    ({"pp": 2, "dp_shard": 2, "zero": 2, "reshard_after_forward": False}, {}, {}, "parallel.zero"),
    ({"pp": 1, "pp_schedule": "Bogus"}, {}, {}, "parallel.pp_schedule"),  # a misspelt schedule fails at pp=1 too
]


@pytest.mark.parametrize("parallel,train,model,key", ERRORS)
def test_pipeline_errors_name_their_key(parallel, train, model, key):
    with pytest.raises(ConfigError) as exc:
        _resolve(parallel, train, model, world=parallel.get("pp", 1) * parallel.get("dp_shard", 1))
    assert exc.value.key == key
    assert f"'{key}'" in str(exc.value)


def test_pp_split_value_is_checked_with_the_config():
    with pytest.raises(ConfigError) as exc:
        load_config(None, {"parallel": {"pp_split": "even"}})
    assert exc.value.key == "parallel.pp_split"


def test_valid_pipeline_layouts_resolve():
    assert _resolve({"pp": 4}, {"global_batch": 8, "micro_batch": 2}).pp == 4
    assert _resolve({"pp": 4, "pp_schedule": "DualPipeV", "pp_virtual_stages": 2, "pp_microbatches": 8},
                    {"global_batch": 8}).pp == 4
    # Interleaved runs fewer micro-batches than ranks (one round), and 1F1B exactly pp.
    assert _resolve({"pp": 4, "pp_schedule": "Interleaved1F1B", "pp_virtual_stages": 2},
                    {"global_batch": 8, "micro_batch": 4}).pp == 4


def test_verify_layouts_default_to_a_runnable_microbatch_count(parity_base):
    from ndtrain.tools.verify import layout_config

    parity_base = {**parity_base, "model": {"preset": "debug", "n_layers": 8}}
    cases = {"pp=2,pp_schedule=1F1B": 4, "pp=4,pp_virtual_stages=2,pp_schedule=DualPipeV": 1, "pp=2,dp_shard=2,tp=2": 2,
             "pp=2,ga=4": 2, "dp_shard=2": 4}
    for spec, micro in cases.items():
        assert layout_config(parity_base, spec).train.micro_batch == micro, spec


# ---- the report command --------------------------------------------------------------------

def test_simulate_command_draws_a_gantt(tmp_path, capsys):
    from ndtrain.cli import main

    out = tmp_path / "zbv.png"
    assert main(["pipeline-report", "--simulate", "--schedule", "ZBVZeroBubble,1F1B", "--pp", "2", "-m", "4",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ZBVZeroBubble" in text and "1F1B" in text and "20.0%" in text  # 1F1B: (p-1)/(m+p-1) = 1/5
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["pipeline-report", "--simulate", "--schedule", "1F1B", "--pp", "4", "-m", "2"]) == 2
    assert "at least as many micro-batches" in capsys.readouterr().err

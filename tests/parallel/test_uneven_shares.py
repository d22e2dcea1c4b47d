"""Uneven data-parallel batch shares train the same model as one process on the same global batch:
3 AdamW steps of DDP, ZeRO-3 and ZeRO-1 with [3, 1] / [1, 3] shares (rows 6 and 2 of 8, in
two micro-batches on every rank), and the debug-moe model (its auxiliary loss a mean over
sequences) under DDP, against world 1, in one Gloo group of 2. The tolerance is
test_parity.py's fp32 one (conftest's parity_base says why 1e-5 is real)."""

from __future__ import annotations

import pytest

from ndtrain.config import load_config
from ndtrain.parallel.launch import run_ranks
from ndtrain.tools.verify import layout_config, max_differences, run_steps

FP32_TOL = 1e-5
LAYOUTS = [("dp_replicate=2", [3, 1], "debug"), ("dp_shard=2,zero=3", [3, 1], "debug"),
           ("dp_shard=2,zero=1", [1, 3], "debug"), ("dp_replicate=2", [3, 1], "debug-moe")]


def _run(cfgs, steps):
    from ndtrain.train import step as steps_mod

    out = []
    for cfg in cfgs:
        rows = []
        next_batch = steps_mod.next_batch

        def spy(state):  # the rows and micro-batches this rank trained on
            batch, wait = next_batch(state)
            rows.append([batch.inputs.shape[0], batch.split.micro_batches])
            return batch, wait

        steps_mod.next_batch = spy
        try:
            result = run_steps(cfg, steps)
        finally:
            steps_mod.next_batch = next_batch
        out.append({**result, "rows": rows})
    return out


@pytest.mark.timeout(300)
def test_uneven_shares_match_one_process(parity_base, hang_deadline):
    bases = {preset: {**parity_base, "model": {"preset": preset}} for preset in ("debug", "debug-moe")}
    refs = {preset: run_steps(load_config(None, base), 3) for preset, base in bases.items()}
    cfgs = []
    for spec, shares, preset in LAYOUTS:
        cfg = layout_config(bases[preset], spec)  # micro_batch 4: the 6-row share runs 2 micro-batches
        cfg.parallel.batch_shares = [float(w) for w in shares]
        cfgs.append(cfg)
    per_rank = run_ranks(2, _run, cfgs, 3, timeout_s=hang_deadline(120))
    for i, (spec, shares, preset) in enumerate(LAYOUTS):
        expected_rows = [6 if w == 3 else 2 for w in shares]
        for rank, got in enumerate(r[i] for r in per_rank):
            assert got["rows"] == [[expected_rows[rank], 2]] * 3, spec
            d_loss, d_weight, d_norm = max_differences(refs[preset], got)
            assert d_loss <= FP32_TOL and d_weight <= FP32_TOL and d_norm <= FP32_TOL, \
                f"{preset} {spec} {shares} rank {rank}: Δloss {d_loss:.2e} Δweight {d_weight:.2e} grad-norm {d_norm:.1e}"

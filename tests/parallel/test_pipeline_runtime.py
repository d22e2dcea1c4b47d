"""Pipeline runtime beyond parity, in one world-2 launch: a checkpoint saved by pp=2 with two
stages per rank (first and last stage on rank 0) resumes at world 1 with the same weights and
optimizer state; validation losses (forward-only schedule, and the V-schedule fallback); the
measured timeline."""

from __future__ import annotations

import pytest
import torch

from ndtrain.config import load_config


def _pp_rank(cfg, steps: int, other) -> dict:
    from ndtrain.train.trainer import Trainer

    # A looped schedule validates through torch's forward-only run (V schedules cannot).
    looped = Trainer(other, run_dir=None, log=False)
    looped_losses = [looped.train_step().loss for _ in range(steps)]
    looped_val = looped.validation_loss()
    looped.close()
    trainer = Trainer(cfg, run_dir=None, log=False)
    trainer.state.pipeline.trace = True
    losses = [trainer.train_step().loss for _ in range(steps)]
    ckpt = trainer.checkpointer(None, cfg)
    path = ckpt.save(final=True)
    ckpt.finish()
    out = {"losses": losses, "val": trainer.validation_loss(), "weights": trainer.full_weights(), "path": str(path),
           "rank": trainer.state.rt.rank, "stages": [s.stage_index for s in trainer.state.pipeline.stages],
           "traces": trainer.state.pipeline.traces, "looped": looped_losses + [looped_val]}
    trainer.close()
    return out


@pytest.mark.timeout(300)
def test_checkpoint_reshards_pp_to_world1_and_timeline(parity_base, tmp_path, hang_deadline):
    from ndtrain.parallel.launch import run_ranks
    from ndtrain.tools.pipeline_report import draw_gantt, measured_panel, summarize
    from ndtrain.train.trainer import Trainer

    base = {k: dict(v) for k, v in parity_base.items()}
    base["model"]["n_layers"] = 8
    base["train"].update(micro_batch=2, val_batches=2)
    base["checkpoint"] = {"dir": str(tmp_path / "ckpt")}
    ref_cfg = load_config(None, base)
    pp_cfg = load_config(None, {**base, "parallel": {"pp": 2, "dp_shard": 1, "pp_virtual_stages": 2,
                                                     "pp_schedule": "ZBVZeroBubble"}})

    ref = Trainer(ref_cfg, run_dir=None, log=False)
    ref_losses = [ref.train_step().loss for _ in range(2)]
    ref_val, ref_w2 = ref.validation_loss(), ref.full_weights()
    ref_loss3 = ref.train_step().loss
    ref_w3 = ref.full_weights()

    looped_cfg = load_config(None, {**base, "parallel": {"pp": 2, "dp_shard": 1, "pp_virtual_stages": 2,
                                                         "pp_schedule": "Interleaved1F1B"}})
    ranks = run_ranks(2, _pp_rank, pp_cfg, 2, looped_cfg, timeout_s=hang_deadline(120))
    assert sorted(s for r in ranks for s in r["stages"]) == [0, 1, 2, 3] and ranks[0]["stages"] == [0, 3]
    for r in ranks:  # fp32: reduction order only, 1e-5 as derived in conftest's parity_base docstring
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= 1e-5
        assert abs(r["val"] - ref_val) <= 1e-5
        assert max(abs(a - b) for a, b in zip(r["looped"], ref_losses + [ref_val])) <= 1e-5
    merged = {k: w for r in ranks for k, w in r["weights"].items()}
    assert set(merged) == set(ref_w2)
    assert max(float((merged[k] - ref_w2[k]).abs().max()) for k in ref_w2) <= 1e-5

    # Resume at world 1: weights and AdamW state continue exactly.
    one = Trainer(ref_cfg, run_dir=None, log=False)
    one.checkpointer(None, ref_cfg).load(ranks[0]["path"])
    assert one.step == 2
    loaded = one.full_weights()
    assert max(float((loaded[k] - merged[k]).abs().max()) for k in merged) == 0.0
    assert abs(one.train_step().loss - ref_loss3) <= 1e-5
    resumed = one.full_weights()
    assert max(float((resumed[k] - ref_w3[k]).abs().max()) for k in ref_w3) <= 1e-5

    # The timeline: every action of the last step was recorded, in dependency order.
    for r in ranks:
        assert len(r["traces"]) == 2 and r["traces"][-1]["m"] == 4
        ev = r["traces"][-1]["events"]
        for stage in r["stages"]:
            for mb in range(4):
                f = [e for e in ev if e[:3] == (stage, "F", mb)]
                bw = [e for e in ev if e[0] == stage and e[1] in "BIW" and e[2] == mb]
                assert len(f) == 1 and bw and f[0][4] <= min(e[3] for e in bw)
    s = summarize(ranks, "ZBVZeroBubble", 2, 2)
    assert 0.0 < s["mean_idle"] < 1.0 and s["costs"]["f"] > 0 and s["costs"]["w"] > 0
    png = draw_gantt([measured_panel(ranks, s, 1)], tmp_path / "gantt.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert torch.isfinite(torch.tensor(list(s["idle"].values()))).all()

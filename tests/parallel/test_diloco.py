"""DiLoCo against hand-written references: R single-process replicas, each training on its share
of every global batch, averaged (H=1, outer lr 1, no momentum) or moved by torch's own Nesterov
SGD on θ_sync - mean(θ_r) every H steps. One spawned group checks several layouts."""

from __future__ import annotations

import pytest
import torch

from ndtrain.config import load_config
from ndtrain.parallel.launch import run_ranks
from ndtrain.tools.verify import layout_config

FP32_TOL = 1e-5  # fp32 weights after a few AdamW steps: reduction order only (conftest's parity_base docstring)
DILOCO = ",replicate_sync=diloco"


def _cfg(base: dict, **over):
    merged = {k: dict(v) for k, v in base.items()}
    for section, values in over.items():
        merged.setdefault(section, {}).update(values)
    return load_config(None, merged)


def _replica_trainers(base: dict, replicas: int) -> list:
    """R one-process trainers from the same weights, trainer r reading replica r's share of the data."""
    from ndtrain.data.loader import StatefulLoader
    from ndtrain.train.trainer import Trainer

    cfg = _cfg(base)
    trainers = []
    for r in range(replicas):
        t = Trainer(cfg, None, log=False)
        t.state.loader = StatefulLoader(t.state.train_set, cfg.data.seq_len, cfg.train.seed, r, replicas)
        trainers.append(t)
    return trainers


def reference(base: dict, steps: int, replicas: int, inner: int, lr: float, momentum: float,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """R one-process trainers whose loaders read replica r's share (dp_rank r of R); every H steps
    (and at the last step) θ_sync takes a torch.optim.SGD(nesterov) step on the outer gradient
    θ_sync - mean_r θ_r, sent in `dtype`, and every replica restarts from θ_sync."""
    trainers = _replica_trainers(base, replicas)
    sync = [p.detach().clone() for p in trainers[0].state.params]
    outer = torch.optim.SGD(sync, lr=lr, momentum=momentum, nesterov=momentum > 0)
    for step in range(1, steps + 1):
        for t in trainers:
            t.train_step()
        if step % inner == 0 or step == steps:
            with torch.no_grad():
                for i, s in enumerate(sync):
                    deltas = [(s - t.state.params[i]).to(dtype) for t in trainers]
                    s.grad = torch.stack(deltas).sum(0).float() / replicas
                outer.step()
                for t in trainers:
                    for p, s in zip(t.state.params, sync):
                        p.copy_(s)
    return trainers[0].full_weights()


def averaged_every_step(base: dict, steps: int, replicas: int) -> dict[str, torch.Tensor]:
    """The plainest reference: R replicas whose parameters are averaged after every step."""
    trainers = _replica_trainers(base, replicas)
    for _ in range(steps):
        for t in trainers:
            t.train_step()
        with torch.no_grad():
            for ps in zip(*(t.state.params for t in trainers)):
                mean = sum(p.detach().clone() for p in ps) / replicas
                for p in ps:
                    p.copy_(mean)
    return trainers[0].full_weights()


def _run(specs: list[str], base: dict) -> list[dict]:
    """Per layout: every rank's full weights after cfg.train.steps, the step rows and outer rows."""
    from ndtrain.train.trainer import Trainer

    out = []
    for spec in specs:
        t = Trainer(layout_config(base, spec), None, log=False)
        steps, outer = [], []
        for _ in range(t.state.cfg.train.steps):
            r = t.train_step()
            steps.append({"loss": r.loss, "bytes": r.extra["cross_replica_bytes"], "skipped": r.skipped})
            outer += r.rows  # the outer steps this step ran
        out.append({"weights": t.full_weights(), "steps": steps, "outer": outer,
                    "params": sum(p.numel() for p in t.state.params), "replica": t.state.diloco.replica})
        t.close()
    return out


def _max_diff(ref: dict, got: dict) -> float:
    """Over the tensors `got` holds (a pipeline rank holds its stage's)."""
    assert got and set(got) <= set(ref)
    return max(float((ref[k] - got[k]).abs().max()) for k in got)


def _with(base: dict, **train) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    out["train"].update(train)
    return out


@pytest.mark.timeout(300)
def test_h1_lr1_no_momentum_is_averaging_after_every_step(parity_base, hang_deadline):
    base = _with(parity_base, steps=3)
    spec = "dp_replicate=2" + DILOCO + ",diloco_inner_steps=1,parallel.diloco_outer_lr=1.0,parallel.diloco_outer_momentum=0.0"
    ranks = run_ranks(2, _run, [spec], base, timeout_s=hang_deadline(120))
    ref = averaged_every_step(base, 3, 2)
    for rank in ranks:
        got = rank[0]
        # Each replica computes what the reference's replicas do (the same process-local work), and
        # the average of 2 fp32 values rounds once (2^-24 relative): the weights differ by ulps, far below 1e-6.
        assert _max_diff(ref, got["weights"]) <= 1e-6
        # One outer step per inner step; bytes measured = every parameter in fp32 + the loss
        # scalar + the 4-byte skip flag per step.
        assert [row["outer_step"] for row in got["outer"]] == [1, 2, 3]
        assert all(s["bytes"] == got["params"] * 4 + 8 + 4 for s in got["steps"])
    # Without the sync the replicas would differ: the test can fail.
    assert ranks[0][0]["steps"][0]["loss"] != ranks[1][0]["steps"][0]["loss"]


@pytest.mark.timeout(600)
def test_h2_nesterov_inside_replicas_dp_shard_tp_pp(parity_base, hang_deadline):
    """H=2, outer lr 0.7, Nesterov 0.9, 5 steps (the last outer step is a short round), in four
    layouts of world 4: 2 replicas of dp_shard=2 (HSDP layout; ZeRO-3, -1 and -2), of tp=2, of pp=2,
    and of cp=2."""
    steps = 5
    base = _with(parity_base, steps=steps)
    knobs = DILOCO + ",diloco_inner_steps=2,parallel.diloco_outer_lr=0.7,parallel.diloco_outer_momentum=0.9"
    # ZeRO-3 (the default), ZeRO-1 and ZeRO-2 with two micro-batches: FSDP reduces inside the replica
    # at every stage, and the replicas meet only in the outer step.
    layouts = ["dp_replicate=2,dp_shard=2", "dp_replicate=2,dp_shard=2,zero=1",
               "dp_replicate=2,dp_shard=2,zero=2,ga=2", "dp_replicate=2,tp=2", "dp_replicate=2,pp=2",
               "dp_replicate=2,cp=2"]
    ranks = run_ranks(4, _run, [lay + knobs for lay in layouts], base, timeout_s=hang_deadline(120))
    ref = reference(base, steps, replicas=2, inner=2, lr=0.7, momentum=0.9)
    for i, lay in enumerate(layouts):
        worst = max(_max_diff(ref, rank[i]["weights"]) for rank in ranks)
        assert set().union(*(rank[i]["weights"] for rank in ranks)) == set(ref)
        assert worst <= FP32_TOL, f"{lay}: {worst:.2e}"
        rows = ranks[0][i]["outer"]
        assert [(r["step"], r["outer_step"]) for r in rows] == [(2, 1), (4, 2), (5, 3)]
    # The momentum matters: plain averaging every 2 steps lands elsewhere.
    plain = reference(base, steps, replicas=2, inner=2, lr=1.0, momentum=0.0)
    assert _max_diff(ref, plain) > 100 * FP32_TOL


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streaming_fragments_overlap_and_bf16(parity_base, hang_deadline):
    """Streaming: 2 fragments of H=4 (synced at steps 2, 4, 6, ...), each applied one step late
    and merged with the local fragment; and a bf16 outer gradient. Replicas agree at the end and
    the bytes per outer step are the fragment's, or half of them in bf16."""
    base = _with(parity_base, steps=7)
    streaming = "dp_replicate=2" + DILOCO + ",diloco_inner_steps=4,diloco_fragments=2,diloco_overlap_steps=1"
    bf16 = ("dp_replicate=2" + DILOCO + ",diloco_inner_steps=2,diloco_outer_dtype=bf16"
            ",parallel.diloco_outer_lr=0.7,parallel.diloco_outer_momentum=0.0")
    ranks = run_ranks(2, _run, [streaming, bf16], base, timeout_s=hang_deadline(120))
    a, b = ranks[0][0], ranks[1][0]
    assert _max_diff(a["weights"], b["weights"]) == 0.0  # the final sync leaves one global model
    frag_rows = [(r["step"], r["fragment"], r["sent_at"]) for r in a["outer"]]
    # sent at 2 (fragment 0), 4 (fragment 1), 6 (fragment 0), applied a step later; step 7 is the
    # last: fragment 0's result (sent at 6) landed at 7, then both fragments sync once more.
    assert frag_rows == [(3, 0, 2), (5, 1, 4), (7, 0, 6), (7, 0, 7), (7, 1, 7)]
    ref = reference(base, 7, replicas=2, inner=2, lr=0.7, momentum=0.0, dtype=torch.bfloat16)
    got = ranks[0][1]
    assert _max_diff(ref, got["weights"]) <= 1e-4  # bf16 rounding of the same sums
    assert got["steps"][1]["bytes"] == got["params"] * 2 + 8 + 4


MOE = {"preset": "debug", "n_experts": 4, "n_active_experts": 2, "expert_ffn_dim": 64}


def test_diloco_config_errors_name_their_key():
    from ndtrain.errors import ConfigError
    from ndtrain.parallel.dims import checked_layout

    bad = [({"replicate_sync": "sometimes"}, "parallel.replicate_sync"),
           ({"diloco_inner_steps": 0}, "parallel.diloco_inner_steps"),
           ({"diloco_outer_lr": 0.0}, "parallel.diloco_outer_lr"),
           ({"diloco_outer_momentum": 1.0}, "parallel.diloco_outer_momentum"),
           ({"diloco_fragments": 3, "diloco_inner_steps": 8}, "parallel.diloco_fragments"),
           ({"diloco_overlap_steps": 4, "diloco_inner_steps": 8, "diloco_fragments": 2}, "parallel.diloco_overlap_steps"),
           ({"diloco_outer_dtype": "fp8"}, "parallel.diloco_outer_dtype")]
    for over, key in bad:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, {"parallel": over})
    layout_bad = [({"dp_replicate": 1, "dp_shard": 2}, {}, "parallel.replicate_sync"),
                  ({"dp_replicate": 2, "dp_shard": 1, "auto": True}, {}, "parallel.auto"),
                  ({"dp_replicate": 2, "dp_shard": 1}, MOE, "parallel.replicate_sync"),
                  ({"dp_replicate": 2, "dp_shard": 1, "diloco_fragments": 8, "diloco_inner_steps": 8}, {},
                   "parallel.diloco_fragments")]
    for par, model, key in layout_bad:
        # The layout rule: load_config runs it for every world, checked_layout() for this one.
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            cfg = load_config(None, {"parallel": {"replicate_sync": "diloco", **par}, "model": model or {"preset": "debug"}})
            checked_layout(cfg.parallel, 2, cfg.model)
    ok = load_config(None, {"parallel": {"replicate_sync": "diloco", "dp_replicate": 2, "dp_shard": -1}})
    assert checked_layout(ok.parallel, 4, ok.model).dp_shard == 2


def test_schedule():
    from ndtrain.layout.diloco import fragment_of, last_send, sends_at

    assert [s for s in range(1, 13) if sends_at(s, 4, 1)] == [4, 8, 12]
    assert {s: sends_at(s, 4, 2) for s in range(1, 9) if sends_at(s, 4, 2)} == {2: [0], 4: [1], 6: [0], 8: [1]}
    assert [last_send(0, s, 4, 2) for s in (1, 2, 5, 6, 9)] == [0, 2, 2, 6, 6]
    assert [fragment_of(f"layers.{i}.attention.wq.weight", 3, 8) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert fragment_of("tok_embeddings.weight", 3, 8) == 0 and fragment_of("output.weight", 3, 8) == 7 % 3

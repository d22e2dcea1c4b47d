"""The checkpointer saves and restores any mapping of state objects: here a toy model, its
optimizer, a hand-written progress object and a toy sample counter, with no Trainer anywhere."""

from __future__ import annotations

import json

import torch
from torch import nn

from ndtrain.config import load_config
from ndtrain.train.checkpoint import (TRAIN_STATE, Checkpointer, ModelState, OptimizerState, list_checkpoints, step_name,
                                      verify_checkpoint)
from ndtrain.train.distributed import Runtime


class Progress:  # not checkpoint.TrainProgress: any object with the protocol will do
    def __init__(self):
        self.step, self.tokens_seen, self.note = 0, 0, ""

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "note": self.note}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen, self.note = state["step"], state["tokens_seen"], state["note"]


class Samples:  # stands in for the data loader (train_state.json's "loader" table)
    def __init__(self):
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed, "seed": 7, "seq_len": 4}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed_samples"]


def _toy(seed: int, lr: float = 1e-2):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt


def _checkpointer(cfg, root, model, opt, progress, samples, messages):
    model_state = ModelState([model])
    states = {"model": model_state, "optim": OptimizerState(model_state, opt), "progress": progress,
              "loader": samples}
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    return Checkpointer(cfg, root, states, runtime=runtime, data={"toy": "v1"}, layout="toy", dp_size=1,
                        info=messages.append)


def test_any_mapping_of_state_objects_round_trips(tmp_path):
    cfg = load_config(None, {"checkpoint": {"keep_last": 2}})
    model, opt = _toy(0)
    progress, samples, messages = Progress(), Samples(), []
    ck = _checkpointer(cfg, tmp_path, model, opt, progress, samples, messages)
    for step in (1, 2):
        loss = model(torch.randn(3, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        progress.step, progress.tokens_seen, progress.note = step, 12 * step, f"after {step}"
        samples.consumed = 3 * step
        ck.save()
    ck.finish()
    [c1, c2] = list_checkpoints(tmp_path / "checkpoints")
    assert c2.name == step_name(2) and verify_checkpoint(c2) is None
    saved = json.loads((c2 / TRAIN_STATE).read_text())
    assert (saved["step"], saved["note"], saved["loader"]["consumed_samples"], saved["layout"]) == (2, "after 2", 6, "toy")
    want_w = {k: v.clone() for k, v in model.state_dict().items()}
    want_m = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]

    # A fresh model (other weights), optimizer (another lr), progress and counter: all come back
    # from step 2. (DCP loads tensors in place; the lr, a plain value, needs the load_state_dict.)
    model2, opt2 = _toy(1, lr=1e-3)
    progress2, samples2 = Progress(), Samples()
    ck2 = _checkpointer(cfg, tmp_path, model2, opt2, progress2, samples2, messages)
    assert not torch.equal(model2[0].weight, want_w["0.weight"])
    assert ck2.resume("auto") == c2
    assert (progress2.step, progress2.tokens_seen, progress2.note, samples2.consumed) == (2, 24, "after 2", 6)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want_w[k]), k
    assert all(torch.equal(opt2.state[p]["exp_avg"], m) for p, m in zip(model2.parameters(), want_m))
    assert opt2.param_groups[0]["lr"] == 1e-2
    assert any("resumed from" in m and "at step 2" in m for m in messages), messages
    ck2.finish()

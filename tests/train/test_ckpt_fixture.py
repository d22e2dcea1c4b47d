"""Old checkpoints load: tests/train/fixtures/ckpt_dc37512/ was written by commit dc37512 (before
the checkpoint code became the train/checkpoint/ package) through the ordinary train() path.
Today's code must read its weights and resume it to the same loss. The fixture's make.py says how
it was made; it is rerun only for a new format, never to make this test pass."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from ndtrain.config import load_config
from ndtrain.train.checkpoint import load_model_weights, read_train_state
from ndtrain.train.trainer import train

FIXTURE = Path(__file__).parent / "fixtures" / "ckpt_dc37512"
CKPT = FIXTURE / "checkpoints" / "step_00000002"


def _make_module():
    spec = importlib.util.spec_from_file_location("ckpt_fixture_make", FIXTURE / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_old_checkpoint_weights_load_unchanged():
    expected = json.loads((FIXTURE / "expected.json").read_text())
    weights, state = load_model_weights(CKPT)  # verifies the manifest's hashes; pickles via the allow-list
    assert state["step"] == expected["step"] and read_train_state(CKPT)["tokens_seen"] == expected["tokens_seen"]
    assert {k: float(v.double().sum()) for k, v in weights.items()} == pytest.approx(expected["weight_sums"],
                                                                                   rel=1e-12, abs=1e-12)


@pytest.mark.timeout(120)
def test_old_checkpoint_resumes_to_the_same_loss(tmp_path):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    data, ckpt = tmp_path / "data", tmp_path / "old" / CKPT.name
    shutil.copytree(FIXTURE / "data", data)
    shutil.copytree(CKPT, ckpt)  # the fixture itself is never written to
    cfg = load_config(None, _make_module().config(data, tmp_path / "run", steps=3, resume=str(ckpt)))
    result = train(cfg)
    assert result["steps"] == expected["final_step"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert set(losses) == {3}  # steps 1-2 came from the checkpoint, not from training again
    assert losses[3] == pytest.approx(expected["loss_step3"], rel=1e-5)

"""Async checkpoint staging (issue #28 item 10): pinned, shared-memory, overlapped copies on CUDA;
plain blocking copies on CPU/Gloo; and the overlap's one rule, that the optimizer does not write
the weights before the save's copy of them is complete.

The CUDA staging cannot run here, so its options are asserted from `staging_options`, and its
code path (async staging: dcp.async_save's AsyncSaveResponse, the copy in a background thread,
the trainer waiting before its optimizer step) runs on CPU with the same stager, asked for async
staging without the CUDA-only pinning and non-blocking copies."""

from __future__ import annotations

import time

import pytest
import torch
from ckpt_helpers import assert_bit_identical, cfg_of, job, weights
from torch.distributed.checkpoint.staging import StagingOptions

from ndtrain.train.checkpoint import staging, step_name
from ndtrain.train.trainer import train


def test_staging_options_per_device():
    assert staging.staging_options(torch.device("cuda", 3)) == StagingOptions(
        use_pinned_memory=True, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=True)
    assert staging.staging_options("cuda") == staging.staging_options(torch.device("cuda", 0))
    # CPU ranks on Gloo: blocking copies into ordinary memory (pinning needs CUDA, a non-blocking
    # copy an accelerator).
    assert staging.staging_options(torch.device("cpu")) == StagingOptions(False, False, False, False)


@pytest.mark.timeout(120)
def test_overlapped_staging_saves_the_state_of_its_step(parity_base, tmp_path, monkeypatch):
    """The copy is slowed to 0.5 s, far longer than a step of this model, so without the wait
    before the optimizer step the checkpoint of step 2 would hold step 3's weights."""
    steps = {"steps": 2}
    ref = train(cfg_of(job(parity_base, tmp_path / "ref", train=steps)))  # sync final save at step 2

    async_on_cpu = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                  use_non_blocking_copy=False)
    monkeypatch.setattr(staging, "staging_options", lambda device: async_on_cpu)
    copy = staging.OrderedStager._stage
    waited = []

    def slow_copy(self, state_dict, **kwargs):
        time.sleep(0.5)
        return copy(self, state_dict, **kwargs)

    from ndtrain.train.checkpoint import Checkpointer

    real_wait = Checkpointer.wait_for_staging

    def wait_for_staging(self):
        waited.append(self._staging is not None)
        return real_wait(self)

    monkeypatch.setattr(staging.OrderedStager, "_stage", slow_copy)
    monkeypatch.setattr(Checkpointer, "wait_for_staging", wait_for_staging)
    run = tmp_path / "run"
    train(cfg_of(job(parity_base, run, train={"steps": 4},
                     checkpoint={"interval_steps": 2, "async": True, "keep_last": 5})))
    assert_bit_identical(weights(ref["checkpoint"]), weights(run / "checkpoints" / step_name(2)))
    assert True in waited  # step 3's optimizer step found the copy of step 2 in flight

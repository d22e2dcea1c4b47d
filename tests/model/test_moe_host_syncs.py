"""Host syncs per optimizer step with MoE layers (issue #28 item 10).

On a GPU every read of a device value to the host (`.item()`, `.tolist()`, `float(t)`,
`bool(t)`, `.cpu()`...) waits for the queued kernels, so a read per layer per micro-batch stalls
the launch queue dozens of times a step. A CPU run has no queue to stall, so these tests count
the reads instead: a TorchFunctionMode sees every such call, and only calls made from ndtrain's
own code count (torch's internals read CPU-side scalars such as AdamW's step counts, which are no
device syncs). The check: with several micro-batches a step makes no more reads than with one,
and the MoE statistics are read with the step's values, in its one read.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ndtrain.config import load_config

SRC = str(Path(__file__).resolve().parents[2] / "src" / "ndtrain")
READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy",
         # hidden: CUDA's bincount reads its input's max to the host to size its output
         "bincount"}
# The one read left per MoE layer and micro-batch: capacity dropping gathers the kept
# assignments with nonzero(), whose output size is data-dependent (docs/moe.md).
GATHER = "nonzero"


class HostReads(TorchFunctionMode):
    """Counts device-to-host reads made by ndtrain's code, by (name, file:line)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or name == GATHER:
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(SRC):
                if frame.f_code.co_filename == __file__:
                    frame = None  # the test's own reads do not count
                    break
                frame = frame.f_back
            if frame is not None:
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                self.calls[(name, where)] += 1
        return func(*args, **(kwargs or {}))

    def count(self, names=READS) -> int:
        return sum(n for (name, _), n in self.calls.items() if name in names)


def _trainer(corpus_dir, micro: int):
    from ndtrain.train.trainer import Trainer

    cfg = load_config(None, {"model": {"preset": "debug-moe", "capacity_factor": 1.0, "load_balance": "aux_free"},
                             "data": {"path": str(corpus_dir), "seq_len": 32},
                             "train": {"global_batch": 8, "micro_batch": micro, "seed": 5},
                             "logging": {"tensorboard": False, "progress": "off"}})
    return Trainer(cfg, run_dir=None, log=False)


def _reads_of_one_step(corpus_dir, micro: int) -> HostReads:
    trainer = _trainer(corpus_dir, micro)
    try:
        trainer.train_step()  # the first step builds what later steps reuse
        with HostReads() as reads:
            result = trainer.train_step()
        assert result.extra["moe/layer1/tokens_per_expert"]  # the statistics were produced
        return reads
    finally:
        trainer.close()


@pytest.mark.timeout(120)
def test_host_reads_per_step_do_not_grow_with_micro_batches(corpus_dir):
    one, eight = _reads_of_one_step(corpus_dir, 8), _reads_of_one_step(corpus_dir, 1)
    layers = 3  # debug-moe: layers 1-3 are MoE
    assert eight.count() == one.count(), (
        f"reads per step: {one.count()} with 1 micro-batch, {eight.count()} with 8: {sorted(eight.calls.items())}")
    # One per step: the MoE statistics are read with the step's loss, norm and skip flag, in the
    # one read of its values (step.py's read_steps; Trainer.train_step asks at once).
    assert one.count() == 1, sorted(one.calls.items())
    assert [where.split(":")[0] for (name, where) in one.calls if name in READS] == ["step.py"], one.calls
    # What is left per layer and micro-batch: capacity's gather of the kept assignments.
    assert eight.count({GATHER}) == layers * 8 and one.count({GATHER}) == layers


def test_expert_parallel_regroup_reads_nothing_when_told_the_total():
    """Expert parallel's exchange reads its split sizes to the host once per layer and micro-batch
    (both directions in one read) and hands the received total to regroup_index, which read it
    again otherwise."""
    from ndtrain.parallel.expert import regroup_index

    recv = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [source rank, local expert] rows
    with HostReads() as asked:
        told = regroup_index(recv, 7)
    with HostReads() as alone:
        counted = regroup_index(recv)
    # Source-major rows 0-6 = (src0: e0 e0 e2) (src1: e0 e1 e1 e1), laid out expert-major.
    assert told.tolist() == counted.tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert asked.count() == 0 and alone.count() == 1


@pytest.mark.timeout(300)
def test_a_skipped_step_leaves_the_moe_bias_alone_without_a_read(corpus_dir):
    """The aux-loss-free bias moves by the step's global load on the device, times the step's
    applied flag: a non-finite step leaves it alone, decided without a read; its MoE metrics
    arrive with the step's one read."""
    from ndtrain.train import step as step_module

    trainer = _trainer(corpus_dir, 4)
    state = trainer.state
    biases = lambda: [moe.expert_bias.clone() for _, moe in state.moe]  # noqa: E731
    original = step_module.forward_backward

    def poisoned(*args):
        total = original(*args)
        state.params[0].grad.fill_(float("nan"))
        return total

    try:
        before = biases()
        assert not trainer.train_step().skipped
        moved = biases()
        assert all(not torch.equal(a, b) for a, b in zip(before, moved))  # so the check below can fail
        step_module.forward_backward = poisoned
        try:
            result = step_module.train_step(state, *step_module.next_batch(state))
        finally:
            step_module.forward_backward = original
        assert result.unread and all(torch.equal(a, b) for a, b in zip(moved, biases()))
        assert "moe/imbalance" not in result.extra  # not read yet
        assert result.skipped and "moe/imbalance" in result.extra  # its metrics came with the read
    finally:
        trainer.close()

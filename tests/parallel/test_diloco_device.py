"""Every tensor DiLoCo hands to a collective is on the group's device (issue #28 item 4).

On NCCL the group's device is cuda: a CPU tensor in an all-reduce fails there, but on Gloo it
passes, so a CPU run cannot show the defect with real collectives. This test makes it visible on
one CPU process: the model's parameters live on the "meta" device (the stand-in for cuda: any
tensor DiLoCo creates with a default or literal "cpu" device differs from it), and
torch.distributed's collectives are replaced by recorders that fail at once when a tensor's
device is not the parameters' device. The mesh and subgroups are small fakes (DiLoCo only asks
them for ranks and groups), so no process group is needed and it runs in well under a second.

The case that broke: a fragment this rank holds no parameter of (a pipeline stage holds some of
the layers), whose outer all-reduce was `torch.zeros(0)` on the CPU, and whose outer-gradient
norm all-reduce fell back to a literal "cpu" device. Meta tensors also have no values, so the
test fails as well if DiLoCo reads a value to the host inside the step (the row values are read
once, in take_rows).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ndtrain.parallel.diloco as diloco_mod
from ndtrain.layout import Layout
from ndtrain.parallel.diloco import DiLoCo

DEVICE = torch.device("meta")


class _Done:
    def wait(self):
        return True


def _record(seen: list, name: str):
    """A collective that checks every tensor's device and does nothing else: one rank's
    all-reduce (SUM, MAX) leaves its tensor unchanged."""

    def collective(tensor, *args, **kwargs):
        tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        for t in tensors:
            assert t.device == DEVICE, f"{name} got a tensor on {t.device}, but the run's device is {DEVICE}"
        seen.append((name, tensors[0].device))
        return _Done() if kwargs.get("async_op") else None

    return collective


class _Mesh:
    def __init__(self):
        self.root = SimpleNamespace(mesh=torch.arange(1).view(1), mesh_dim_names=("dp_replicate",))
        self._rep = SimpleNamespace(get_local_rank=lambda: 0, get_group=lambda: "flag-group")

    def __getitem__(self, name):
        assert name == "dp_replicate"
        return self._rep


class _Stage(nn.Module):
    """The last stage of two: it holds layer 1 of 2, so with 2 fragments fragment 0 is empty here."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"1": nn.Linear(4, 4)})


@pytest.fixture
def collectives(monkeypatch):
    seen: list = []
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_to_all_single"):
        monkeypatch.setattr(dist, name, _record(seen, name))
    monkeypatch.setattr(diloco_mod, "own_group", lambda rank_lists, desc: "own-group")
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap,momentum", [(0, 0.9), (1, 0.0)])
def test_every_collective_tensor_is_on_the_model_device(collectives, overlap, momentum):
    par = SimpleNamespace(diloco_outer_lr=0.7, diloco_outer_momentum=momentum)
    dims = Layout(diloco_inner_steps=4, diloco_fragments=2, diloco_overlap_steps=overlap, diloco_outer_dtype="bf16")
    model = _Stage().to(DEVICE)
    steps = 5  # fragment 0 (empty here) sends at 2, fragment 1 at 4, and every fragment at the last step
    d = DiLoCo(par, _Mesh(), dims, [model], steps, n_layers=2)
    assert d.fragments[0] == [] and d.fragments[1]  # the case under test exists
    with torch.no_grad():
        for step in range(1, steps + 1):
            handle = d.agree_start(False, DEVICE)
            for p in model.parameters():
                p.add_(1.0)  # an inner step moved the replica
            assert handle[0].device == DEVICE
            d.after_inner_step(step, loss=2.5)
    names = [name for name, _ in collectives]
    # The recorders saw everything: a skip flag per step, and per send (the empty fragment 0 at
    # 2, fragment 1 at 4, both at the last step) the outer gradient, the loss and the norm.
    assert names.count("all_reduce") == steps + 3 * 4
    state = d.state_dict(pending=[0, 1])
    for key, part in state.items():
        for name, t in part.items():
            assert t.device == DEVICE, f"state_dict()[{key!r}][{name!r}] is on {t.device}"

"""tools/dryrun_watch.py's operator count: the watch answers a fake tensor's device itself (the
question torch's C++ asks on nearly every operator) and still counts each one."""

from __future__ import annotations

from collections import Counter

import torch

from ndtrain.compat.fake import fake_tensor_mode, op_watcher
from ndtrain.tools.dryrun_watch import Watch


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = (x @ w).relu().view(-1)
    y.sum().backward()
    return y


def test_every_operator_is_counted_the_device_questions_too():
    seen: Counter = Counter()

    def passing(func, args, kwargs):
        seen[func] += 1
        return func(*args, **kwargs)

    with fake_tensor_mode(), op_watcher(passing):
        _step(torch.empty(4, 8), torch.empty(8, 8, requires_grad=True))
    watch = Watch()
    watch.phase = "forward"
    with fake_tensor_mode(), op_watcher(watch.on_op):
        y = _step(torch.empty(4, 8), torch.empty(8, 8, requires_grad=True))
    assert seen[torch.ops.prim.device.default] > 0
    assert sum(watch.ops.values()) == sum(seen.values())
    assert y.device == torch.device("cpu") and y.shape == (32,)

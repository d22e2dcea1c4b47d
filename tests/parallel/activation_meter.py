"""Measure activation memory as the bytes autograd keeps for backward (test and benchmark code:
tests/parallel/test_context_parallel.py imports it, benchmarks/context_parallel.py too, through
sys.path).

Process RSS mixes in the allocator's caching, parameters, optimizer state and transient
workspaces, and on CPU it never goes down; the tensors saved for backward are what grows with
sequence length and what context parallel divides. So we count those, through
`saved_tensors_hooks`: every saved tensor's storage is counted once (views of one buffer share
it) while any saved reference to it is alive, and parameters (leaves that require grad, and
views of them such as a transposed weight) are not activations and are skipped.
"""

from __future__ import annotations

import torch


class ActivationBudgetExceeded(RuntimeError):
    """Saved activations outgrew the meter's budget (a stand-in for running out of memory)."""


class _Ref:
    """Packed form of a saved tensor; its release (after backward) decrements the count."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        meter = self.meter
        if meter is not None and self.key is not None:
            meter._release(self.key)


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


class SavedActivationMeter:
    """`with SavedActivationMeter() as m: loss.backward()...`; then `m.peak_bytes`. With
    `budget_bytes`, saving past the budget raises `ActivationBudgetExceeded`."""

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict = {}  # storage key -> [bytes, references]
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        local = t.to_local() if hasattr(t, "to_local") else t
        if _is_parameter(t) or local.device.type == "meta":
            return _Ref(t, None, None)
        storage = local.untyped_storage()
        key = (local.device, storage.data_ptr())
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1]
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
            if self.budget_bytes is not None and self.current_bytes > self.budget_bytes:
                raise ActivationBudgetExceeded(
                    f"saved activations reached {self.current_bytes / 2**20:.1f} MiB, over the "
                    f"{self.budget_bytes / 2**20:.1f} MiB budget")
        else:
            entry[1] += 1
        return _Ref(t, self, key)

    @staticmethod
    def _unpack(ref: _Ref) -> torch.Tensor:
        return ref.tensor

    def _release(self, key) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current_bytes -= entry[0]
            del self._live[key]

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None

"""What a dry run sees of one rank's step, operator by operator (tools/dryrun.py drives it).

Every operator reaches `Watch.on_op` below autograd and DTensor, so each tensor it meets is a
local shard, and fake: a storage with a size but no memory. The watch keeps:
- the live bytes of every storage (created by an operator, or grown by `UntypedStorage.resize_`,
  which FSDP2 uses to gather and free unsharded parameters), and the set that was live at the
  peak, each storage with the phase that made it (build, forward, backward, optimizer) and
  whether FSDP (its copy in/out, its storage resizes) or another collective touched it;
  `categories` sorts the peak's bytes into parameters, gradients, optimizer state,
  communication buffers (FSDP's, and what a collective touched outside the forward),
  activations (made by a forward and still held, a collective's output among them: TP's
  reduce-scatter outputs, the ring's K/V, the experts' exchanged rows) and temporaries (the
  rest) once the step has run;
- the operators launched, per phase;
- each collective: its kind, the mesh dimension its group is, the bytes of its input and the
  bytes in the planner's convention (planner/comm.py: all-gather its output, the rest their input);
- each read of a device value on the host that fake tensors cannot answer (a GPU pays a sync
  for each): where in ndtrain it happened; the read answers a stand-in value so the step goes on.
"""

from __future__ import annotations

import linecache
import os
import sys
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.flop_counter import flop_registry

from ndtrain.compat.fake import fake_tensor_class, host_read_op, op_schema, real_tensors
from ndtrain.compat.torch import recomputing

# Input arguments of torch's collectives, by the names their schemas give them.
_INPUTS = {"tensors", "input_tensor", "input_tensors", "inputs", "input"}
_GATHERS = ("allgather", "all_gather")
# What touching a storage makes it: FSDP's own operators gather parameters and build reduce-scatter
# inputs (communication buffers wherever made); any other collective's tensors are buffers only
# outside the forward (a forward's collective output kept for the backward is an activation).
_COMM_KIND = {"fsdp": "fsdp", "c10d": "collective", "_c10d_functional": "collective"}
CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication_buffers", "activations", "temporaries")
# A host read that fake tensors cannot answer gets this value: finite, so the step takes its
# usual path (clipping, the optimizer) rather than skipping the update as non-finite.
STAND_IN = 1.0
_SRC = Path(__file__).resolve().parents[1]  # the ndtrain package: where a host read is reported
_SRC_PREFIX = str(_SRC) + os.sep


class Watch:
    def __init__(self):
        self.phase = "build"
        self.shadow = 0  # > 0 inside DTensor's shape inference: global-shape work no device does
        self.flops = 0  # of the step (torch.utils.flop_counter's formulas), from step_started on
        self._counting = False
        self.ops: Counter = Counter()  # phase -> operators launched
        self.collectives: dict = defaultdict(lambda: {"calls": 0, "input_bytes": 0, "bytes": 0})  # (kind, group)
        self.host_reads: list[str] = []
        self.answer = None  # set: what a read fake tensors cannot answer returns instead of STAND_IN
        self._read = host_read_op()
        self._entries: dict[int, list] = {}  # id(storage) -> [serial, bytes, phase, comm, weakref]
        self._serial = 0
        self.live = 0
        self.peak = 0
        self._peak_pending = False
        self.peak_set: dict[int, tuple] = {}  # serial -> (bytes, phase, comm), at the peak
        self.peak_phase = ""

    # ---- storages -----------------------------------------------------------------------------
    def _track(self, t: torch.Tensor, comm: str = "") -> None:
        if t.device.type == "meta":  # the model as built before it is materialised: no memory anywhere
            return
        st = t.untyped_storage()
        entry = self._entries.get(id(st))
        if entry is None:
            self._serial += 1
            ref = weakref.ref(st, self._freed(id(st)))
            entry = [self._serial, 0, self.phase, comm, ref]
            self._entries[id(st)] = entry
            self._resized(entry, st.nbytes())
        elif comm and entry[3] != "fsdp":
            entry[3] = comm

    def _freed(self, key: int):
        def gone(_ref) -> None:
            entry = self._entries.get(key)
            if entry is not None:
                # still listed while it falls: a peak this free ends is taken with it
                self._resized(entry, 0)
                del self._entries[key]
        return gone

    def _resized(self, entry: list, nbytes: int) -> None:
        if nbytes < entry[1] and self._peak_pending:  # the first fall after a new peak: keep what was live
            self.peak_set = {e[0]: (e[1], e[2], e[3]) for e in self._entries.values() if e[1]}
            self._peak_pending = False
        self.live += nbytes - entry[1]
        entry[1] = nbytes
        if self.live > self.peak:
            self.peak, self.peak_phase, self._peak_pending = self.live, self.phase, True

    def finish(self) -> None:
        """Closes the peak: one still rising at the end is the last state."""
        if self._peak_pending:
            self.peak_set = {e[0]: (e[1], e[2], e[3]) for e in self._entries.values() if e[1]}
            self._peak_pending = False

    def storage_resized(self, st, nbytes: int) -> None:
        """FSDP2 gathers a parameter into, and frees it from, a storage it resizes."""
        if self.shadow:
            return
        entry = self._entries.get(id(st))
        if entry is None:
            self._serial += 1
            entry = [self._serial, 0, self.phase, "fsdp", weakref.ref(st, self._freed(id(st)))]
            self._entries[id(st)] = entry
        entry[3] = "fsdp"
        self._resized(entry, nbytes)

    def serials(self, tensors) -> set[int]:
        """The serial numbers of these tensors' (local) storages."""
        out = set()
        for t in tensors:
            if t is None:
                continue
            entry = self._entries.get(id(local_tensor(t).untyped_storage()))
            if entry is not None:
                out.add(entry[0])
        return out

    def categories(self, params: set, grads: set, optim: set) -> dict[str, int]:
        """The peak's bytes by category; `params`, `grads`, `optim`: the serials of the
        parameters' local shards, of the gradients the optimizer read, of its state."""
        out = dict.fromkeys(CATEGORIES, 0)
        for serial, (nbytes, phase, comm) in self.peak_set.items():
            if serial in params:
                key = "parameters"
            elif serial in grads:
                key = "gradients"
            elif serial in optim:
                key = "optimizer_state"
            elif comm == "fsdp" or (comm and phase != "forward"):
                key = "communication_buffers"
            elif phase == "forward":
                key = "activations"
            else:
                key = "temporaries"
            out[key] += nbytes
        return out

    # ---- operators ------------------------------------------------------------------------------
    def on_op(self, func, args, kwargs):
        phase = self.phase
        if phase in ("forward", "backward"):
            phase = "backward" if recomputing() else "forward"
            self.phase = phase
        if func is _DEVICE and not self.shadow:
            t = args[0]
            if isinstance(t, fake_tensor_class()) and not t.fake_mode.in_kernel_invocation:
                # A fake tensor's device, asked by torch's C++ on nearly every operator: answered
                # here as the fake mode would answer it, without a second dispatch down to it.
                self.ops[phase] += 1
                return t.fake_device
        inputs = _tensors(args, kwargs)
        kinds = _kinds(inputs)
        if kinds == _REAL:  # a device mesh's rank tables (real, made before the fake mode)
            with real_tensors():
                return func(*args, **kwargs)
        if self.shadow:  # uncounted; a read there (a stand-in's shard offsets) is no step's
            return self._host_read(func, args, kwargs, False) if func is self._read else func(*args, **kwargs)
        if kinds & _WRAPPER:  # a DTensor's operator: passed on, it comes back here as its shards' own
            return NotImplemented
        self.ops[phase] += 1
        if func is self._read:
            return self._host_read(func, args, kwargs)
        comm = _COMM_KIND.get(func.namespace, "")
        if comm == "collective":
            self._collective(func, args, kwargs)
        out = func(*args, **kwargs)
        if self._counting:
            formula = flop_registry.get(func.overloadpacket)
            if formula is not None:
                self.flops += formula(*args, **kwargs, out_val=out)
        for t in _tensors(out):
            self._track(t, comm)
        if comm:
            for t in inputs:
                self._track(t, comm)
        return out

    def step_started(self) -> None:
        """From here on the watch counts FLOPs and host reads belong to the step."""
        self._counting = True
        self.host_reads = []

    def collective_table(self, groups: dict[str, str]) -> dict:
        """{kind: {mesh dimension: {calls, input_bytes, bytes}}}, `groups` naming each group."""
        out: dict = {}
        for (kind, group), row in sorted(self.collectives.items()):
            dim = groups.get(group, f"group {group}")
            cell = out.setdefault(kind, {}).setdefault(dim, {"calls": 0, "input_bytes": 0, "bytes": 0})
            for k, v in row.items():
                cell[k] += v
        return out

    def _host_read(self, func, args, kwargs, record: bool = True):
        try:
            return func(*args, **kwargs)  # a value fake tensors know (a constant)
        except Exception:  # noqa: BLE001 - fake tensors refuse data-dependent reads in several ways
            if record and self._counting:  # the build's reads are no step's (and finding the line costs)
                self.host_reads.append(_where())
            return STAND_IN if self.answer is None else self.answer()

    def _collective(self, func, args, kwargs) -> None:
        name, arg_names = op_schema(func)
        name = name.strip("_")
        if name.startswith("wait"):
            return
        bound = dict(zip(arg_names, args)) | kwargs
        group = bound.get("group_name")
        if group is None:
            pg = dist.ProcessGroup.unbox(bound["process_group"])
            group, size = pg.group_name, pg.size()
        else:
            size = bound.get("group_size") or 1
        nbytes = sum(t.numel() * t.element_size() for k, v in bound.items() if k in _INPUTS for t in _tensors(v))
        row = self.collectives[(_kind(name), str(group))]
        row["calls"] += 1
        row["input_bytes"] += nbytes
        row["bytes"] += nbytes * size if name.startswith(_GATHERS) else nbytes


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's bytes: a DTensor's local shard, and inside torchao's fp8
    all-gather weight wrapper (fp8 with FSDP) the fp32 tensor it wraps."""
    t = t.to_local() if hasattr(t, "to_local") else t
    inner = getattr(t, "_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _kind(name: str) -> str:
    for prefix, kind in (("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("allgather", "all_gather"),
                         ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
                         ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"), ("broadcast", "broadcast"),
                         ("send", "send"), ("recv", "recv")):
        if name.startswith(prefix):
            return kind
    return name


_DEVICE = torch.ops.prim.device.default
_FAKE, _REAL, _WRAPPER = 1, 2, 4  # _kinds' bits


def _kinds(tensors: list) -> int:
    """What the operator's tensors are, as bits: fake, real, or a wrapper (DTensor) around others."""
    fake, kinds = fake_tensor_class(), 0
    for t in tensors:
        kinds |= _FAKE if isinstance(t, fake) else _REAL if type(t) is torch.Tensor else _WRAPPER
    return kinds


def _tensors(*objs) -> list:
    """The tensors in these (nested lists, tuples and dicts), in order. A list built in one pass,
    not a recursive generator: it runs on every operator's arguments and results."""
    out: list = []
    for obj in objs:
        _collect(obj, out)
    return out


def _collect(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                _collect(x, out)
    elif isinstance(obj, dict):
        _collect(tuple(obj.values()), out)


def _where() -> str:
    """The innermost ndtrain line (outside the dry run's own tools) that read a device value.
    Walks the frames itself: traceback.extract_stack formats every frame of a deep stack."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_SRC_PREFIX):
            rel = name[len(_SRC_PREFIX):]
            if not os.path.basename(rel).startswith("dryrun") and os.path.dirname(rel) != "compat":
                line = linecache.getline(name, frame.f_lineno).strip()
                return f"{_SRC.name}/{rel}:{frame.f_lineno} {line}"
        frame = frame.f_back
    return "outside ndtrain"


def enter_shadow(watch: Watch) -> None:
    watch.shadow += 1


def leave_shadow(watch: Watch) -> None:
    watch.shadow -= 1


@contextmanager
def watching_resize(watch: Watch):
    """UntypedStorage.resize_ reaches no operator mode; FSDP2 gathers parameters with it."""
    original = torch.UntypedStorage.resize_

    def resize_(st, size):
        out = original(st, size)
        watch.storage_resized(st, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original

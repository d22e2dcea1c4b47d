"""The dry run's doors into torch's private testing and dispatch machinery (tools/dryrun*.py):
a process group of N ranks inside one process, tensors that carry shapes but no memory, and a
mode that sees every operator below autograd and DTensor. Each name is listed in
compat/torch.py's PRIVATE, like every other private torch name; a torch without one refuses
`ndtrain dryrun` in one line and changes nothing else."""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import weakref

from ndtrain.compat.torch import PRIVATE, find, require


def init_fake_group(rank: int, world: int) -> None:
    """torch.distributed's default group as rank `rank` of `world`, with torch's `fake` backend:
    every collective returns at once and moves nothing (the dry run counts what it would move)."""
    import torch.distributed as dist

    dist.init_process_group("fake", store=require("fake_store")(), rank=rank, world_size=world)


def fake_tensor_mode():
    """Tensors with shapes, dtypes and strides but no data; real tensors met inside become fake.
    Its dispatch cache's hits take the cheaper key and output of compat/fake_cache.py."""
    from ndtrain.compat.fake_cache import quicken

    mode = require("fake_tensor_mode")(allow_non_fake_inputs=True)
    quicken(mode)
    return mode


def host_read_op():
    """The operator every read of a device value on the host goes through (.item(), float(),
    .tolist(), a Python `if` on a tensor)."""
    return require("local_scalar_dense").default


def op_watcher(on_op):
    """A context manager that hands every operator call to `on_op(func, args, kwargs)` (whose
    return value is the call's result), below autograd and tensor subclasses: the ops a device
    would launch, on local shards."""
    base = require("dispatch_mode")

    class OpWatcher(base):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # torch wraps a mode's __torch_dispatch__ to keep Dynamo out of it: two more Python
            # calls on every operator; a dry run compiles nothing.
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = on_op(func, args, kwargs or {})
            return _with_result(out) if func.namespace == "c10d" else out

    return OpWatcher()


def op_schema(func) -> tuple[str, list[str]]:
    """(an operator's name without its namespace, its arguments' names)."""
    schema = func._schema
    return schema.name.split("::")[-1], [a.name for a in schema.arguments]


def is_fake(t) -> bool:
    """A fake tensor itself (a DTensor of fake shards is not one: its operators reach the
    watcher twice, as the DTensor's and then as its shards')."""
    return isinstance(t, fake_tensor_class())


@functools.cache
def fake_tensor_class() -> type:
    """Looked up once: the watch asks about every tensor of every operator."""
    return require("fake_tensor")


def real_tensors():
    """A context in which operators on real tensors run for real (a device mesh's rank tables,
    made before the tensors turned fake)."""
    return require("unset_fake")()


@contextlib.contextmanager
def dtensor_shape_inference(enter, leave):
    """Calls `enter()` and `leave()` around DTensor's shape inference: it runs an operator once on
    fake tensors of the global shapes (a whole vocabulary's logits, every optimizer state at full
    size) to learn its output's shape; no device runs that, so the dry run must not count it."""
    key = "dtensor_shape_inference"
    infer = require(key)
    owner = importlib.import_module(PRIVATE[key].module)
    for part in PRIVATE[key].attr.split(".")[:-1]:
        owner = getattr(owner, part)

    def watched(self, *args, **kwargs):
        enter()
        try:
            return infer(self, *args, **kwargs)
        finally:
            leave()

    setattr(owner, infer.__name__, watched)
    try:
        yield
    finally:
        setattr(owner, infer.__name__, infer)


def count_cpu_attention_flops() -> None:
    """torch's FLOP formulas cover the GPU attention kernels but not the CPU flash kernel a CPU
    (and so a dry) run calls: the same formulas, registered for it (once per process), at half
    for a causal call: a flash kernel skips the masked half of the scores (torch's formulas count
    the whole square), as the ring attention skips the blocks no query sees, so a rank's count is
    the work it does either way (layout/flops.py's "causal")."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

    forward, backward = require("sdpa_cpu_flash"), require("sdpa_cpu_flash_backward")
    if forward not in flop_registry:
        register_flop_formula(forward)(
            lambda q, k, v, dropout_p=0.0, is_causal=False, *_, out_shape=None, **__:
            sdpa_flop_count(q, k, v) // (2 if is_causal else 1))
    if backward not in flop_registry:
        register_flop_formula(backward)(
            lambda grad, q, k, v, out, lse, dropout_p, is_causal, *_, out_shape=None, **__:
            sdpa_backward_flop_count(grad, q, k, v) // (2 if is_causal else 1))


def count_grouped_mm_flops() -> None:
    """torch's FLOP formulas have none for the grouped GEMM MoE experts run (model/moe.py): 2 x
    output elements x the contraction, which for 2D x 2D (a weight gradient, grouped along the
    contraction) is 2 x a x N x b over all groups together (once per process)."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    op = find("grouped_mm_op")
    if op is None or op in flop_registry:
        return

    def flops(a_shape, b_shape, *_, out_shape=None, **__) -> int:
        if len(a_shape) == 2 and len(b_shape) == 2:
            return 2 * a_shape[0] * a_shape[1] * b_shape[1]
        return 2 * math.prod(out_shape) * a_shape[-1]

    register_flop_formula(op)(flops)


@contextlib.contextmanager
def swappable_fake_parameters():
    """Module.to_empty swaps a fake parameter for its materialised one in place (torch swaps
    whenever a parameter is fake), so that what holds the parameter object (DDP's reducer, set
    up before materialising as a real run sets it up) holds the materialised one. The swap
    refuses a tensor that has a weak reference, and the fake mode's memo of converted tensors
    keeps one to each parameter. Only for the swap, the two tensors leave that memo: it serves
    converting the same real tensor twice, which no parameter is."""
    import torch.utils

    require("fake_tensor_memo")
    swap = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        for t in (t1, t2):
            mode = getattr(t, "fake_mode", None)
            if mode is None:
                continue
            memo = mode.fake_tensor_converter.tensor_memo
            for key in [r.key for r in weakref.getweakrefs(t) if isinstance(r, weakref.KeyedRef)]:
                memo.pop(key, None)
        return swap(t1, t2)

    torch.utils.swap_tensors = swap_tensors
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


def _with_result(out):
    """A c10d collective's (outputs, work) with a work whose future holds the outputs, as a real
    backend's does. The fake backend's future holds nothing, and DDP's reducer reads the reduced
    bucket from it (torch asserts a tensor there)."""
    import torch

    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.ScriptObject)):
        return out
    done = torch.futures.Future()
    done.set_result(out[0])
    return out[0], require("work_from_future")(done).boxed()


@contextlib.contextmanager
def ddp_without_shape_check():
    """DDP checks at its start that every rank holds parameters of the same shapes: a C++ gather
    of the shapes written into a tensor's data, which a fake tensor has none of. One process
    holds the only rank there is to compare, so the check is left out for the dry run."""
    key = "ddp_verify_shapes"
    check = require(key)
    owner = importlib.import_module(PRIVATE[key].module)
    setattr(owner, PRIVATE[key].attr, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        setattr(owner, PRIVATE[key].attr, check)


@contextlib.contextmanager
def pipeline_neighbours(forward_metas):
    """torch's pipeline stages learn their neighbours' tensors on the first step: a vote over the
    pipeline ranks on how (every ndtrain stage is built without example tensors, so every vote is
    for inferring them), then the activations' metadata sent down the stages and the gradients'
    back up. On the fake group nothing arrives; the dry run answers for the neighbours:
    - the vote: this rank's own stages' (each rank builds its stages the same way);
    - a forward's input from the stage before: `forward_metas(stage)`, the dry run's;
    - a backward's output gradients from the stage after: what torch derives from this stage's
      own outputs (the next stage's input is this stage's output, its gradient of that meta).
    What this rank would send is not sent (a few hundred bytes once; nothing would receive it)."""
    from torch.distributed.pipelining import PipelineStage as stage_cls

    keys = ("stage_recv_meta", "stage_send_meta", "stage_vote_result")
    originals = {key: require(key) for key in keys}
    forward_cls, backward_cls = require("stage_forward_meta"), require("stage_backward_meta")
    derive, dynamic = require("stage_grad_metas"), require("stage_inference_mode")

    def recv_meta(stage, src_stage: int):
        if src_stage < stage.stage_index:
            return forward_cls(forward_metas=forward_metas(stage))
        return backward_cls(backward_metas=derive(stage._stage_meta.outputs))

    def vote_result(stage, received_result=None):
        import torch

        return torch.tensor([0 if dynamic.needs_dynamic(stage._user_meta, True) else 1], dtype=torch.int32)

    patches = {"stage_recv_meta": recv_meta, "stage_send_meta": lambda stage, meta, dst_stage: None,
               "stage_vote_result": vote_result}
    for key, fn in patches.items():
        setattr(stage_cls, PRIVATE[key].attr.split(".")[-1], fn)
    try:
        yield
    finally:
        for key, fn in originals.items():
            setattr(stage_cls, PRIVATE[key].attr.split(".")[-1], fn)

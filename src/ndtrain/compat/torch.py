"""torch's private names, reached through one door (docs/torch-compat.md).

ndtrain uses a few parts of torch that carry no compatibility promise: a leading underscore, an
internal module, a method torch keeps for itself. Each is listed once in PRIVATE (what it is for,
what happens without it) and looked up lazily, on first use (only selective checkpointing's op
sets are collected as parallel/activation.py is imported, leaving a missing op out); the CPU-only
ones (oneDNN linears, Gloo's reduce-scatter) are looked up on a CPU path only, never on a GPU run.
A missing name either falls back (same numbers, slower or less instrumented) or refuses with one
line naming it and the torch version; where a name's meaning decides a result (`_StridedShard` in
the gradient norm) its behaviour is probed first.

Supported: torch 2.11 to 2.13. Tested on 2.13; 2.11 and 2.12 were read from their wheels'
sources (each name below looked up, its signature compared with 2.13's). What differs:
- `PipelineStage._compute_outputs` exists from 2.12. torch 2.11 infers a stage's shapes in
  `PipelineStage._shape_inference`, which calls the stage's module itself; both are wrapped.
- `_StridedShard` takes SymInt split factors from 2.13; what the placement means and its
  `_split_tensor` signature are the same in all three, and the probe checks the meaning anyway.
Every other name here exists with the same signature in 2.11, 2.12 and 2.13.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import warnings
from dataclasses import dataclass

from ndtrain.errors import NdtrainError

SUPPORTED = "2.11 to 2.13"
REFUSED = "refused: one line naming it"


@dataclass(frozen=True)
class Private:
    module: str  # imported on first use
    attr: str  # dotted path inside the module
    used_for: str
    if_missing: str
    instance: bool = False  # the last part is an attribute of instances, set in __init__
    since: str = ""  # the first supported torch that has it, where not the first of SUPPORTED
    until: str = ""  # the last supported torch that has it, where not the last

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


def _p(path: str, attr: str, used_for: str, if_missing: str = REFUSED, **kwargs) -> Private:
    return Private(path, attr, used_for, if_missing, **kwargs)


_FSDP_API = "torch.distributed.fsdp._fully_shard._fsdp_api"
_STAGE = "torch.distributed.pipelining.stage"
_PP_UTILS = "torch.distributed.pipelining._utils"
_SDPA = "the context-parallel ring's block attention kernels (parallel/block_attention.py)"
_MARKERS = ("profiler ranges selective checkpointing ignores (parallel/activation.py)",
            "fallback: not ignored (torch may refuse a recompute inside an FSDP unit)")
_ALLOW = ("the allow-list that reads DCP's .metadata without unpickling code (train/checkpoint/store.py)",
          "refused: reading the metadata names the class it met")
_LOOP = "fallback: one op per tensor"
PRIVATE: dict[str, Private] = {
    "local_shape_and_offset": _p("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
                                 "initialising a sharded parameter's local window (model/init.py)"),
    "graph_task_id": _p("torch._C", "_current_graph_task_id",
                        "MoE: not counting routing statistics twice under activation recompute (model/moe.py)"),
    "onednn_linear": _p("torch", "ops.mkldnn._linear_pointwise", "CPU fp32 linears through oneDNN (model/linear.py)",
                        "fallback: the BLAS (nn.Linear's own path)"),
    "replicate": _p("torch.distributed._composable.replicate", "replicate",
                    "plain data parallelism on torch's DDP reducer (parallel/data_parallel.py)"),
    "fsdp_reduce_scatter": _p(_FSDP_API, "ReduceScatter",
                              "FSDP2's reduce-scatter through all-to-all on Gloo (parallel/gloo_reduce_scatter.py)",
                              "fallback: Gloo's own reduce-scatter (same sums, an all-reduce's bytes)"),
    "unshard_async": _p("torch.distributed.fsdp", "FSDPModule._set_unshard_async_op",
                        "FSDP2 on CPU: all-gathers overlapping compute (parallel/data_parallel.py)",
                        "fallback: blocking all-gathers"),
    "mesh_flatten": _p("torch.distributed.device_mesh", "DeviceMesh._flatten",
                       "one mesh dimension over several (dp_shard x cp, ...) (parallel/dims.py)"),
    "mesh_unflatten": _p("torch.distributed.device_mesh", "DeviceMesh._unflatten",
                         "the expert-parallel view of the dp x cp ranks (parallel/dims.py)"),
    "async_collective_tensor": _p("torch.distributed._functional_collectives", "AsyncCollectiveTensor",
                                  "waiting for TP's embedding output before a compiled block (parallel/tensor.py)",
                                  "fallback: no wait (tests/parallel/test_tp_compile.py says if compiled TP needs it)"),
    "checkpoint_wrapper": _p("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper",
                             "activation checkpointing of blocks (parallel/activation.py)"),
    "record_function_enter": _p("torch", "ops.profiler._record_function_enter_new", *_MARKERS),
    "record_function_exit": _p("torch", "ops.profiler._record_function_exit", *_MARKERS),
    **{f"sdpa_{key}": _p("torch", f"ops.aten._scaled_dot_product_{op}", _SDPA) for key, op in (
        ("cpu_flash", "flash_attention_for_cpu"), ("cpu_flash_backward", "flash_attention_for_cpu_backward"),
        ("flash", "flash_attention"), ("flash_backward", "flash_attention_backward"),
        ("efficient", "efficient_attention"), ("efficient_backward", "efficient_attention_backward"))},
    "grouped_mm_op": _p("torch", "ops.aten._grouped_mm", "the dry run's FLOPs of MoE experts (compat/fake.py)",
                        "fallback: the experts' grouped GEMMs are not counted"),
    "scaled_mm": _p("torch", "_scaled_mm", "fp8 peak probes (calibrate/peak_flops.py, host_probe.py, calibrate/gpu.py)",
                    "fallback: the host probe reports no fp8; metrics and calibration refuse fp8"),
    **{f"foreach_{op}": _p("torch", f"_foreach_{op}",
                           "DiLoCo's outer Nesterov step (parallel/diloco.py), clipping (parallel/grad_norm.py)", _LOOP)
       for op in ("mul_", "add_", "add")},
    "amp_scaling_step": _p("torch.optim", "AdamW._step_supports_amp_scaling",
                           "skipping a non-finite step on the device, through GradScaler's `found_inf` (train/step.py)",
                           "fallback: the step's values are read on the host every step", instance=True),
    "foreach_norm": _p("torch", "_foreach_norm", "calibration's optimizer timing (calibrate/host_costs.py)", _LOOP),
    "dcp_set_element": _p("torch.distributed.checkpoint._nested_dict", "set_element",
                          "loading non-tensor values with weights_only=True (train/checkpoint/store.py)"),
    "dcp_storage_info": _p("torch.distributed.checkpoint.filesystem", "_StorageInfo", *_ALLOW),
    "dcp_mem_format": _p("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", *_ALLOW),
    "dcp_get_layout": _p("torch.serialization", "_get_layout", *_ALLOW),
    "staging_stream": _p("torch.distributed.checkpoint.staging", "DefaultStager._staging_stream",
                         "ordering an async checkpoint's copy after the optimizer step (train/checkpoint/staging.py)",
                         "fallback: the host waits for the step before staging", instance=True),
    "strided_shard": _p("torch.distributed.tensor.placement_types", "_StridedShard",
                        "counting FSDP-over-TP shards in the gradient norm (parallel/grad_norm.py)",
                        "refused if it does not split as assumed; an unknown placement is refused"),
    "stage_compute_outputs": _p(_STAGE, "PipelineStage._compute_outputs",
                                "pipeline shape inference in eval mode, out of MoE statistics (parallel/pipeline.py)",
                                "fallback: PipelineStage._shape_inference, else a warning", since="2.12"),
    "stage_shape_inference": _p(_STAGE, "PipelineStage._shape_inference", "the same, on torch 2.11",
                                "fallback: a warning", until="2.11"),
    "pytree_logger": _p("torch.utils._pytree", "__name__", "quieting torchao's import-time notice (parallel/float8.py)",
                        "fallback: nothing to quiet"),
    "redistribute_logger": _p("torch.distributed.tensor._redistribute", "__name__",
                              "quieting FSDP x TP gathers' expected warning (train/state.py full_weights)",
                              "fallback: nothing to quiet"),
    "dtensor_local_tensor": _p("torch.distributed.tensor", "DTensor._local_tensor",
                               "fp8 checkpoints: the fp32 tensor inside torchao's weight wrapper (parallel/float8.py)",
                               "fallback: DTensor.to_local()", instance=True),
    **{key: _p(module, attr, "the dry run: N ranks' group, fake tensors, watching every op (tools/dryrun*.py)",
                 "refused: `ndtrain dryrun` only")
       for key, module, attr in (("fake_store", "torch.testing._internal.distributed.fake_pg", "FakeStore"),
                                 ("fake_tensor_mode", "torch._subclasses.fake_tensor", "FakeTensorMode"),
                                 ("dispatch_mode", "torch.utils._python_dispatch", "TorchDispatchMode"),
                                 ("local_scalar_dense", "torch", "ops.aten._local_scalar_dense"),
                                 ("fake_tensor", "torch._subclasses.fake_tensor", "FakeTensor"),
                                 ("dtensor_shape_inference", "torch.distributed.tensor._sharding_prop",
                                  "ShardingPropagator._propagate_tensor_meta_non_cached"),
                                 ("unset_fake", "torch._subclasses.fake_tensor", "unset_fake_temporarily"),
                                 ("fake_tensor_memo", "torch._subclasses.fake_tensor",
                                  "FakeTensorConverter.tensor_memo"),
                                 ("work_from_future", "torch._C._distributed_c10d", "_create_work_from_future"),
                                 ("ddp_verify_shapes", "torch.nn.parallel.distributed",
                                  "_verify_param_shape_across_processes"),
                                 ("stage_recv_meta", _STAGE, "PipelineStage._recv_meta"),
                                 ("stage_send_meta", _STAGE, "PipelineStage._send_meta"),
                                 ("stage_vote_result", _STAGE, "PipelineStage._warmup_backward_result"),
                                 ("stage_forward_meta", _PP_UTILS, "_StageForwardMeta"),
                                 ("stage_backward_meta", _PP_UTILS, "_StageBackwardMeta"),
                                 ("stage_grad_metas", _PP_UTILS, "_derive_grad_metas"),
                                 ("stage_tensor_meta", _PP_UTILS, "extract_tensor_meta"),
                                 ("stage_inference_mode", _PP_UTILS, "InferenceMode"))},
    **{key: _p("torch._subclasses.fake_tensor", attr,
               "the dry run: a cheaper hit in the fake mode's dispatch cache (compat/fake_cache.py)",
               "fallback: torch's own key and output (the same figures, slower)")
       for key, attr in (("fake_cache_key_args", "FakeTensorMode._prep_args_for_hash"),
                         ("fake_cache_output", "FakeTensorMode._output_from_cache_entry"),
                         ("fake_kernel_invocation", "in_kernel_invocation_manager"),
                         ("fake_tensor_metadata", "TensorMetadata"))},
    "flex_validate_device": _p("torch.nn.attention.flex_attention", "_validate_device",
                               "tests only: running flex attention's backward on CPU", "the tests that use it fail"),
}

_DCP_PUBLIC = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                              "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"}, "builtins": {"set", "frozenset", "slice"},
}


def version() -> str:
    return importlib.import_module("torch").__version__


def find(key: str):
    """The object PRIVATE[key] names, or None where this torch has no such name (for an instance
    attribute, the class that sets it: only an instance can tell)."""
    p = PRIVATE[key]
    parts = p.attr.split(".")
    try:
        obj = importlib.import_module(p.module)
        for part in parts[:-1] if p.instance else parts:
            obj = getattr(obj, part)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return obj


def missing(key: str) -> str:
    p = PRIVATE[key]
    return (f"torch {version()} has no {p.name}, which ndtrain uses for {p.used_for}; "
            f"ndtrain supports torch {SUPPORTED}")


def require(key: str):
    """As find, but a missing name is one NdtrainError line."""
    obj = find(key)
    if obj is None:
        raise NdtrainError(missing(key))
    return obj


# ---- model ---------------------------------------------------------------------------------

def recomputing() -> bool:
    """Whether autograd is running a backward now (activation checkpointing re-runs forwards there).
    Plain attribute access, no importlib: it runs inside compiled MoE blocks, traced by Dynamo."""
    import torch

    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:
        raise NdtrainError(missing("graph_task_id"))
    return task_id() != -1


def local_shape_and_offset(shape, mesh, placements):
    return require("local_shape_and_offset")(shape, mesh, placements)


def _onednn_flops(a_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """a [n, k] @ w[m, k]^T: FlopCounterMode counts it as it counts the BLAS's matmul."""
    return 2 * math.prod(a_shape[:-1]) * a_shape[-1] * w_shape[0]


def onednn_linear():
    """oneDNN's linear op, or None (the BLAS then). Its FLOP formula is registered on the first
    look-up: a FlopCounterMode opened before that counts none of its matmuls, so model/linear.py
    looks it up as soon as a model lands on CPU."""
    op = find("onednn_linear")
    if op is not None:
        from torch.utils.flop_counter import flop_registry, register_flop_formula

        if op not in flop_registry:
            register_flop_formula(op)(_onednn_flops)
    return op


# ---- parallel ------------------------------------------------------------------------------

def fsdp_reduce_scatter_base() -> type:
    """FSDP2's reduce-scatter interface, or `object` where it is gone (then it is not installed)."""
    return find("fsdp_reduce_scatter") or object


def set_unshard_async(module) -> bool:
    """FSDP2's asynchronous all-gathers for every FSDP module under `module`, where torch has them."""
    fn = getattr(module, "_set_unshard_async_op", None)
    return fn is not None and fn(True) is None


def flatten_mesh(mesh, name: str):
    return require("mesh_flatten")(mesh, name)


def unflatten_mesh(mesh, dim: int, sizes, names):
    return require("mesh_unflatten")(mesh, dim, sizes, names)


def present_ops(*names: str) -> set:
    """The default overloads of `names` ("namespace.op") this build has; the others are left out."""
    import torch

    found = set()
    for name in names:
        space, op = name.split(".")
        packet = getattr(getattr(torch.ops, space), op, None) if hasattr(torch.ops, space) else None
        if packet is not None and hasattr(packet, "default"):
            found.add(packet.default)
    return found


def aten_op(key: str):
    """The default overload of a private op in PRIVATE (the ring attention kernels)."""
    packet = find(key)
    if packet is None:
        raise NdtrainError(missing(key))
    return packet.default


def profiler_markers() -> set:
    """The profiler's range ops (FSDP marks its work with them), for SAC_IGNORED_OPS."""
    enter, exit_ = find("record_function_enter"), find("record_function_exit")
    return ({enter.default} if enter is not None else set()) | \
        ({exit_._RecordFunction} if exit_ is not None and hasattr(exit_, "_RecordFunction") else set())


def splits_tensor(placement) -> bool:
    """Whether a DTensor placement gives each rank of its mesh dimension a distinct part of the
    tensor (the gradient norm multiplies such dimensions' sizes). A placement this code does not
    know is refused: counting it as replicated would give a wrong norm without a word."""
    from torch.distributed.tensor import Replicate, Shard

    if type(placement) in (Shard, Replicate):  # the common cases, without a look-up per parameter
        return type(placement) is Shard
    strided = find("strided_shard")
    if strided is not None and isinstance(placement, strided):
        problem = _strided_shard_problem(strided)
        if problem:
            raise NdtrainError(f"gradient clipping: torch {version()}'s {PRIVATE['strided_shard'].name} no longer "
                               f"splits a tensor into distinct shards ({problem}); the norm would be wrong. ndtrain "
                               f"supports torch {SUPPORTED}")
        return True
    if placement.is_shard():
        return True
    if placement.is_replicate() or placement.is_partial():
        return False
    raise NdtrainError(f"gradient clipping: torch {version()} placement {placement!r} ({type(placement).__name__}) "
                       f"is unknown to ndtrain, which cannot count its shards; ndtrain supports torch {SUPPORTED}")


@functools.cache  # one answer per installed class: the probe is a fact about this torch
def _strided_shard_problem(cls) -> str:
    """'' when _StridedShard(0, split_factor=2) over 3 ranks hands each a distinct third of the
    tensor, as the norm assumes (FSDP's shards of TP's shards); else what it did instead."""
    import torch

    whole = torch.arange(12)
    try:
        pieces, _ = cls(0, split_factor=2)._split_tensor(whole, 3, with_padding=False)
        got = [p.tolist() for p in pieces]
    except Exception as exc:  # a changed signature: anything may come back
        return f"{type(exc).__name__}: {exc}"
    flat = sorted(x for p in got for x in p)
    if len(got) != 3 or any(len(p) != 4 for p in got) or flat != whole.tolist():
        return f"12 elements over 3 ranks came out as {got}"
    return ""


@contextlib.contextmanager
def _eval(module):
    was_training = module.training
    module.train(False)
    try:
        yield
    finally:
        module.train(was_training)


def shape_inference_in_eval(stage) -> bool:
    """On a schedule's first step torch runs each stage once more to infer shapes. That forward is
    not training: run it in eval mode, so it stays out of per-step statistics (MoE routing loads,
    which drive the aux-loss-free bias update). False (with a warning) where neither hook exists."""
    compute = getattr(stage, "_compute_outputs", None)  # torch 2.12 and later
    if compute is not None:
        def compute_outputs(*args, module, **kwargs):
            with _eval(module):
                return compute(*args, module=module, **kwargs)

        stage._compute_outputs = compute_outputs
        return True
    infer = getattr(stage, "_shape_inference", None)  # torch 2.11: calls stage.submod itself
    if infer is not None:
        def shape_inference(*args, **kwargs):
            with _eval(stage.submod):
                return infer(*args, **kwargs)

        stage._shape_inference = shape_inference
        return True
    warnings.warn(f"torch {version()} has neither {PRIVATE['stage_compute_outputs'].name} nor _shape_inference: "
                  f"a pipeline's first step counts torch's shape-inference forward in MoE routing statistics",
                  stacklevel=2)
    return False


def dtensor_local(t):
    """A DTensor's local tensor itself, with no autograd view in between (the fp8 weight wrapper
    inside it must stay what it is); `to_local()` where torch renames the attribute; else `t`."""
    local = getattr(t, "_local_tensor", None)
    if local is None and hasattr(t, "to_local"):
        local = t.to_local()
    return t if local is None else local


def async_collective_tensor():
    return find("async_collective_tensor")


def torch_logger(key: str) -> logging.Logger:
    """One of torch's own module loggers by PRIVATE key (named, not imported)."""
    return logging.getLogger(PRIVATE[key].module)


# ---- train ---------------------------------------------------------------------------------

def _foreach(key: str, one):
    """torch's fused op, or the same op tensor by tensor."""
    def loop(tensors, *rest, **kwargs):  # a list argument pairs element-wise, a scalar goes to each
        return [one(t, *[r[i] if isinstance(r, (list, tuple)) else r for r in rest], **kwargs)
                for i, t in enumerate(tensors)]

    return find(key) or loop


def foreach_mul_(tensors, scalar) -> None:
    _foreach("foreach_mul_", lambda t, s: t.mul_(s))(tensors, scalar)


def foreach_add_(tensors, others, **alpha) -> None:
    _foreach("foreach_add_", lambda t, o, **a: t.add_(o, **a))(tensors, others, **alpha)


def foreach_add(tensors, others, **alpha) -> list:
    return _foreach("foreach_add", lambda t, o, **a: t.add(o, **a))(tensors, others, **alpha)


def skips_on_device(optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` device flag, the door torch's GradScaler
    uses (fused AdamW sets the flag in __init__; foreach and for-loop AdamW do not)."""
    attr = PRIVATE["amp_scaling_step"].attr.rsplit(".", 1)[-1]
    return bool(getattr(optimizer, attr, False))


def step_unless(optimizer, found_inf) -> None:
    """One `optimizer.step()` that leaves weights, moments and step counts alone where the device
    scalar `found_inf` is non-zero; only for an optimizer that `skips_on_device`."""
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        optimizer.found_inf = None


def foreach_norm(tensors) -> list:
    import torch

    return _foreach("foreach_norm", lambda t: torch.linalg.vector_norm(t))(tensors)


def dcp_set_element():
    return require("dcp_set_element")


def dcp_metadata_allowlist() -> dict[str, set[str]]:
    """module -> class names DCP's .metadata pickle may name: the public classes and the private
    ones torch pickles into it (a name torch drops is simply refused when met)."""
    out = {module: set(names) for module, names in _DCP_PUBLIC.items()}
    for key in ("dcp_storage_info", "dcp_mem_format", "dcp_get_layout"):
        p = PRIVATE[key]
        out.setdefault(p.module, set()).add(p.attr)
    return out


_MISSING = object()


def order_staging_after_caller(stager) -> None:
    """Make DefaultStager's side-stream copy wait for the work already queued on the caller's
    stream (the optimizer step just before a save). Where the stream's attribute is gone the
    host waits for the caller's stream instead: slower, the same bytes."""
    import torch

    side = getattr(stager, "_staging_stream", _MISSING)
    if side is _MISSING:
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()
    elif side is not None:
        side.wait_stream(torch.accelerator.current_stream())

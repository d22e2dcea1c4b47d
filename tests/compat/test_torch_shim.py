"""compat/torch.py, the one door to torch's private names: each name resolves on this torch, and
each one made missing (monkeypatched away) gives its fallback or a one-line refusal naming it and
the torch version. The source outside compat reaches none of them (read with ast), and a GPU
run's import path looks none of the CPU-only ones up."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ndtrain.compat import torch as compat
from ndtrain.compat.torch import PRIVATE
from ndtrain.errors import NdtrainError

SRC = Path(__file__).resolve().parents[2] / "src" / "ndtrain"


def _gone(monkeypatch, key: str) -> None:
    """PRIVATE[key] as a torch without that name would look it up."""
    monkeypatch.setitem(PRIVATE, key, dataclasses.replace(PRIVATE[key], attr=PRIVATE[key].attr + "_gone"))


def _one_line_refusal(exc: pytest.ExceptionInfo, key: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and torch.__version__ in text and compat.SUPPORTED in text
    assert PRIVATE[key].name.replace("_gone", "") in text.replace("_gone", "")


# ---- every name resolves here ---------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(PRIVATE))
def test_each_private_name_resolves_on_this_torch(key):
    obj, p = compat.find(key), PRIVATE[key]
    def version(v: str) -> tuple:
        return tuple(int(x) for x in v.split("+")[0].split(".")[:2])

    here = version(torch.__version__)
    if (p.until and here > version(p.until)) or (p.since and here < version(p.since)):
        assert obj is None, f"{p.name} is said to exist on torch {p.since or ''}-{p.until or ''} only"
        return
    assert obj is not None, compat.missing(key)
    attr = p.attr.rsplit(".", 1)[-1]
    if key == "staging_stream":  # set in __init__: only an instance has it
        from torch.distributed.checkpoint.staging import StagingOptions

        assert hasattr(obj(StagingOptions(False, False, False, False)), attr)
    elif key == "amp_scaling_step":  # set in __init__ of a fused optimizer
        assert getattr(obj([torch.nn.Parameter(torch.zeros(1))], fused=True), attr) is True
    elif p.instance:  # a slot (DTensor's): declared on the class
        assert attr in getattr(obj, "__slots__", ()) or attr in getattr(obj, "__annotations__", {})


def test_a_missing_name_is_one_line_naming_it_and_the_version(monkeypatch):
    _gone(monkeypatch, "dcp_set_element")
    assert compat.find("dcp_set_element") is None
    with pytest.raises(NdtrainError) as exc:
        compat.dcp_set_element()
    _one_line_refusal(exc, "dcp_set_element")


# ---- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("key, call", [
    ("local_shape_and_offset", lambda: compat.local_shape_and_offset((4,), None, ())),
    ("mesh_flatten", lambda: compat.flatten_mesh(None, "dp_cp")),
    ("mesh_unflatten", lambda: compat.unflatten_mesh(None, 0, (1,), ("x",))),
    ("sdpa_cpu_flash", lambda: compat.aten_op("sdpa_cpu_flash")),
    ("replicate", lambda: __import__("ndtrain.parallel.data_parallel", fromlist=["x"])
        .apply_ddp(nn.Linear(2, 2), None)),
    ("checkpoint_wrapper", lambda: __import__("ndtrain.parallel.activation", fromlist=["x"])
        .apply_activation_checkpointing(nn.Module(), "full")),
    ("scaled_mm", lambda: __import__("ndtrain.calibrate.peak_flops", fromlist=["x"])._probe_rate(
        torch.device("cpu"), torch.float8_e4m3fn, 16, 1)),
])
def test_a_missing_name_that_has_no_fallback_is_refused(monkeypatch, key, call):
    _gone(monkeypatch, key)
    with pytest.raises(NdtrainError) as exc:
        call()
    _one_line_refusal(exc, key)


def test_a_missing_cuda_attention_op_is_refused(monkeypatch):
    assert compat.aten_op("sdpa_flash") is torch.ops.aten._scaled_dot_product_flash_attention.default
    _gone(monkeypatch, "sdpa_flash")
    with pytest.raises(NdtrainError) as exc:
        compat.aten_op("sdpa_flash")
    _one_line_refusal(exc, "sdpa_flash")


def test_recompute_detection_and_its_refusal(monkeypatch):
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(compat.recomputing())  # inside a backward: what activation recompute sees
            return g

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [True] and not compat.recomputing()
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(NdtrainError) as exc:
        compat.recomputing()
    _one_line_refusal(exc, "graph_task_id")


# ---- fallbacks -----------------------------------------------------------------------------

def test_onednn_linear_registers_its_flops_and_falls_back_to_the_blas(monkeypatch):
    from torch.utils.flop_counter import flop_registry

    from ndtrain.model.linear import Linear

    op = compat.onednn_linear()
    assert op is torch.ops.mkldnn._linear_pointwise and op in flop_registry
    layer = Linear(8, 4)
    x = torch.randn(3, 8)
    assert type(layer(x).grad_fn).__name__ == "_OneDnnLinearBackward"
    _gone(monkeypatch, "onednn_linear")
    y = layer(x)
    assert type(y.grad_fn).__name__ != "_OneDnnLinearBackward"
    assert torch.equal(y, nn.functional.linear(x, layer.weight, layer.bias))


def test_fsdp_hooks_fall_back_to_fsdp2s_own(monkeypatch):
    assert compat.fsdp_reduce_scatter_base().__name__ == "ReduceScatter"
    calls = []

    class Root:
        def _set_unshard_async_op(self, on):
            calls.append(on)

    assert compat.set_unshard_async(Root()) and calls == [True]
    assert not compat.set_unshard_async(object())  # a torch without it: blocking all-gathers
    _gone(monkeypatch, "fsdp_reduce_scatter")
    assert compat.fsdp_reduce_scatter_base() is object
    from ndtrain.parallel.data_parallel import overlap_on_gloo

    class Block:
        def set_modules_to_forward_prefetch(self, nxt):
            calls.append(len(nxt))

        def modules(self):
            raise AssertionError("the custom reduce-scatter is not installed without its interface")

    overlap_on_gloo([Block()], Block())  # returns before looking for FSDP modules
    assert calls == [True, 1]


def test_tp_embedding_wait_without_async_collective_tensor(monkeypatch):
    from ndtrain.parallel.tensor import _wait_embedding_output

    assert compat.async_collective_tensor().__name__ == "AsyncCollectiveTensor"
    _gone(monkeypatch, "async_collective_tensor")
    t = torch.ones(2)
    assert _wait_embedding_output(None, (), t) is t


def test_profiler_markers_and_present_ops(monkeypatch):
    assert len(compat.profiler_markers()) == 2
    assert compat.present_ops("aten.mm", "aten._no_such_op", "no_such_space.op") == {torch.ops.aten.mm.default}
    _gone(monkeypatch, "record_function_enter")
    _gone(monkeypatch, "record_function_exit")
    assert compat.profiler_markers() == set()


def test_foreach_fallbacks_compute_torchs_values(monkeypatch):
    def run():
        a = [torch.arange(3.0), torch.ones(2)]
        b = [torch.full((3,), 0.5), torch.full((2,), 2.0)]
        compat.foreach_mul_(a, 3.0)
        compat.foreach_add_(a, b)
        out = compat.foreach_add(a, b, alpha=0.25)
        compat.foreach_add_(a, out, alpha=-0.1)
        return [*a, *out, *compat.foreach_norm(a)]

    fused = run()
    for key in ("foreach_mul_", "foreach_add_", "foreach_add", "foreach_norm"):
        _gone(monkeypatch, key)
    looped = run()
    assert all(torch.equal(x, y) for x, y in zip(looped[:4], fused[:4]))  # element-wise: the same roundings
    # A norm sums 2-3 squares: the fused kernel may add them in another order (<= 2 x 2^-24 relative).
    assert all(torch.allclose(x, y, rtol=1e-6, atol=0) for x, y in zip(looped[4:], fused[4:]))


def test_staging_waits_for_the_caller_with_or_without_torchs_stream(monkeypatch):
    events = []

    class Stream:
        def wait_stream(self, other):
            events.append(("side waits", other))

        def synchronize(self):
            events.append("host waits")

    class Stager:
        _staging_stream = Stream()

    monkeypatch.setattr(torch.accelerator, "current_stream", lambda: "compute")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    compat.order_staging_after_caller(Stager())
    Stager._staging_stream = None  # CPU, or no async staging: nothing to order
    compat.order_staging_after_caller(Stager())
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda: Stream())
    compat.order_staging_after_caller(object())  # a torch that renamed it: the host waits instead
    assert events == [("side waits", "compute"), "host waits"]


def test_dtensor_local_falls_back_to_to_local():
    class Renamed:  # a DTensor whose local tensor attribute torch renamed
        def to_local(self):
            return "local"

    class Wrapping:
        _local_tensor = "inner"

    plain = torch.ones(1)
    assert compat.dtensor_local(Wrapping()) == "inner" and compat.dtensor_local(Renamed()) == "local"
    assert compat.dtensor_local(plain) is plain


def test_loggers_and_dcp_allow_list_name_torchs_modules():
    assert compat.torch_logger("pytree_logger").name == "torch.utils._pytree"
    allow = compat.dcp_metadata_allowlist()
    assert "_StorageInfo" in allow["torch.distributed.checkpoint.filesystem"]
    assert {"Metadata", "_MEM_FORMAT_ENCODING"} <= allow["torch.distributed.checkpoint.metadata"]


# ---- _StridedShard: probed, and unknown placements refused ----------------------------------

def test_placements_split_as_the_gradient_norm_assumes():
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    assert compat.splits_tensor(Shard(0)) and compat.splits_tensor(_StridedShard(0, split_factor=2))
    assert not compat.splits_tensor(Replicate()) and not compat.splits_tensor(Partial())
    assert compat._strided_shard_problem(_StridedShard) == ""


def test_a_strided_shard_that_no_longer_splits_is_refused(monkeypatch):
    from torch.distributed.tensor import placement_types

    class Duplicating(placement_types._StridedShard):  # every rank would get the same piece
        def _split_tensor(self, tensor, num_chunks, **kwargs):
            return [tensor[:4]] * num_chunks, []

    monkeypatch.setattr(placement_types, "_StridedShard", Duplicating)
    with pytest.raises(NdtrainError, match="no longer splits a tensor into distinct shards") as exc:
        compat.splits_tensor(Duplicating(0, split_factor=2))
    assert "\n" not in str(exc.value) and torch.__version__ in str(exc.value)


def test_the_gradient_norm_refuses_a_placement_it_does_not_know():
    from torch.distributed.tensor import Shard

    from ndtrain.parallel.grad_norm import shard_count

    class NewPlacement:  # what a torch upgrade may add: counted as replicated, the norm would be wrong
        def is_shard(self):
            return False

        is_replicate = is_partial = is_shard

    class Mesh:
        def size(self, dim):
            return 2

    class Grad:
        device_mesh, placements = Mesh(), (Shard(0), NewPlacement())

        def to_local(self):
            return self

    with pytest.raises(NdtrainError, match="NewPlacement.*unknown to ndtrain"):
        shard_count(None, Grad())
    Grad.placements = (Shard(0), Shard(1))
    assert shard_count(None, Grad()) == 4


# ---- the pipeline: shape inference in eval mode, instrumented only while tracing ------------

class _Stage:
    """Just enough of a PipelineStage for Pipeline's constructor."""

    def __init__(self, hook: str):
        self.submod, self.num_stages, self.stage_index = nn.Linear(2, 2), 1, 0
        self.is_first = self.is_last = True
        self.modes = []
        if hook == "_compute_outputs":
            self._compute_outputs = lambda *a, module, **k: self.modes.append(module.training)
        elif hook == "_shape_inference":
            self._shape_inference = lambda *a, **k: self.modes.append(self.submod.training)

    def forward_one_chunk(self, chunk, *args, **kwargs):
        return "torch's"

    backward_one_chunk = backward_weight_one_chunk = forward_one_chunk


@pytest.mark.parametrize("hook", ["_compute_outputs", "_shape_inference"])  # torch 2.12+, torch 2.11
def test_shape_inference_runs_in_eval_mode(hook):
    stage = _Stage(hook)
    assert compat.shape_inference_in_eval(stage)
    getattr(stage, hook)((), module=stage.submod) if hook == "_compute_outputs" else getattr(stage, hook)(())
    assert stage.modes == [False] and stage.submod.training  # eval inside, training again after


def test_shape_inference_without_either_hook_warns():
    with pytest.warns(UserWarning, match="MoE routing statistics"):
        assert not compat.shape_inference_in_eval(_Stage("none"))


def test_pipeline_stages_are_instrumented_only_while_tracing():
    from ndtrain.parallel.pipeline import Pipeline

    stage = _Stage("_compute_outputs")
    pipe = Pipeline([stage], "1F1B", 1, 1, 1, torch.arange(4))
    assert "forward_one_chunk" not in vars(stage) and stage.forward_one_chunk(0) == "torch's"
    pipe.trace = True
    assert {"forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"} <= set(vars(stage))
    pipe._events, pipe._t0 = [], 0.0
    assert stage.forward_one_chunk(3) == "torch's" and pipe._events[0][:3] == (0, "F", 3)
    pipe.trace, pipe.traces = False, []
    assert "forward_one_chunk" not in vars(stage) and pipe.trace is False


# ---- nothing outside compat reaches private torch -------------------------------------------

# Names with a leading underscore read off objects outside compat that are not torch's: Python's
# own, Tensor._base (documented: a view's base tensor), read by the activation meter, and
# torchao's float8 weight wrapper's `_tensor` (parallel/float8.py).
_NOT_TORCH = {"_exit", "_base", "_asdict", "_replace", "_fields", "_make", "_getframe", "_tensor"}
_TORCH_PRIVATE_STRING = re.compile(r"torch(\.\w+)*\._\w+(\.\w+)*")


@functools.cache  # the source is read once for the tests below
def _parsed(root: Path) -> dict:
    return {p: ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}


def private_torch_uses(root: Path) -> list[str]:
    """file:line what, for every private torch name the code (not its comments or docstrings) uses
    outside compat/: imports of private torch modules or names, `torch.<...>._x` chains, private
    attributes read off objects (ndtrain's own private names aside), torch module names in strings."""
    trees = {p: t for p, t in _parsed(root).items() if "compat" not in p.relative_to(root).parts}
    nodes = {p: list(ast.walk(tree)) for p, tree in trees.items()}
    ours = set()
    for path in trees:  # ndtrain's own names: its defs, classes, variables and attributes of its own objects
        for node in nodes[path]:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                       or node.attr.startswith("_ndtrain"))):  # not torch's, set from outside (a patch)
                ours.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
    found = []
    for path in trees:
        docstrings = {id(n.body[0].value) for n in nodes[path]
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        where = f"{path.relative_to(root)}"
        for node in nodes[path]:
            what = None
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names = [a.name for a in node.names]
                if "._" in node.module or any(n.startswith("_") for n in names):
                    what = f"from {node.module} import {', '.join(names)}"
            elif isinstance(node, ast.Import):
                what = next((a.name for a in node.names if a.name.startswith("torch") and "._" in a.name), None)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root_name = node.value
                while isinstance(root_name, ast.Attribute):
                    root_name = root_name.value
                rooted_in_torch = isinstance(root_name, ast.Name) and root_name.id == "torch"
                if rooted_in_torch or (node.attr not in ours and node.attr not in _NOT_TORCH):
                    what = ast.unparse(node)
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and _TORCH_PRIVATE_STRING.fullmatch(node.value)):
                what = repr(node.value)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name = node.args[1].value
                if name.startswith("_") and not name.startswith("__") and name not in ours | _NOT_TORCH:
                    what = ast.unparse(node)
            if what:
                found.append(f"{where}:{node.lineno} {what}")
    return found


def test_no_private_torch_outside_compat():
    uses = private_torch_uses(SRC)
    assert not uses, "private torch outside compat/torch.py:\n" + "\n".join(uses)


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        '"""torch._docstrings_are_prose"""\n'
        "import torch\n"
        "from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "x = torch._C._current_graph_task_id()\n"
        "def f(mesh, self):\n"
        "    self._mine = 1\n"
        "    return mesh._flatten('x'), self._mine, mesh._mine\n"
        "name = 'torch.utils._pytree'\n"
        "ok = hasattr(torch, '_scaled_mm'), getattr(mesh, '_mine', None)\n")
    found = private_torch_uses(pkg)
    lines = sorted(int(f.split(" ", 1)[0].split(":")[1]) for f in found)
    assert lines == [3, 4, 5, 5, 8, 9, 10]  # not the docstring (1), nor ndtrain's own `_mine` (7, 8, 10)


# ---- a GPU run's import path looks up none of the CPU-only names ----------------------------

_CPU_ONLY = {"onednn_linear", "fsdp_reduce_scatter", "unshard_async"}


def test_cpu_only_names_are_imported_inside_cpu_branches_only():
    """No module imports gloo_reduce_scatter (FSDP2's private reduce-scatter interface) at its top:
    only inside a function (data_parallel.overlap_on_gloo, on CPU meshes; calibration)."""
    top = [p.relative_to(SRC) for p, tree in _parsed(SRC).items()
           for node in tree.body
           if isinstance(node, (ast.Import, ast.ImportFrom)) and "gloo_reduce_scatter" in ast.unparse(node)]
    assert not top


def test_building_a_model_off_cpu_looks_up_no_cpu_only_name(monkeypatch):
    """Built and parallelised on meta, as a GPU run builds before materialising on its GPU."""
    from ndtrain.layout import Layout
    from ndtrain.model.config import preset
    from ndtrain.model.llama import build_model
    from ndtrain.parallel.compose import parallelize

    seen = []

    class Recording(dict):
        def __getitem__(self, key):
            seen.append(key)
            return super().__getitem__(key)

    monkeypatch.setattr(compat, "PRIVATE", Recording(PRIVATE))
    parallelize(build_model(preset("debug"), "meta"), Layout(activation_checkpoint="selective"))
    assert not _CPU_ONLY & set(seen)
    parallelize(build_model(preset("debug"), "cpu"), Layout())  # on CPU it is looked up
    assert "onednn_linear" in seen


@pytest.mark.slow
def test_a_fresh_interpreter_building_off_cpu_looks_up_no_cpu_only_name(hang_deadline):
    """The same in a fresh interpreter (this one has run CPU paths): what a GPU run imports, and a
    model built and parallelised on meta, leave oneDNN's FLOP formula and Gloo's module alone."""
    code = (
        "import sys, torch\n"
        "from torch.utils.flop_counter import flop_registry\n"
        "import ndtrain.train.trainer, ndtrain.parallel.compose as c\n"
        "from ndtrain.layout import Layout\n"
        "from ndtrain.model.config import preset\n"
        "from ndtrain.model.llama import build_model\n"
        "c.parallelize(build_model(preset('debug'), 'meta'), Layout())\n"
        "print('ndtrain.parallel.gloo_reduce_scatter' in sys.modules, "
        "any('_linear_pointwise' in str(k) for k in flop_registry))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_deadline(300))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]

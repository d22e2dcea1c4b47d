"""How far a reader walks: the files and function-body lines on two paths through src/ndtrain,
measured from a static call graph (ast), the way house_metrics.py measures everything else.

- **One optimizer step**: the call chains from `ndtrain train` (cli.main) to the step function
  (train/step.py: train_step), then everything ndtrain defines that the step's stages call:
  its batch (next_batch), the step itself (forward, loss, backward, clip, optimizer), and its
  metrics row and the logger that writes it.
- **One layout key** (`parallel.tp`): the shortest call chain from `ndtrain train` to each place the
  key passes (KEY_ROUTES: the config read, its rule, the mesh, the module it changes), the
  functions those chains call that name the key, and the statements in config/ and layout/
  that declare it.

A call is followed where the code says statically what runs: a name defined or imported in the
module (function-local imports included), `module.name`, `Class.name`, `self.name`, a class
(its `__init__`), a method of a local made from a class (`x = Cls(...)`), a submodule
`self.x = SomeModule(...)` called as `self.x(...)` (its forward), and `x.name` or
`x.field.name` where x is annotated with an ndtrain class (and its field with one).
What only runs dynamically is listed in HOPS, each with why. Calls inside a `raise` are not
followed (an error class is not a step of the path). A function's body lines: from its first
statement after the docstring to its last line, nested functions included in their parent.

Each path is given three ways, from the widest to what a reader opens:

- **every branch** (`path_to_one_step`, `path_of_parallel.tp`): the whole transitive closure
  above, every feature's branch walked (MoE routing, DiLoCo's outer step, the pipeline's
  schedule, a tracker's set-up, ...).
- **the default config's** (`..._default`): the same walk, but a call into a feature the default
  config (`ndtrain train` with no `--config`) leaves off is listed as a branch (OFF_BY_DEFAULT:
  the feature, the config value that keeps it off, the functions only it runs) and not walked.
  tests/tools/test_house_paths.py checks the default config holds each value.
- **what a reader opens** (`..._opened`, on the default config's path): for the step, the spine
  (every chain from `ndtrain train` to the step) and the step's own file (STEP_FILE) followed
  through, then each function that file's functions call elsewhere, opened and read once but not
  followed further (the loader's next_batch, the model's forward, the optimizer's lr, the
  logger's log): the step read top to bottom with one look at each thing it hands work to. For
  the key: the chain's functions that name the key, the functions the chain calls that name it,
  and the statements that declare it, with the route's stops (KEY_ROUTES) always in: the files a
  reader opens by following the key itself, not the spine it rides on (which the step's figure
  counts).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ENTRY = "ndtrain.cli:main"
STEP = "ndtrain.train.step:train_step"
STEP_STAGES = ("ndtrain.train.step:next_batch", STEP, "ndtrain.train.metrics:metrics_row",
               "ndtrain.train.metrics:MetricsLogger.log")
KEY_ROUTES = {"tp": ("ndtrain.config:load_config", "ndtrain.layout.rules:tensor_parallel",
                     "ndtrain.parallel.dims:build_mesh", "ndtrain.parallel.tensor:apply_tensor_parallel")}
STEP_FILE = "train/step.py"  # the step's own room: followed through on the reader's path
# Features the default config leaves off: name -> ((config key, the value that keeps it off),
# the functions only the feature runs: `module:` for a whole module, `module:Class.` for a class).
OFF_BY_DEFAULT = {
    "MoE": (("model.n_experts", 0), ("ndtrain.model.moe:",)),
    "DiLoCo": (("parallel.replicate_sync", "step"), ("ndtrain.parallel.diloco:", "ndtrain.layout.diloco:")),
    "pipeline": (("parallel.pp", 1), ("ndtrain.parallel.pipeline:", "ndtrain.parallel.pipeline_schedule:",
                                      "ndtrain.layout.schedules:")),
    "context parallel": (("parallel.cp", 1), ("ndtrain.parallel.context:",)),
    "fp8": (("parallel.mixed_precision", "fp32"), ("ndtrain.parallel.float8:", "ndtrain.layout.fp8:")),
    "gradient noise scale": (("train.batch_ramp", []), ("ndtrain.train.noise_scale:",)),
    "document masking": (("data.document_mask", False), ("ndtrain.data.packing:", "ndtrain.model.doc_attention:")),
    "W&B": (("logging.trackers", ["tensorboard"]), ("ndtrain.train.trackers:WandbTracker.",)),
    "MLflow": (("logging.trackers", ["tensorboard"]), ("ndtrain.train.trackers:MlflowTracker.",)),
}
DECLARED_IN = ("config/", "layout/")  # the packages that declare config keys and layout fields
# Calls the ast cannot see through, as the code makes them: (caller, callee, why).
HOPS = [
    ("ndtrain.train.step:loss_sum", "ndtrain.model.llama:Transformer.forward", "model(...): nn.Module.__call__"),
    ("ndtrain.model.llama:Transformer.forward", "ndtrain.model.llama:Block.forward",
     "layer(...) over self.layers, an nn.ModuleDict of Blocks"),
    ("ndtrain.train.job:_loop", "ndtrain.train.metrics:MetricsLogger.log", "log = make_logger(...)"),
    ("ndtrain.layout.rules:problems", "ndtrain.layout.rules:tensor_parallel", "for rule in RULES: rule(ctx)"),
]


@dataclass
class Fn:
    key: str  # module:Qual.name
    file: str  # relative to src/ndtrain
    node: ast.AST
    cls: str | None
    lines: int
    calls: set = field(default_factory=set)


def _body_lines(node) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str) and len(body) > 1:
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


class Graph:
    def __init__(self, src: Path):
        self.src = src
        self.trees = {}
        for p in sorted(src.rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            rel = p.relative_to(src).as_posix()
            mod = "ndtrain." + rel[:-3].replace("/", ".")
            mod = mod.removesuffix(".__init__")
            self.trees[mod] = (rel, ast.parse(p.read_text()))
        self.fns: dict[str, Fn] = {}
        self.classes: dict[str, ast.ClassDef] = {}  # module:Class
        for mod, (rel, tree) in self.trees.items():
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._add(mod, rel, node, None)
                elif isinstance(node, ast.ClassDef):
                    self.classes[f"{mod}:{node.name}"] = node
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self._add(mod, rel, item, node.name)
        self._names: dict[str, dict[str, str]] = {}
        for fn in self.fns.values():
            mod = fn.key.split(":")[0]
            fn.calls = {c for c in self._calls(mod, fn) if c in self.fns}
        for caller, callee, _ in HOPS:
            if caller in self.fns and callee in self.fns:
                self.fns[caller].calls.add(callee)
        self._dispatch()

    def _add(self, mod, rel, node, cls):
        key = f"{mod}:{cls + '.' if cls else ''}{node.name}"
        self.fns[key] = Fn(key, rel, node, cls, _body_lines(node))

    def _dispatch(self):
        """cli.main runs the subcommand its COMMANDS table names: `ndtrain train`'s."""
        _, tree = self.trees["ndtrain.cli"]
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "COMMANDS":
                table = ast.literal_eval(node.value)
                module, func, _ = table["train"]
                self.fns[ENTRY].calls.add(f"{module}:{func}")

    # ---- name resolution ---------------------------------------------------------------------
    def names(self, mod: str) -> dict[str, str]:
        """A module's names: `module:thing` for its own and imported definitions, `@module` for
        imported ndtrain modules. Imports anywhere in the file count (lazy imports are common)."""
        if mod in self._names:
            return self._names[mod]
        out: dict[str, str] = {}
        self._names[mod] = out
        if mod not in self.trees:
            return out
        _, tree = self.trees[mod]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = f"{mod}:{node.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ndtrain"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in self.trees:
                        out[a.asname or a.name] = "@" + sub
                    else:
                        target = self.names(node.module).get(a.name)
                        if target:
                            out[a.asname or a.name] = target
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("ndtrain") and a.asname:
                        out[a.asname] = "@" + a.name
        return out

    def _class_method(self, cls_key: str, name: str) -> str | None:
        """`name` on the class or the first ndtrain base that defines it."""
        seen = set()
        while cls_key and cls_key not in seen:
            seen.add(cls_key)
            if f"{cls_key}.{name}" in self.fns:
                return f"{cls_key}.{name}"
            node = self.classes.get(cls_key)
            if node is None:
                return None
            mod = cls_key.split(":")[0]
            bases = [self.names(mod).get(b.id) for b in node.bases if isinstance(b, ast.Name)]
            cls_key = next((b for b in bases if b and b in self.classes), None)
        return None

    def _annotation_class(self, mod: str, ann) -> str | None:
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):  # `Pipeline | None`
            return self._annotation_class(mod, ann.left) or self._annotation_class(mod, ann.right)
        if isinstance(ann, ast.Name):
            target = self.names(mod).get(ann.id)
            return target if target in self.classes else None
        return None

    def _field_class(self, cls_key: str, name: str) -> str | None:
        node = self.classes.get(cls_key)
        for item in node.body if node else []:
            if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == name:
                return self._annotation_class(cls_key.split(":")[0], item.annotation)
        return None

    def _submodules(self, mod: str, cls: str) -> dict[str, set]:
        """self.x = SomeClass(...) in __init__: x -> {module:SomeClass, ...} (one per branch)."""
        out: dict[str, set] = {}
        init = self.fns.get(f"{mod}:{cls}.__init__")
        for node in ast.walk(init.node) if init else []:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                target = self.names(mod).get(node.value.func.id)
                for t in node.targets:
                    if target in self.classes and isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self":
                        out.setdefault(t.attr, set()).add(target)
        return out

    def _callee_class(self, names: dict, f) -> str | None:
        if isinstance(f, ast.Name):
            target = names.get(f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and names.get(f.value.id, "").startswith("@"):
            target = self.names(names[f.value.id][1:]).get(f.attr)
        else:
            return None
        return target if target in self.classes else None

    def _calls(self, mod: str, fn: Fn):
        names = self.names(mod)
        params = {}
        args = fn.node.args
        for a in args.posonlyargs + args.args + args.kwonlyargs:
            if a.annotation is not None and (c := self._annotation_class(mod, a.annotation)):
                params[a.arg] = c
        for node in ast.walk(fn.node):  # x = SomeClass(...) or x = module.SomeClass(...) here
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name) and (c := self._callee_class(names, node.value.func)):
                params[node.targets[0].id] = c
        subs = self._submodules(mod, fn.cls) if fn.cls else {}
        raised = {id(n) for r in ast.walk(fn.node) if isinstance(r, ast.Raise) for n in ast.walk(r)}
        for node in ast.walk(fn.node):
            if not isinstance(node, ast.Call) or id(node) in raised:
                continue
            f = node.func
            if isinstance(f, ast.Name):
                target = names.get(f.id)
                if target in self.classes:
                    yield from filter(None, (self._class_method(target, "__init__"),
                                             self._class_method(target, "__post_init__")))
                elif target:
                    yield target
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                base = f.value.id
                if base == "self" and fn.cls:
                    yield self._class_method(f"{mod}:{fn.cls}", f.attr) or ""
                    for sub in subs.get(f.attr, ()):
                        yield self._class_method(sub, "forward") or ""
                elif names.get(base, "").startswith("@"):
                    yield self.names(names[base][1:]).get(f.attr, "")
                elif names.get(base) in self.classes:
                    yield self._class_method(names[base], f.attr) or ""
                elif base in params:
                    yield self._class_method(params[base], f.attr) or ""
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) \
                    and isinstance(f.value.value, ast.Name) and f.value.value.id in params:
                holder = self._field_class(params[f.value.value.id], f.value.attr)
                if holder:
                    yield self._class_method(holder, f.attr) or ""

    # ---- paths -------------------------------------------------------------------------------
    def reach(self, roots, skip=None, branches: dict | None = None) -> set[str]:
        """Every function the roots call, transitively. `skip(key)`: the branch a callee belongs
        to (not walked; recorded in `branches`: branch -> callees), or None."""
        seen, todo = set(), deque(r for r in roots if r in self.fns)
        while todo:
            k = todo.popleft()
            if k in seen:
                continue
            seen.add(k)
            for c in self.fns[k].calls:
                if skip is not None and (branch := skip(c)):
                    if branches is not None:
                        branches.setdefault(branch, set()).add(c)
                    continue
                todo.append(c)
        return seen

    def chains(self, start: str, target: str, skip=None) -> set[str]:
        """Every function on some call chain from start to target."""
        down = self.reach([start], skip)
        callers: dict[str, set] = {}
        for k, fn in self.fns.items():
            for c in fn.calls:
                callers.setdefault(c, set()).add(k)
        up, todo = set(), deque([target])
        while todo:
            k = todo.popleft()
            if k not in up:
                up.add(k)
                todo.extend(callers.get(k, ()))
        return down & up if target in down else set()


def _reads_key(node: ast.AST, key: str) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr == key) or (isinstance(n, ast.keyword) and n.arg == key)
               or (isinstance(n, ast.Constant) and n.value == key) for n in ast.walk(node))


def summary(g: Graph, keys: set[str], extra_lines: dict[str, int] | None = None) -> dict:
    by_file: dict[str, int] = dict(extra_lines or {})
    for k in keys:
        by_file[g.fns[k].file] = by_file.get(g.fns[k].file, 0) + g.fns[k].lines
    return {"files": len(by_file), "functions": len(keys), "body_lines": sum(by_file.values()),
            "by_file": dict(sorted(by_file.items(), key=lambda kv: -kv[1]))}


def off_by_default(key: str) -> str | None:
    """The feature (OFF_BY_DEFAULT) whose functions `key` is one of, or None."""
    return next((name for name, (_, only) in OFF_BY_DEFAULT.items() if key.startswith(only)), None)


def _branches(g: Graph, found: dict) -> dict:
    """branch -> its entry functions, as `file: name, ...`."""
    return {b: sorted(f"{g.fns[k].file}: {k.split(':')[1]}" for k in keys) for b, keys in sorted(found.items())}


def step_path(g: Graph, default: bool = False) -> dict:
    """Every branch walked; `default`: the default config's path (OFF_BY_DEFAULT not walked)."""
    skip, found = (off_by_default if default else None), {}
    spine = g.chains(ENTRY, STEP, skip)
    step = g.reach(STEP_STAGES, skip, found)
    out = summary(g, spine | step)
    out["calls_to_the_step"] = _depth(g, ENTRY, STEP)
    out["spine"] = summary(g, spine)
    if default:
        out["branches"] = _branches(g, found)
    return out


def opened_step_path(g: Graph) -> dict:
    """What a reader opens on the default config's path: the spine, the step's own file followed
    through from the stages, and each function it calls elsewhere, opened but not followed."""
    spine = g.chains(ENTRY, STEP, off_by_default)
    own, opened, found = set(), set(), {}
    todo = deque(k for k in STEP_STAGES if k in g.fns)
    while todo:
        k = todo.popleft()
        if k in own or k in opened:
            continue
        if g.fns[k].file != STEP_FILE:  # a stage elsewhere (the logger's log): opened, not followed
            opened.add(k)
            continue
        own.add(k)
        for c in g.fns[k].calls:
            if branch := off_by_default(c):
                found.setdefault(branch, set()).add(c)
            elif g.fns[c].file == STEP_FILE:
                todo.append(c)
            else:
                opened.add(c)
    out = summary(g, spine | own | opened)
    out["spine"] = summary(g, spine)
    out["branches"] = _branches(g, found)
    return out


def key_path(g: Graph, key: str = "tp", view: str = "all") -> dict:
    """`view`: "all" (every branch), "default" (OFF_BY_DEFAULT's readers left out) or "opened"
    (of the chain, only the functions that name the key, and the route's stops)."""
    stops = KEY_ROUTES[key]
    chain = set().union(*(_shortest(g, "ndtrain.train.command:main", stop) for stop in stops))
    readers = {c for k in chain for c in g.fns[k].calls if _reads_key(g.fns[c].node, key)}
    found = {}
    if view != "all":
        for c in [c for c in readers if off_by_default(c)]:
            readers.discard(c)
            found.setdefault(off_by_default(c), set()).add(c)
    if view == "opened":
        chain = {k for k in chain if k in stops or _reads_key(g.fns[k].node, key)}
    declared = {}
    for mod, (rel, tree) in g.trees.items():
        for node in tree.body if rel.startswith(DECLARED_IN) else []:  # module-level statements (a field list, a generated config model)
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Import, ast.ImportFrom)):
                stmts = [node] if not isinstance(node, ast.ClassDef) else [
                    s for s in node.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
                for s in stmts:
                    if isinstance(s, (ast.Assign, ast.AnnAssign)) and _reads_key(s, key):
                        declared[rel] = declared.get(rel, 0) + s.end_lineno - s.lineno + 1
    out = summary(g, chain | readers, declared)
    if view != "all":
        out["branches"] = _branches(g, found)
    return out


def _shortest(g: Graph, start: str, target: str) -> list[str]:
    """The functions of the chain with the fewest calls from start to target ([] if none): the
    way a reader follows a key, not every branch that could also reach it (the planner's search
    checks layouts with the same rules, but only when it is asked to choose)."""
    came, todo = {start: None}, deque([start])
    while todo:
        k = todo.popleft()
        if k == target:
            chain = []
            while k is not None:
                chain.append(k)
                k = came[k]
            return chain[::-1]
        for c in sorted(g.fns[k].calls):
            if c not in came:
                came[c] = k
                todo.append(c)
    return []


def _depth(g: Graph, start: str, target: str) -> int:
    """The fewest calls from start to target."""
    return len(_shortest(g, start, target)) - 1


def measure(root: Path) -> dict:
    g = Graph(root / "src" / "ndtrain")
    # A hop whose ends are gone (renamed, moved) would silently shorten a path: name it instead.
    stale = [f"{a} -> {b}" for a, b, _ in HOPS if a not in g.fns or b not in g.fns]
    return {"path_to_one_step": step_path(g), "path_to_one_step_default": step_path(g, default=True),
            "path_to_one_step_opened": opened_step_path(g),
            "path_of_parallel.tp": key_path(g, "tp"), "path_of_parallel.tp_default": key_path(g, "tp", "default"),
            "path_of_parallel.tp_opened": key_path(g, "tp", "opened"), "stale_hops": stale}

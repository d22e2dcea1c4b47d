"""The floors of the package, read from its source with ast (nothing is imported):

    tools      commands and tools that drive the trainer or the planner      -> anything
    train      the loop, optimizer, checkpoints, recovery, metrics           -> calibrate, planner, parallel, model, data, layout, config
    calibrate  measuring this machine with torch (host probe, MFU peak,      -> planner, parallel, model, layout
               `ndtrain calibrate`'s measurements)
    planner    pure Python predictions                                       -> layout, model (torch-free parts)
    parallel   one file per dimension and the composer                       -> model, layout, config
    config     the job config                                                -> model, layout
    data       tokenizers, preparation, the loader                           -> (itself)
    layout     torch-free: the one definition of a layout                    -> model (torch-free parts)
    model      pure torch.nn                                                 -> (itself)
    compat     torch's private names, behind one door (compat/torch.py)      -> (itself)

Every floor may also use `errors`, and those that use torch (model, parallel, calibrate, train)
`compat`; train, data and config use `paths` (checks that an output path can be written, before
work starts, and that a name is one path component); train, calibrate and parallel read the
launcher's variables through `launch_env`, torch-free.
Imports inside functions count like module-level ones, for the floors, for torch and for cycles
between files: an import deferred into a function hides a cycle from Python, not from the reader.
Each check is shown to fail on a small package with the violation in it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ndtrain"

ALLOWED = {
    "tools": None,  # anything
    "cli": None,  # dispatches by module name, imports nothing of the package at module level
    "__main__": None,
    "train": {"train", "calibrate", "planner", "parallel", "model", "data", "layout", "config", "compat", "errors",
              "paths", "launch_env"},
    "calibrate": {"calibrate", "planner", "parallel", "model", "layout", "compat", "errors", "launch_env"},
    "planner": {"planner", "layout", "model", "errors"},
    "parallel": {"parallel", "model", "layout", "config", "compat", "errors", "launch_env"},
    "config": {"config", "model", "layout", "errors", "paths"},
    "data": {"data", "errors", "paths"},
    "layout": {"layout", "model", "errors"},
    "model": {"model", "compat", "errors"},
    "compat": {"compat", "errors"},  # the one door to private torch (compat/torch.py), under every floor that uses torch
    "errors": {"errors"},
    "paths": {"paths", "errors"},  # up-front checks that a path can be written
    "launch_env": {"launch_env", "errors"},  # the launcher's variables, read in one place
    "__init__": {"errors"},
}
TORCH_FREE = ("planner", "layout", "launch_env")  # nothing they reach, even inside a function, imports torch


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def read_imports(root: Path) -> dict[str, list[str]]:
    """module -> the modules it imports (anywhere in the file), for every .py file under `root`.
    A name imported from a package resolves to its submodule when there is one."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    out: dict[str, list[tuple[str, bool]]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: list[str] = []

        def visit(node):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue  # never runs
                if isinstance(child, ast.Import):
                    found.extend(a.name for a in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([base] if base else []))
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        found.append(sub if sub in files else base)
                visit(child)

        visit(tree)
        out[module] = found
    return out


def _torch(name: str) -> bool:
    return name == "torch" or name.startswith(("torch.", "torchao"))


def violations(root: Path) -> list[str]:
    imports = read_imports(root)
    pkg = root.name
    own = {m: [t for t in deps if t == pkg or t.startswith(pkg + ".")] for m, deps in imports.items()}
    found = []
    # Floors: nothing reaches up.
    for module, deps in own.items():
        allowed = ALLOWED.get(_floor(module), set())
        for target in deps:
            if allowed is not None and target != pkg and _floor(target) not in allowed:
                found.append(f"{module} imports {target} (floor {_floor(module)} may use {sorted(allowed)})")
    # Torch-free floors: no torch import in any module they reach.
    direct_torch = {m for m, deps in imports.items() if any(_torch(t) for t in deps)}
    for module in own:
        if _floor(module) not in TORCH_FREE:
            continue
        seen, todo = set(), [module]
        while todo:
            m = todo.pop()
            if m in seen or m not in own:
                continue
            seen.add(m)
            todo.extend(own[m])
        for m in sorted(seen & direct_torch):
            found.append(f"{module} reaches torch" + ("" if m == module else f" through {m}"))
    # Cycles between files (a package's __init__ is a file like any other).
    graph = {m: sorted({t for t in deps if t in own and t != m}) for m, deps in own.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str):
        state[m] = 1
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                found.append("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                dfs(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return found


def test_the_package_keeps_its_floors():
    assert violations(PACKAGE) == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "ndtrain"
    for rel, text in {"__init__.py": "", "errors.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("files, expected", [
    ({"planner/__init__.py": "", "planner/x.py": "def f():\n    import torch\n"}, "ndtrain.planner.x reaches torch"),
    ({"layout/__init__.py": "", "layout/x.py": "from ndtrain.model import llama\n",
      "model/llama.py": "import torch\n"}, "ndtrain.layout.x reaches torch through ndtrain.model.llama"),
    ({"parallel/v.py": "def f():\n    from ndtrain.train.trainer import Trainer\n", "train/trainer.py": ""},
     "ndtrain.parallel.v imports ndtrain.train.trainer"),
    ({"model/m.py": "from ndtrain.tools import report\n", "tools/report.py": ""}, "ndtrain.model.m imports ndtrain.tools.report"),
    ({"data/d.py": "from ..train import x\n", "train/x.py": ""}, "ndtrain.data.d imports ndtrain.train.x"),
    ({"train/t.py": "import ndtrain.tools.auto\n", "tools/auto.py": ""}, "ndtrain.train.t imports ndtrain.tools.auto"),
    ({"model/a.py": "from ndtrain.model.b import B\n", "model/b.py": "from ndtrain.model import a\n"},
     "import cycle: ndtrain.model.a -> ndtrain.model.b -> ndtrain.model.a"),
    ({"train/t.py": "from ndtrain.train import r\n", "train/r.py": "def f():\n    from ndtrain.train.t import g\n"},
     "import cycle: ndtrain.train.r -> ndtrain.train.t -> ndtrain.train.r"),
])
def test_each_check_fails_on_a_package_that_breaks_it(tmp_path, files, expected):
    found = violations(_package(tmp_path, files))
    assert any(v.startswith(expected) for v in found), found


def test_type_checking_imports_count_for_nothing_and_a_shared_module_is_no_cycle(tmp_path):
    root = _package(tmp_path, {
        "model/a.py": "from ndtrain.model.c import C\n",
        "model/b.py": "def f():\n    from ndtrain.model import a, c\n",
        "model/c.py": "",
        "planner/__init__.py": "",
        "planner/p.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
    })
    assert violations(root) == []

"""The code-shape figures issue 31 asks for, measured from the source (ast), not counted by hand:

    python scripts/house_metrics.py [TREE ...]     # default: this checkout

For each tree: lines and files in src/ndtrain, the largest file, the attributes the training
state's constructor sets (`Trainer.__init__` before the build/step/job split, `build()`'s
TrainState after), the `trainer.*` / `state.*` attributes read outside the file that defines
them, reads two attributes deep into another object (`x.a.b` where x is a trainer or state), and
private torch symbols used outside ndtrain/compat/; the public names defined in more than one
module (one name, two things), the aliases (two names, one thing) and the Layout fields named apart
from their config key; and how far a reader walks (house_paths.py):
the files and function-body lines from `ndtrain train` to one optimizer step, and from the
`parallel.tp` key to the module it changes, each three ways (house_paths.py's docstring has the
rules): every branch walked, the default config's path (features it leaves off listed as
branches, not walked), and what a reader opens. Compare two commits with git worktrees:

    git worktree add /tmp/before 350ea51 && python scripts/house_metrics.py /tmp/before .
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from house_paths import measure as measure_paths

# Names that hold the trainer (or, after the split, the train state) where other modules read it.
HOLDERS = {"trainer", "t", "tr", "state", "train_state", "ts"}
OWNERS = ("Trainer", "TrainState")  # the classes whose attributes the coupling figures count
PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")  # _x, not a dunder
# Public names every module of a kind defines by design: `main`, the entry point cli.py's COMMANDS
# table names by module. Not counted as one name for two things.
CONVENTIONS = {"main"}


def _py_files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*.py") if "__pycache__" not in p.parts)


def _holder(node: ast.AST) -> str | None:
    """`trainer` for `trainer.x`, and for `self.trainer.x`; else None."""
    if isinstance(node, ast.Name) and node.id in HOLDERS:
        return node.id
    if (isinstance(node, ast.Attribute) and node.attr in HOLDERS and isinstance(node.value, ast.Name)
            and node.value.id == "self"):
        return node.attr
    return None


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _torch_private(tree: ast.AST) -> set[str]:
    """Private torch names reached: `torch.a._b` chains, `from torch.a._b import c`, `from
    torch.a import _c`, `import torch._x`."""
    found = set()
    aliases = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases.add((a.asname or a.name).split(".")[0])
                    if any(PRIVATE.match(p) for p in a.name.split(".")):
                        found.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            mod_private = any(PRIVATE.match(p) for p in node.module.split("."))
            for a in node.names:
                if mod_private or PRIVATE.match(a.name):
                    found.add(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name and name.split(".")[0] in aliases and any(PRIVATE.match(p) for p in name.split(".")[1:]):
                # the shortest private prefix: torch.distributed._x, not each longer chain
                parts = name.split(".")
                for i, p in enumerate(parts[1:], 1):
                    if PRIVATE.match(p):
                        found.add(".".join(["torch"] + parts[1:i + 1]))
                        break
    return found


def _init_attrs(tree: ast.Module) -> dict[str, int]:
    """Attributes set on self in Trainer.__init__, and fields of a TrainState class."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    names = {t.attr for n in ast.walk(fn) for t in getattr(n, "targets", [getattr(n, "target", None)])
                             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
                    out["Trainer.__init__"] = len(names)
        if isinstance(node, ast.ClassDef) and node.name == "TrainState":
            fields = [n for n in node.body if isinstance(n, ast.AnnAssign)]
            out["TrainState fields"] = len(fields)
    return out


def _owner_attrs(trees: dict) -> tuple[set[str], set[str]]:
    """(the attributes and methods of the Trainer / TrainState classes, the files defining them)."""
    names, homes = set(), set()
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in OWNERS:
                homes.add(rel)
                for n in ast.walk(node):
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("__"):
                        names.add(n.name)
                    elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                        names.add(n.target.id)
                    elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                        names.add(n.attr)
    return names, homes


def _defined(node: ast.AST) -> list[str]:
    """The names a module- or class-level statement defines (imports are not definitions)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _names(trees: dict) -> tuple[dict[str, list[str]], list[str]]:
    """(public module-level names defined in more than one module -> those modules, aliases): an
    alias is `A = B` at module or class level where B is a class, function or method defined or
    imported there (`ParallelDims = Layout`, `world_size = world`), or `A = module.B` of an
    imported ndtrain module: a second name for one thing, not a definition."""
    homes: dict[str, list[str]] = {}
    aliases = []
    for rel, tree in trees.items():
        scopes = [(tree.body, "")] + [(n.body, n.name + ".") for n in tree.body if isinstance(n, ast.ClassDef)]
        imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        own_modules = {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                       and (getattr(n, "module", None) or n.names[0].name).startswith("ndtrain") for a in n.names}
        for body, prefix in scopes:
            callables = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            callables |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | imported
            for node in body:
                value = getattr(node, "value", None)
                if isinstance(node, ast.Assign) and (
                        (isinstance(value, ast.Name) and value.id in callables)
                        or (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                            and value.value.id in own_modules)):
                    aliases += [f"{rel}: {prefix}{name} = {ast.unparse(value)}" for name in _defined(node)
                                if not name.startswith("_")]
                    continue
                if not prefix:
                    for name in _defined(node):
                        if not name.startswith("_") and name not in CONVENTIONS:
                            homes.setdefault(name, []).append(rel)
    return {k: v for k, v in sorted(homes.items()) if len(v) > 1}, sorted(aliases)


def measure(root: Path) -> dict:
    src = root / "src" / "ndtrain"
    files = _py_files(src)
    trees = {p.relative_to(src).as_posix(): ast.parse(p.read_text()) for p in files}
    owned, homes = _owner_attrs(trees)
    lines = {p: len(p.read_text().splitlines()) for p in files}
    largest = max(lines, key=lines.get)
    init, reads, deep, private, by_file = {}, set(), set(), {}, {}
    for p in files:
        rel = p.relative_to(src).as_posix()
        tree = trees[rel]
        init.update(_init_attrs(tree))
        defines_holder = rel in homes
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                h = _holder(node.value)
                if h and not defines_holder and node.attr in owned:
                    reads.add(f"{h}.{node.attr}")
                    by_file.setdefault(rel, set()).add(node.attr)
                if (isinstance(node.value, ast.Attribute) and _holder(node.value.value) and not defines_holder
                        and node.value.attr in owned):
                    deep.add(f"{_holder(node.value.value)}.{node.value.attr}.{node.attr} ({rel})")
        if not rel.startswith("compat/"):
            for name in _torch_private(tree):
                private.setdefault(name, []).append(rel)
    return {"src_lines": sum(lines.values()), "src_files": len(files),
            "largest": f"{largest.relative_to(src).as_posix()} ({lines[largest]} lines)",
            "files_over_400": sorted(f"{p.relative_to(src).as_posix()} ({n})" for p, n in lines.items() if n > 400),
            **init, "owner_attrs_read_outside": sorted({r.split(".", 1)[1] for r in reads}),
            "owner_attrs_read_by_file": {k: sorted(v) for k, v in sorted(by_file.items())}, "reads_two_deep": sorted(deep),
            "private_torch_outside_compat": {k: sorted(set(v)) for k, v in sorted(private.items())},
            **dict(zip(("public_names_defined_twice", "aliases"), _names(trees))),
            "layout_fields_named_apart_from_their_key": _renamed_layout_fields(trees.get("layout/degrees.py")),
            **_paths(root)}


def _renamed_layout_fields(tree) -> list[str]:
    """`field -> config key` for each Layout field whose config key is another name (a `Key("name",
    ...)` or `Key(name=...)` annotation): two names for one thing, the code's and the config's."""
    out = []
    for cls in ast.walk(tree) if tree else ():
        if not (isinstance(cls, ast.ClassDef) and cls.name == "Layout"):
            continue
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            for call in ast.walk(node.annotation):
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Key":
                    name = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "name"), None)
                    if isinstance(name, ast.Constant) and name.value != node.target.id:
                        out.append(f"{node.target.id} -> {name.value}")
    return out


def _paths(root: Path) -> dict:
    out = {}
    m = measure_paths(root)
    for name in [f"{path}{view}" for path in ("path_to_one_step", "path_of_parallel.tp")
                 for view in ("", "_default", "_opened")]:
        path = m[name]
        spine = path.get("spine")
        calls = f"{path['calls_to_the_step']} calls from the command to the step, " if "calls_to_the_step" in path else ""
        out[name] = (f"{path['files']} files, {path['functions']} functions, {path['body_lines']} body lines"
                     + (f"; {calls}spine through {spine['files']} files and {spine['body_lines']} body lines"
                        if spine else ""))
        out[f"{name}_by_file"] = {f: [f"{n} lines"] for f, n in path["by_file"].items()}
        if "branches" in path:  # features the default config leaves off: listed, not walked
            out[f"{name}_branches"] = {b: entries for b, entries in path["branches"].items()}
    out["path_hops_gone"] = m["stale_hops"]
    return out


def main(argv: list[str]) -> None:
    for arg in argv or ["."]:
        m = measure(Path(arg))
        print(f"== {arg}")
        for k, v in m.items():
            if isinstance(v, (list, dict)):
                print(f"{k}: {len(v)}")
                for item in (v.items() if isinstance(v, dict) else v):
                    print(f"    {item[0]}: {', '.join(item[1])}" if isinstance(item, tuple) else f"    {item}")
            else:
                print(f"{k}: {v}")


if __name__ == "__main__":
    main(sys.argv[1:])

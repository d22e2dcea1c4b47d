"""scripts/house_paths.py: the files and function-body lines a reader walks from `ndtrain train`
to one optimizer step, and from one layout key to the module it changes. The rules of the count
are checked on a small tree written here, whose answer is known; the real tree is only checked
for hops that no longer land (a rename would silently shorten a path)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import house_paths  # noqa: E402  (scripts/ is no package)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / "src" / "ndtrain" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


TREE = {
    "__init__.py": "",
    "cli.py": '''
        COMMANDS: dict = {"train": ("ndtrain.train.command", "main", "train")}


        def main(argv):
            return dispatch(argv)


        def dispatch(argv):
            return 0
    ''',
    "train/__init__.py": "",
    "train/command.py": '''
        from ndtrain.train import job


        def main(argv):
            """A docstring is not body."""
            if not argv:
                raise BadInput(argv)
            return job.run(argv)


        def unused():
            return job.run(None)
    ''',
    "train/job.py": '''
        def run(plan):
            from ndtrain.train.step import train_step
            from ndtrain.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(plan)
            return train_step(plan)
    ''',
    "train/errors.py": '''
        class BadInput(Exception):
            def __init__(self, what):
                super().__init__(what)
                self.what = what
    ''',
    "train/step.py": '''
        from ndtrain.train.errors import BadInput
        from ndtrain.train.helpers import Clip


        def next_batch(state, clip: Clip | None = None):
            return clip.apply(state)


        def train_step(state):
            clip = Clip(1.0)
            clip.apply(state)
            if state is None:
                raise BadInput("state")
            return state
    ''',
    "train/helpers.py": '''
        class Norm:
            def forward(self, x):
                return x


        class Clip:
            def __init__(self, limit):
                self.limit = limit
                self.norm = Norm()

            def apply(self, state):
                self.norm(state)
                return self.limit
    ''',
    "train/metrics.py": '''
        def metrics_row(result):
            return {}


        class MetricsLogger:
            def log(self, row):
                return row
    ''',
    "parallel/__init__.py": "",
    "parallel/tensor.py": '''
        def apply_tensor_parallel(plan):
            return plan.tp
    ''',
    "layout/__init__.py": "",
    "layout/degrees.py": '''
        FIELDS = [
            ("tp", int, 1),
        ]
    ''',
}


def test_the_step_path_follows_the_dispatch_imports_classes_and_submodules_not_raises(tmp_path):
    _write(tmp_path, TREE)
    g = house_paths.Graph(tmp_path / "src" / "ndtrain")
    assert g.chains(house_paths.ENTRY, house_paths.STEP) == {
        "ndtrain.cli:main", "ndtrain.train.command:main", "ndtrain.train.job:run", "ndtrain.train.step:train_step"}
    m = house_paths.step_path(g)
    assert m["calls_to_the_step"] == 3
    # cli.main 1, command.main 3 (its docstring left out), job.run 5 (a blank line counts),
    # train_step 5; then what the
    # step calls: Clip.__init__ 2, Clip.apply 2, Norm.forward (self.norm(...)) 1; the stages
    # next_batch 1, metrics_row 1, MetricsLogger.log 1. BadInput (raised) and dispatch (not on
    # the way to the step) are not read.
    assert m["spine"]["body_lines"] == 1 + 3 + 5 + 5
    assert m["body_lines"] == 14 + 2 + 2 + 1 + 1 + 1 + 1
    assert m["files"] == 6 and "train/errors.py" not in m["by_file"]
    # An annotated parameter (`Clip | None`) says what its methods are.
    assert "ndtrain.train.helpers:Clip.apply" in g.fns["ndtrain.train.step:next_batch"].calls


def test_the_key_path_is_the_chain_to_its_module_and_the_key_declared(tmp_path, monkeypatch):
    _write(tmp_path, TREE)
    g = house_paths.Graph(tmp_path / "src" / "ndtrain")
    routes = {"tp": ("ndtrain.parallel.tensor:apply_tensor_parallel",)}
    monkeypatch.setattr(house_paths, "KEY_ROUTES", routes)
    m = house_paths.key_path(g, "tp")
    # command.main 3, job.run 5, apply_tensor_parallel 1; the field list's statement 3 lines.
    assert m["by_file"] == {"train/job.py": 5, "train/command.py": 3, "layout/degrees.py": 3, "parallel/tensor.py": 1}


def test_every_hop_of_the_real_tree_lands():
    assert house_paths.measure(ROOT)["stale_hops"] == []


BRANCHED = {
    "train/step.py": '''
        from ndtrain.train.helpers import Clip
        from ndtrain.train.experts import route


        def next_batch(state):
            return state


        def train_step(state):
            clip = Clip(1.0)
            clip.apply(state)
            if state.moe:
                route(state)
            return _norm(state)


        def _norm(state):
            return state
    ''',
    "train/experts.py": '''
        def route(state):
            return _gate(state)


        def _gate(state):
            return state
    ''',
}


def test_the_default_path_lists_a_feature_left_off_as_a_branch_and_the_opened_path_reads_one_level(
        tmp_path, monkeypatch):
    _write(tmp_path, {**TREE, **BRANCHED})
    monkeypatch.setattr(house_paths, "OFF_BY_DEFAULT", {"MoE": (("model.n_experts", 0), ("ndtrain.train.experts:",))})
    g = house_paths.Graph(tmp_path / "src" / "ndtrain")
    every = house_paths.step_path(g)
    default = house_paths.step_path(g, default=True)
    assert "train/experts.py" in every["by_file"] and "train/experts.py" not in default["by_file"]
    assert default["branches"] == {"MoE": ["train/experts.py: route"]}
    opened = house_paths.opened_step_path(g)
    # The step's own file followed through (train_step, _norm, next_batch), each
    # function it calls elsewhere opened (Clip.__init__, Clip.apply) but not followed (Norm.forward).
    assert "ndtrain.train.helpers:Norm.forward" in g.reach([house_paths.STEP])
    assert opened["by_file"]["train/helpers.py"] == 2 + 2
    assert opened["branches"] == {"MoE": ["train/experts.py: route"]}


def test_the_default_config_leaves_each_listed_feature_off():
    from ndtrain.config import load_config

    cfg = load_config(None, [])
    for feature, ((key, off), _) in house_paths.OFF_BY_DEFAULT.items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == off, feature


def test_layout_fields_named_apart_from_their_key_are_counted_and_the_real_tree_has_none():
    """house_metrics' `layout_fields_named_apart_from_their_key`: a Layout field whose config key
    is another name (two names for one thing) is listed; one that only moves section is not."""
    import ast

    import house_metrics

    tree = ast.parse(textwrap.dedent('''
        class Layout:
            tp: int = 1
            mb: Annotated[int, Key("micro_batch", "train")] = 1
            ac: Annotated[str, Key(name="activation_checkpoint")] = "none"
            document_mask: Annotated[bool, Key(section="data")] = False
    '''))
    assert house_metrics._renamed_layout_fields(tree) == ["mb -> micro_batch", "ac -> activation_checkpoint"]
    real = ast.parse((ROOT / "src" / "ndtrain" / "layout" / "degrees.py").read_text())
    assert house_metrics._renamed_layout_fields(real) == []

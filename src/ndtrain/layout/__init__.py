"""The one definition of a parallel layout, shared by the config, the runtime, `verify`,
`[parallel] auto` and the planner. Pure Python: no torch import, so the planner runs on a laptop.

- degrees.py    the Layout value: the one field list of [parallel]'s layout keys, -1 degrees filled
- syntax.py     its `key=value,...` text syntax
- schedules.py  the pipeline schedule registry: v and micro-batch rules, bubbles, stage placement
- timeline.py   the ideal-timeline simulator
- partition.py  the pipeline stage partition
- flops.py      FLOPs per token, with the attention convention as an argument (MFU uses "full")
- rules.py      problems(): the only validity check
- fp8.py        which Linear layers run in float8 (runtime and planner), and FP8's rules
- diloco.py     DiLoCo's rules (replicate_sync) and its fragment sync schedule
"""

from ndtrain.layout.degrees import Layout, fill_degrees, from_config
from ndtrain.layout.rules import RULES, LayoutProblem, check, problems
from ndtrain.layout.syntax import parse_items, parse_layout

__all__ = ["Layout", "from_config", "parse_items", "parse_layout", "fill_degrees", "RULES", "LayoutProblem", "check",
           "problems"]

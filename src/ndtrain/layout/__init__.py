"""The one definition of a parallel layout, shared by the config, the runtime, `verify`,
`[parallel] auto` and the planner. Pure Python: no torch import, so the planner runs on a laptop.

- degrees.py    the Layout value, its text syntax, -1 resolution, the map to config keys
- schedules.py  the pipeline schedule registry: v and micro-batch rules, bubbles, stage placement
- timeline.py   the ideal-timeline simulator
- partition.py  the pipeline stage partition
- flops.py      FLOPs per token, with the attention convention as an argument (MFU uses "full")
- rules.py      problems(): the only validity check
- fp8.py        which Linear layers run in float8 (runtime and planner), and FP8's rules
"""

from ndtrain.layout.degrees import Layout, from_config, parse_items, parse_layout, resolve
from ndtrain.layout.rules import RULES, Problem, check, problems

__all__ = ["Layout", "from_config", "parse_items", "parse_layout", "resolve", "RULES", "Problem", "check", "problems"]

"""One text syntax for a layout everywhere (`plan --layout`, `--fix`, `verify --layouts`,
`config check`): `key=value` items joined by commas, e.g. `tp=2,pp=4,zero=1,pp_schedule=ZBVZeroBubble`.
Keys are the config keys, which are the Layout's field names (layout/degrees.py), or the short forms
of KEY_ALIASES (`mb`, `ac`, `schedule`, `v`, ...), which older commands and scripts used. Each value
is coerced by its field's type."""

from __future__ import annotations

import dataclasses
import functools

from ndtrain.errors import NdtrainError
from ndtrain.layout.degrees import FIELD, Layout, choices, fill_degrees, reshard_default
from ndtrain.layout.schedules import DEFAULT_INTERLEAVED

# The one migration table: the short forms a layout key was spelt by before the Layout's fields
# took the config's names, still read wherever a layout is read from outside (the text syntax of
# `plan --layout`, `--fix`, `verify --layouts`; a layout dict given to planner.api.predict). Code
# and output spell a field by its one name.
KEY_ALIASES = {"sp": "sequence_parallel", "mb": "micro_batch", "schedule": "pp_schedule",
               "v": "pp_virtual_stages", "virtual_stages": "pp_virtual_stages", "m": "pp_microbatches",
               "split": "pp_split", "ac": "activation_checkpoint", "mp": "mixed_precision",
               "precision": "mixed_precision", "offload": "cpu_offload", "doc_mask": "document_mask",
               "sync": "replicate_sync", "inner_steps": "diloco_inner_steps", "fragments": "diloco_fragments",
               "overlap": "diloco_overlap_steps", "outer_dtype": "diloco_outer_dtype",
               "raf": "reshard_after_forward"}


def parse_items(text: str | dict, what: str = "layout") -> dict:
    """`key=value,...` (or a dict) -> {Layout field: typed value}. Unknown keys and bad values
    raise NdtrainError naming the item."""
    if isinstance(text, dict):
        raw = {str(k).strip().lower(): v for k, v in text.items()}
    else:
        raw = {}
        for item in filter(None, (p.strip() for p in _split_items(text))):
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise NdtrainError(f"{what}: bad item {item!r} (expected key=value, items joined by commas)")
            raw[key.strip().lower()] = value.strip()
    out: dict = {}
    for key, value in raw.items():
        name = KEY_ALIASES.get(key, key)
        if name not in FIELD:
            known = ", ".join(sorted(FIELD))
            raise NdtrainError(f"{what}: unknown key {key!r}; keys are {known}")
        out[name] = _typed(name, value, what)
    return out


def _split_items(text: str) -> list[str]:
    """Split on commas outside brackets, so `layers_per_stage=[3,5,5,3]` stays one item."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return items + [cur]


_NOT_A = {int: "an integer", bool: "a boolean (use 1/0 or true/false)", tuple[int, ...]: "a list of integers"}


@functools.cache
def _coercer(typ):
    from pydantic import TypeAdapter  # on first use: the planner's hot paths never parse text

    return TypeAdapter(typ)


def _typed(name: str, value, what: str):
    """The field's type (pydantic, lax) coerces the item: "2", "yes", 1 for true, "[3,5]"; never a
    boolean for a number. Named values (schedules, Literal vocabularies) are matched without
    case; a value outside the vocabulary is left to the layout rules, which name its config key."""
    typ, text = FIELD[name].type, str(value).strip()
    if name == "pp_schedule":
        from ndtrain.layout.schedules import canonical_schedule

        return canonical_schedule(text)
    if typ not in _NOT_A:
        return text.lower() if choices(name) else text
    if typ == tuple[int, ...]:
        value = [x for x in text.strip("[]").replace(" ", "").split(",") if x] if isinstance(value, str) else list(value)
    from pydantic import ValidationError

    try:
        if not (typ is int and isinstance(value, bool)):
            return _coercer(typ).validate_python(value.strip() if isinstance(value, str) else value)
    except ValidationError:
        pass
    raise NdtrainError(f"{what}: {name}={text!r} is not {_NOT_A[typ]}")


def parse_layout(text: str | dict, world: int | None = None, base: Layout | None = None) -> Layout:
    """A Layout from the text syntax, on top of `base` (default: all degrees 1 except dp_shard,
    which takes the rest of the world, as `[parallel] dp_shard = -1` does). With `world` the
    -1 degrees are resolved (and a world the degrees cannot fill is an error).

    Convenience defaults, as a user would expect: `pp_virtual_stages` defaults to 2 for the V
    schedules, and above 1 without a schedule it means Interleaved1F1B; at ZeRO-1/2 `reshard_after_forward`
    is false (parameters stay gathered)."""
    items = parse_items(text)
    base = base or Layout(dp_shard=-1)
    if "pp_schedule" not in items and items.get("pp_virtual_stages", 1) > 1:
        items["pp_schedule"] = DEFAULT_INTERLEAVED
    from ndtrain.layout.schedules import SCHEDULES

    sched = SCHEDULES.get(items.get("pp_schedule", base.pp_schedule))
    if sched is not None and sched.fixed_v and "pp_virtual_stages" not in items:
        items["pp_virtual_stages"] = sched.fixed_v
    if "reshard_after_forward" not in items and not reshard_default(items.get("zero", base.zero)):
        items["reshard_after_forward"] = False
    lay = dataclasses.replace(base, **items)
    return fill_degrees(lay, world) if world is not None else lay

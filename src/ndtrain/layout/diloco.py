"""DiLoCo's layout rules and its sync schedule, torch-free: `diloco_problems()` is one of the
layout's RULES (layout/rules.py), so the trainer, `config check`, `verify` and the planner run the
same check; the runtime (parallel/diloco.py) uses the same schedule.

Schedule: fragment f of F (F = 1 is classic DiLoCo) sends its outer gradient after inner step s
when s % H == ((f + 1) * H / F) % H, so fragments are H/F steps apart and each is synced every H
steps; the reduced result is applied `diloco_overlap_steps` steps later (0: in the same step). The last step
of a run syncs every fragment whose last send is older, so a run ends on one global model.
"""

from __future__ import annotations

from ndtrain.layout.degrees import SYNCS


def diloco_on(par) -> bool:
    """Whether replicas sync by DiLoCo; `par` is a [parallel] section or a Layout."""
    return par.replicate_sync == "diloco"


def diloco_problems(lay, model):
    """(key, message) for every reason this Layout cannot run its replicate_sync; nothing when it
    can (or when it is "step" with DiLoCo's keys at their defaults). One of the layout rules
    (layout/rules.py RULES): the trainer, `config show`/`config check`, `verify` and the planner
    all see these. The ZeRO stage composes: FSDP shards (and reduces) inside each replica only,
    whatever the stage, and the replicas meet in the outer step alone."""
    if lay.replicate_sync not in SYNCS:  # its vocabulary is the layout's (layout/rules.py values)
        return
    if lay.diloco_inner_steps < 1:
        yield "parallel.diloco_inner_steps", f"must be >= 1, got {lay.diloco_inner_steps}"
        return
    if lay.diloco_fragments < 1:
        yield "parallel.diloco_fragments", f"must be >= 1, got {lay.diloco_fragments}"
        return
    if lay.diloco_inner_steps % lay.diloco_fragments:
        yield "parallel.diloco_fragments", (f"{lay.diloco_fragments} fragments must divide "
                                            f"diloco_inner_steps={lay.diloco_inner_steps} "
                                            f"(one fragment is synced every H/fragments steps)")
        return
    stride = lay.diloco_inner_steps // lay.diloco_fragments
    if not 0 <= lay.diloco_overlap_steps < stride:
        yield "parallel.diloco_overlap_steps", (f"must be in [0, diloco_inner_steps/diloco_fragments) = [0, {stride}), "
                                                f"got {lay.diloco_overlap_steps}")
    if lay.replicate_sync != "diloco":
        return
    if lay.dp_replicate < 2:
        yield "parallel.replicate_sync", (f"diloco synchronises dp_replicate replicas, but dp_replicate="
                                          f"{lay.dp_replicate}; set parallel.dp_replicate >= 2")
    if model.is_moe:
        # Expert-parallel gradients and the router's load statistics are reduced over dp x cp,
        # across replicas, every step; DiLoCo's inner steps must stay inside one replica.
        yield "parallel.replicate_sync", ("diloco does not support mixture-of-experts models yet (expert routing "
                                          "state spans replicas); use replicate_sync=step")
    if lay.diloco_fragments > model.n_layers:
        yield "parallel.diloco_fragments", (f"{lay.diloco_fragments} fragments but model.n_layers={model.n_layers}: a "
                                            f"fragment is a set of whole layers")


def fragment_of(name: str, fragments: int, n_layers: int) -> int:
    """Fragment of a parameter by its canonical name: layers are dealt out in strides (layer i
    goes to i % F, as in Streaming DiLoCo), the embedding rides with fragment 0, the final norm
    and output head with the last layer's fragment."""
    if fragments == 1:
        return 0
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return int(parts[1]) % fragments
    if parts[0] == "tok_embeddings":
        return 0
    return (n_layers - 1) % fragments


def sends_at(step: int, inner_steps: int, fragments: int) -> list[int]:
    """Fragments whose outer gradient is sent after inner step `step` (1-based)."""
    stride = inner_steps // fragments
    return [f for f in range(fragments) if step % inner_steps == ((f + 1) * stride) % inner_steps]


def last_send(fragment: int, step: int, inner_steps: int, fragments: int) -> int:
    """The last step <= `step` at which `fragment` was sent (0 if none yet)."""
    offset = (fragment + 1) * (inner_steps // fragments)  # first send; then every inner_steps
    if step < offset:
        return 0
    return offset + (step - offset) // inner_steps * inner_steps


"""DiLoCo's layout rules and its sync schedule, torch-free: config validation and the planner-side
checks import this without torch; the runtime (parallel/diloco.py) uses the same schedule.

Schedule: fragment f of F (F = 1 is classic DiLoCo) sends its outer gradient after inner step s
when s % H == ((f + 1) * H / F) % H, so fragments are H/F steps apart and each is synced every H
steps; the reduced result is applied `overlap` steps later (0: in the same step). The last step
of a run syncs every fragment whose last send is older, so a run ends on one global model.
"""

from __future__ import annotations


def diloco_on(par) -> bool:
    return getattr(par, "replicate_sync", "step") == "diloco"


def diloco_problems(par, dims, model) -> list[tuple[str, str]]:
    """(key, message) for every reason this layout cannot run DiLoCo; empty when it can (or when
    replicate_sync is "step"). `par` has the [parallel] keys, `dims` the resolved degrees (one
    object may be both). Called from parallel/dims.py validate()."""
    if not diloco_on(par):
        return []
    out = []
    if dims.dp_replicate < 2:
        out.append(("parallel.replicate_sync", f"diloco synchronises dp_replicate replicas, but dp_replicate="
                                               f"{dims.dp_replicate}; set parallel.dp_replicate >= 2"))
    if getattr(par, "auto", False):
        out.append(("parallel.auto", "the planner does not choose DiLoCo replicas; set the degrees yourself "
                                     "(dp_replicate >= 2) with auto=false"))
    if model.is_moe:
        # Expert-parallel gradients and the router's load statistics are reduced over dp x cp,
        # across replicas, every step; DiLoCo's inner steps must stay inside one replica.
        out.append(("parallel.replicate_sync", "diloco does not support mixture-of-experts models yet "
                                               "(expert routing state spans replicas); use replicate_sync=step"))
    if par.diloco_fragments > model.n_layers:
        out.append(("parallel.diloco_fragments", f"{par.diloco_fragments} fragments but model.n_layers="
                                                 f"{model.n_layers}: a fragment is a set of whole layers"))
    return out


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


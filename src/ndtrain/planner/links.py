"""The inter-node link in a CPU calibration profile (one definition of its schema), torch-free.

A profile measured across nodes carries
  "links": {"ranks_per_node": q,
            "intra": {"alpha": s, "beta": bytes/s},   # two ranks of one node
            "inter": {"alpha": s, "beta": bytes/s},   # one rank on each of two nodes
            "collectives": {kind: {"alpha", "beta"}}}  # optional: as the runtime issues them
                                                       # over one rank per node (comm.py's terms)
Profiles without it (one host) load as before: every link is the loopback fit. The node's one
link is shared by its q ranks, so each rank's share of it (the per-GPU NIC of the GPU model in
planner/comm.py) is beta / q. A collective over the link need not reach what one message does
(on Gloo over TCP an all-gather or an all-to-all moving both ways at once reached 0.5-0.7 of it):
where measured, each kind has its own fit. This module reads the section and nothing else of the planner:
planner/hardware.py turns the fields into its link model.
"""

from __future__ import annotations

from ndtrain.errors import NdtrainError

KEY = "links"
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _fit(section: dict, name: str, where: str = KEY) -> tuple[float, float]:
    try:
        alpha, beta = float(section[name]["alpha"]), float(section[name]["beta"])
    except (KeyError, TypeError, ValueError) as exc:
        raise NdtrainError(f"profile {where}.{name}: needs numeric alpha and beta ({exc!r})") from None
    if alpha < 0 or beta <= 0:
        raise NdtrainError(f"profile {where}.{name}: alpha must be >= 0 and beta > 0, got {alpha}, {beta}")
    return alpha, beta


def section(ranks_per_node: int, intra: dict | None, inter: dict, collectives: dict | None = None) -> dict:
    """The profile's links section from alpha-beta fits ({"alpha", "beta"})."""
    out = {"ranks_per_node": int(ranks_per_node), "inter": dict(inter)}
    if intra:
        out["intra"] = dict(intra)
    if collectives:
        out["collectives"] = {k: dict(v) for k, v in collectives.items()}
    return out


def fields(data: dict) -> dict:
    """The measured links of a profile as {"ranks_per_node", "alpha_inter", "beta_inter" (the node's
    link, bytes/s), "alpha_intra" and "collectives" ({kind: (alpha, beta)}) where measured}; {} for
    a profile without them."""
    links = data.get(KEY)
    if not links:
        return {}
    try:
        q = int(links.get("ranks_per_node", 0) or 0)
    except (TypeError, ValueError, AttributeError):
        q = 0
    if q < 1:
        got = links.get("ranks_per_node") if isinstance(links, dict) else links
        raise NdtrainError(f"profile {KEY}.ranks_per_node must be >= 1, got {got!r}")
    alpha_x, beta_x = _fit(links, "inter")
    out = {"ranks_per_node": q, "alpha_inter": alpha_x, "beta_inter": beta_x}
    if "intra" in links:
        out["alpha_intra"] = _fit(links, "intra")[0]
    colls = links.get("collectives") or {}
    unknown = set(colls) - set(KINDS) if isinstance(colls, dict) else {"(not a table)"}
    if unknown:
        raise NdtrainError(f"profile {KEY}.collectives: unknown {sorted(unknown)}; kinds are {', '.join(KINDS)}")
    out["collectives"] = {kind: _fit(colls, kind, f"{KEY}.collectives") for kind in colls}
    return out

"""The inter-node link in a CPU calibration profile (one definition of its schema), torch-free.

A profile measured across nodes carries
  "links": {"ranks_per_node": q,
            "intra": {"alpha": s, "beta": bytes/s},   # two ranks of one node
            "inter": {"alpha": s, "beta": bytes/s}}   # one rank on each of two nodes
Profiles without it (one host) load as before: every link is the loopback fit. The node's one
link is shared by its q ranks, so each rank's share of it (the per-GPU NIC of the GPU model in
planner/comm.py) is beta / q. This module reads the section and nothing else of the planner:
planner/hardware.py turns the fields into its link model.
"""

from __future__ import annotations

import dataclasses

from ndtrain.errors import NdtrainError

KEY = "links"


def _fit(section: dict, name: str) -> tuple[float, float]:
    try:
        alpha, beta = float(section[name]["alpha"]), float(section[name]["beta"])
    except (KeyError, TypeError, ValueError) as exc:
        raise NdtrainError(f"profile {KEY}.{name}: needs numeric alpha and beta ({exc})") from None
    if alpha < 0 or beta <= 0:
        raise NdtrainError(f"profile {KEY}.{name}: alpha must be >= 0 and beta > 0, got {alpha}, {beta}")
    return alpha, beta


def section(ranks_per_node: int, intra: dict | None, inter: dict) -> dict:
    """The profile's links section from alpha-beta fits ({"alpha", "beta"})."""
    out = {"ranks_per_node": int(ranks_per_node), "inter": dict(inter)}
    if intra:
        out["intra"] = dict(intra)
    return out


def fields(data: dict) -> dict:
    """The measured links of a profile as {"ranks_per_node", "alpha_inter", "beta_inter" (the node's
    link, bytes/s), and "alpha_intra" where measured}; {} for a profile without them."""
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
    return out

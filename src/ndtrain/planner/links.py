"""The inter-node link in a CPU calibration profile (one definition of its schema), torch-free.

A profile measured across nodes carries
  "links": {"ranks_per_node": q,
            "intra": {"alpha": s, "beta": bytes/s},   # two ranks of one node
            "inter": {"alpha": s, "beta": bytes/s}}   # one rank on each of two nodes
Profiles without it (one host) load as before: every link is the loopback fit. The node's one
link is shared by its q ranks, so each rank's share of it (the per-GPU NIC of the GPU model in
planner/comm.py) is beta / q.
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


def apply(hw, data: dict):
    """`hw` (the this-machine entry) with the profile's measured links; unchanged without them."""
    links = data.get(KEY)
    if not links:
        return hw
    q = int(links.get("ranks_per_node", 0) or 0)
    if q < 1:
        raise NdtrainError(f"profile {KEY}.ranks_per_node must be >= 1, got {links.get('ranks_per_node')!r}")
    alpha_x, beta_x = _fit(links, "inter")
    changes = {"gpus_per_node": q, "alpha_inter": alpha_x, "nic_bw": beta_x / q / _nic_eff()}
    if "intra" in links:
        changes["alpha_intra"] = _fit(links, "intra")[0]
    return dataclasses.replace(hw, **changes)


def _nic_eff() -> float:
    from ndtrain.planner.hardware import NIC_EFF  # Hardware.inter_bw multiplies it back

    return NIC_EFF

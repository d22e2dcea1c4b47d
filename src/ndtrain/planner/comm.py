"""Collective costs over the network as it is built: an NVLink domain, a pod with full bisection,
an oversubscribed fabric above the pod.

A group of `ranks` whose members are `stride` ranks apart spans stride x ranks consecutive ranks
(the mesh puts tp innermost, then cp, dp_shard, dp_replicate, pp). It lies inside one NVLink
domain when that span fits in `gpus_per_node`; otherwise it runs hierarchically, as NCCL's
topology-aware rings and trees do: the q members of a node drive q NICs in parallel, so the
cross-node part (a ring over the nodes) moves 1/q of the data. Above a pod the fabric is
oversubscribed: a ring crosses each pod boundary once, so it slows only when a pod holds fewer
of its nodes than the oversubscription ratio; all-to-all sends its cross-pod share at NIC rate /
oversubscription (every GPU sends across at once); a pipeline boundary between pods shares the
uplinks among the GPUs of one stage in the pod.

Each level costs alpha-beta with the latency growing with its rank count: a ring step per rank
(k - 1 steps for all-gather and reduce-scatter, 2(k - 1) for a ring all-reduce), or for
all-reduce a tree when that is cheaper (2 log2 k steps; wins for small messages on many ranks).
All-to-all sends its shares over NVLink, the NICs and the pod uplinks at once.

Conventions for `nbytes`: all-reduce, the buffer; all-gather, the gathered output; reduce-scatter,
the input; all-to-all, what one rank sends in total; p2p, the message.
"""

from __future__ import annotations

import math

from ndtrain.planner.accelerator import Hardware

# Host cost of issuing one peer's send/receive in an all-to-all (NCCL groups them; this is what
# is left serial). Assumed, small next to the link latency.
A2A_ISSUE_S = 1e-6


def _flat(kind: str, k: int, nbytes: float, alpha: float, bw: float) -> float:
    if k <= 1 or nbytes <= 0:
        return 0.0
    if kind == "p2p":
        return alpha + nbytes / bw
    if kind == "all_reduce":
        ring = 2 * (k - 1) * alpha + 2 * (k - 1) / k * nbytes / bw
        tree = 2 * math.ceil(math.log2(k)) * alpha + 2 * nbytes / bw  # wins at large k, small n
        return min(ring, tree)
    # all_gather, reduce_scatter, all_to_all: every rank moves (k-1)/k of the buffer once
    return (k - 1) * alpha + (k - 1) / k * nbytes / bw


def _measured(hw: Hardware, kind: str) -> tuple[float, float] | None:
    fit = hw.collectives.get(kind)
    return (fit["alpha"], fit["beta"]) if fit else None


def links(hw: Hardware, k: dict | None) -> tuple[float, float, float, float]:
    """(alpha inside a node, bandwidth inside, alpha across nodes, bandwidth across) per direction.
    GPUs take efficiencies and latencies from the problem's constants; CPU ranks their fits."""
    if not k or hw.generation == "cpu":
        return hw.alpha_intra, hw.intra_bw, hw.alpha_inter, hw.inter_bw
    return k["alpha_intra"], hw.nvlink_bw / 2 * k["nvlink_eff"], k["alpha_inter"], hw.nic_bw * k["nic_eff"]


def _members(span_unit: int, ranks: int, domain: int) -> int:
    """Members of a group (stride `span_unit`) inside one domain of `domain` consecutive ranks."""
    return max(1, min(ranks, domain // span_unit)) if span_unit < domain else 1


def collective_time(hw: Hardware, kind: str, ranks: int, stride: int, nbytes: float, k: dict | None = None) -> float:
    """`kind` "all_reduce_ddp" is an all-reduce priced with the DDP reducer's in-situ fit."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    node = hw.gpus_per_node
    fit = _measured(hw, kind)
    kind = kind.removesuffix("_ddp")
    if stride * ranks <= node:  # inside one NVLink domain
        alpha, bw = fit if fit else links(hw, k)[:2]
        return _flat(kind, ranks, nbytes, alpha, bw)
    ai, bi, ax, bx = links(hw, k)
    across = hw.inter_collectives.get(kind) if kind != "p2p" else None
    if across:  # CPU ranks: this kind measured over the link between nodes, as the runtime issues it
        ax, bx = across["alpha"], across["beta"]
    q = _members(stride, ranks, node)  # members per node
    nodes = ranks // q
    pod = hw.pod_gpus if hw.pod_gpus and stride * ranks > hw.pod_gpus else 0
    over = max(1.0, hw.oversubscription) if pod else 1.0
    if kind == "p2p":
        # a stage boundary crossing pods: the `stride` GPUs of one stage inside a pod send across
        # at once, sharing the pod's uplinks (pod x NIC / oversubscription)
        if pod:
            bx *= min(1.0, pod / (over * min(pod, stride)))
        return _flat("p2p", 2, nbytes, ax, bx)
    if kind == "all_to_all":
        qp = max(q, _members(stride, ranks, pod)) if pod else ranks  # members per pod
        on = nbytes * (q - 1) / ranks
        in_pod = nbytes * (qp - q) / ranks
        across = nbytes * (ranks - qp) / ranks  # every GPU sends across at once: NIC / oversubscription
        wire = max(on / bi, (in_pod + across * over) / bx)
        return ax + (ranks - 1) * A2A_ISSUE_S + wire
    if pod:
        # A ring over the nodes crosses each pod boundary once per ring; the pod's uplinks carry
        # one flow per group passing through it and NIC: slower only when the group has fewer
        # nodes in a pod than the oversubscription ratio.
        nodes_in_pod = max(1, _members(stride, ranks, pod) // q)
        bx *= min(1.0, nodes_in_pod / over)
    if q == 1:
        return _flat(kind, ranks, nbytes, ax, bx)
    inter = _flat(kind, nodes, nbytes / q, ax, bx)
    if kind == "all_reduce":  # reduce-scatter in the node, all-reduce across, all-gather in the node
        return 2 * _flat("all_gather", q, nbytes, ai, bi) + inter
    return _flat(kind, q, nbytes, ai, bi) + inter

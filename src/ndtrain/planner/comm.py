"""Alpha-beta costs of collectives over the links a mesh dimension actually uses.

A group of `ranks` whose members are `stride` ranks apart lies inside one node when
stride * ranks <= gpus_per_node (the mesh puts tp innermost, then cp, dp_shard, dp_replicate, pp).
A group spanning nodes with q members per node runs hierarchically, as NCCL does: the q members
of a node drive q NICs in parallel, so the cross-node part moves 1/q of the data among ranks/q
nodes, and the node-local part runs over NVLink.

Conventions for `nbytes`: all-reduce, the buffer; all-gather, the gathered output; reduce-scatter,
the input; all-to-all, what one rank sends in total; p2p, the message.
"""

from __future__ import annotations

import math

from ndtrain.planner.hardware import Hardware


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


def collective_time(hw: Hardware, kind: str, ranks: int, stride: int, nbytes: float) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    node = hw.gpus_per_node
    if stride * ranks <= node:  # inside one node
        fit = _measured(hw, kind)
        alpha, bw = fit if fit else (hw.alpha_intra, hw.intra_bw)
        return _flat(kind, ranks, nbytes, alpha, bw)
    q = max(1, min(ranks, node // stride)) if stride < node else 1
    nodes = ranks // q
    ai, bi, ax, bx = hw.alpha_intra, hw.intra_bw, hw.alpha_inter, hw.inter_bw
    if kind == "p2p":
        return _flat("p2p", 2, nbytes, ax, bx)
    if kind == "all_to_all":
        # off-node and on-node shares travel on different links at the same time
        off = nbytes * (ranks - q) / ranks / bx
        on = nbytes * (q - 1) / ranks / bi
        return (ranks - 1) * ax + max(off, on)
    if q == 1:
        return _flat(kind, ranks, nbytes, ax, bx)
    inter = _flat(kind, nodes, nbytes / q, ax, bx)
    if kind == "all_reduce":  # reduce-scatter in the node, all-reduce across, all-gather in the node
        return 2 * _flat("all_gather", q, nbytes, ai, bi) + inter
    return _flat(kind, q, nbytes, ai, bi) + inter

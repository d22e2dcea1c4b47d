"""`ndtrain calibrate --links`: the link between nodes, measured apart from the link inside one.

Run under torchrun on every node, with the same ranks per node (LOCAL_WORLD_SIZE) as training:

    torchrun --nnodes=2 --nproc-per-node=2 ... -m ndtrain calibrate --links --out PROFILE

Rank 0 times point-to-point ping-pongs with rank 1 (the same node, where a node has two ranks) and
with the first rank of the next node (the link between nodes), at a few message sizes, while the
other ranks wait; each pair gets an alpha-beta fit (calibrate/cpu.py's, so t = alpha + n / beta
one way). A ping-pong, not a timed send: a send returns once the kernel holds the bytes, which on a
slow link is long before they arrive. Then the data-parallel collectives over one rank per node,
as the runtime issues them, each with its own fit: on Gloo over TCP they need not reach what one
message does (both directions busy at once). Rank 0 then adds the "links" section (planner/links.py) to
the profile at --out, which `ndtrain calibrate` on one node wrote first: the rest of the profile is
one node's, and the planner prices groups that cross nodes on the measured link.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

from ndtrain import launch_env
from ndtrain.errors import NdtrainError
from ndtrain.planner import links

SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
QUICK_SIZES = (1 << 12, 1 << 18, 1 << 20)


def layout_from_env() -> tuple[int, int, int]:
    """(rank, world, ranks per node) as torchrun set them; refused where there is one node."""
    if not launch_env.given_a_rank():
        raise NdtrainError("calibrate --links runs under torchrun across nodes (RANK is not set)")
    rank, world, local = launch_env.rank(), launch_env.world_size(), launch_env.local_world_size()
    if local < 1 or world % local or world // local < 2:
        raise NdtrainError(f"calibrate --links needs at least 2 nodes with the same ranks each; "
                           f"got WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}")
    return rank, world, local


def pairs(ranks_per_node: int) -> dict[str, int]:
    """The peer of rank 0 for each link: "intra" (rank 1, on its node) where a node has two ranks,
    "inter" (the first rank of the second node)."""
    return {**({"intra": 1} if ranks_per_node >= 2 else {}), "inter": ranks_per_node}


def ping_pong_seconds(rank: int, peer_of_0: int, nbytes: int, reps: int) -> float | None:
    """One-way seconds of `nbytes` between rank 0 and `peer_of_0` (half a round trip, the lower
    quartile over `reps` after one warm-up); None on the ranks that only wait."""
    import time

    import torch
    import torch.distributed as dist

    from ndtrain.calibrate.host_costs import typical

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    times = []
    for i in range(reps + 1):
        if rank == 0:
            start = time.perf_counter()
            dist.send(buf, peer_of_0)
            dist.recv(buf, peer_of_0)
            if i:
                times.append((time.perf_counter() - start) / 2)
        elif rank == peer_of_0:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    return typical(times) if rank == 0 else None


def link_samples(rank: int, ranks_per_node: int, sizes=SIZES, reps: int = 5, timer=ping_pong_seconds) -> dict:
    """{link: [(bytes, seconds), ...]} on rank 0 ({} elsewhere), every rank taking part in turn."""
    import torch.distributed as dist

    samples: dict = {}
    for name, peer in pairs(ranks_per_node).items():
        for n in sizes:
            dist.barrier()
            t = timer(rank, peer, n, reps)
            if t is not None:
                samples.setdefault(name, []).append((n, t))
    dist.barrier()
    return samples


def collective_seconds(kind: str, group, nbytes: int, reps: int) -> float:
    """One `kind` over `group` (one rank per node) as the runtime issues it on Gloo (reduce-scatter:
    parallel/gloo_reduce_scatter.py), comm.py's byte convention; the lower quartile of `reps`."""
    import torch
    import torch.distributed as dist

    from ndtrain.calibrate.measure import seconds_per_call

    k = dist.get_world_size(group)
    full = torch.ones(max(k, nbytes // 4 // k * k))
    part = torch.ones(full.numel() // k)
    if kind == "reduce_scatter":
        from ndtrain.parallel.gloo_reduce_scatter import AllToAllReduceScatter

        rs = AllToAllReduceScatter()
        op = lambda: rs(part, full, group, dist.ReduceOp.SUM)  # noqa: E731
    else:
        op = {"all_reduce": lambda: dist.all_reduce(full, group=group),
              "all_gather": lambda: dist.all_gather_into_tensor(full, part, group=group)}[kind]
    return seconds_per_call(op, "cpu", reps)


def collectives_across_nodes(rank: int, world: int, ranks_per_node: int, sizes, reps: int,
                             timer=collective_seconds) -> dict:
    """{kind: [(nodes, bytes, seconds), ...]} on rank 0: each kind over one rank per node, the
    others waiting (every rank makes the group)."""
    import torch.distributed as dist

    members = list(range(0, world, ranks_per_node))
    group = dist.new_group(members)
    samples: dict = {}
    for kind in links.KINDS:
        for n in sizes:
            dist.barrier()
            if rank in members:
                t = timer(kind, group, n, reps)
                if rank == 0:
                    samples.setdefault(kind, []).append((len(members), n, t))
    dist.barrier()
    return samples


def fits(samples: dict, collectives: dict | None = None) -> dict:
    """{link: {"alpha", "beta"}} from {link: [(bytes, one-way seconds), ...]}, and "collectives":
    {kind: {"alpha", "beta"}} from {kind: [(nodes, bytes, seconds), ...]} where given."""
    from ndtrain.calibrate.cpu import fit_alpha_beta

    out = {name: fit_alpha_beta("p2p", [(2, n, t) for n, t in rows]) for name, rows in samples.items()}
    if collectives:
        out["collectives"] = {kind: fit_alpha_beta(kind, rows) for kind, rows in collectives.items()}
    return out


def read_base(out: Path) -> dict:
    """The one-node profile at `out` that the links are added to; refused in one line otherwise."""
    try:
        prof = json.loads(out.read_text())
    except FileNotFoundError:
        raise NdtrainError(f"calibrate --links adds to a profile: run `ndtrain calibrate --out {out}` "
                           f"on one node first") from None
    except (OSError, ValueError) as exc:
        raise NdtrainError(f"calibrate --links: cannot read the profile {out} ({exc})") from None
    if not isinstance(prof, dict) or "collectives" not in prof:
        raise NdtrainError(f"calibrate --links: {out} is not a profile `ndtrain calibrate` wrote")
    return prof


def add_to_profile(out: Path, ranks_per_node: int, fitted: dict, samples: dict) -> dict:
    """The profile at `out` with its links section replaced by the measured one (written whole)."""
    prof = read_base(out)
    section = links.section(ranks_per_node, fitted.get("intra"), fitted["inter"], fitted.get("collectives"))
    section["samples"] = {k: [list(s) for s in v] for k, v in samples.items()}
    prof[links.KEY] = section
    links.fields(prof)  # what the planner will read: refused here rather than at planning
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    tmp.write_text(json.dumps(prof, indent=1))
    os.replace(tmp, out)
    return prof


def calibrate_links(out: Path, quick: bool) -> int:
    """Measure the links on every rank (under torchrun) and, on rank 0, add their fits to `out`."""
    import torch
    import torch.distributed as dist

    rank, world, local = layout_from_env()
    if rank == 0:  # before minutes of measuring; torchrun stops the other ranks
        read_base(out)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        samples = link_samples(rank, local, QUICK_SIZES if quick else SIZES, reps=3 if quick else 5)
        colls = collectives_across_nodes(rank, world, local, QUICK_SIZES[1:] if quick else SIZES[2:], reps=3)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    fitted = fits(samples, colls)
    add_to_profile(out, local, fitted, {**samples, **colls})
    print(f"wrote the links section of {out} ({world // local} nodes x {local} ranks)")
    for name, fit in fitted.pop("collectives", {}).items():
        print(f"  {name:<14} across nodes: alpha {fit['alpha'] * 1e6:8.1f} us   beta {fit['beta'] * 8 / 1e6:9.1f} Mbit/s")
    for name, fit in fitted.items():
        print(f"  {name:<5} alpha {fit['alpha'] * 1e6:8.1f} us   beta {fit['beta'] * 8 / 1e6:9.1f} Mbit/s   "
              + "  ".join(f"{n} B: {t * 1e3:.2f} ms" for n, t in samples[name]))
    return 0

"""`ndtrain calibrate --links` (calibrate/links.py): the link between nodes is recorded apart
from the link inside a node, in the profile section the planner reads (planner/links.py).

The split is checked with the timing faked (a slow link between nodes, a fast one inside), on a
one-rank group; the ping-pong itself on 2 "nodes" x 2 ranks of this host (every pair on loopback,
so only the mechanism: rank 0 meets the right peers and both fits come out). Across real nodes
with a rate limit: tests/cluster/test_slow_links.py (slow)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ndtrain.errors import NdtrainError
from ndtrain.planner import links
from ndtrain.planner.hardware import from_profile
from ndtrain.calibrate import links as cl

INTRA = {"alpha": 20e-6, "beta": 1.0e9}
INTER = {"alpha": 150e-6, "beta": 12.5e6}  # 100 Mbit/s
BASE = {"devices_per_node": 8, "collectives": {k: {"alpha": 1e-4, "beta": 1e9} for k in ("all_reduce", "all_gather")}}


def _fake_timer(rank, peer, nbytes, reps):
    fit = INTRA if peer == 1 else INTER
    return fit["alpha"] + nbytes / fit["beta"]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_split_lands_in_the_profile_the_planner_reads(one_rank, tmp_path):
    samples = cl.link_samples(0, 2, timer=_fake_timer)
    assert set(samples) == {"intra", "inter"} and len(samples["inter"]) == len(cl.SIZES)
    fitted = cl.fits(samples)
    for name, truth in (("intra", INTRA), ("inter", INTER)):
        assert fitted[name]["alpha"] == pytest.approx(truth["alpha"], rel=1e-6)
        assert fitted[name]["beta"] == pytest.approx(truth["beta"], rel=1e-6)
    out = tmp_path / "hardware.json"
    out.write_text(json.dumps(BASE))
    cl.add_to_profile(out, 2, fitted, samples)
    prof = json.loads(out.read_text())
    assert prof["collectives"] == BASE["collectives"]  # one node's part kept as it was
    hw = from_profile(prof)
    assert hw.gpus_per_node == 2 and hw.alpha_inter == pytest.approx(INTER["alpha"])
    assert hw.inter_bw == pytest.approx(INTER["beta"] / 2)  # the node's two ranks share its link
    assert hw.alpha_intra == pytest.approx(INTRA["alpha"])


def test_collectives_across_nodes_get_their_own_fits(one_rank, tmp_path):
    gather = {"alpha": 1e-3, "beta": 8e6}

    def fake(kind, group, nbytes, reps):  # a 2-node all-gather: alpha + n/2 / beta
        return gather["alpha"] + nbytes / 2 / gather["beta"]

    got = cl.collectives_across_nodes(0, 1, 1, (1 << 20, 1 << 22), 1, timer=fake)
    assert set(got) == set(links.KINDS)
    # the fake says 2 nodes, as measured on a real pair (this group has one rank)
    fitted = cl.fits({"inter": [(n, INTER["alpha"] + n / INTER["beta"]) for n in cl.SIZES]},
                     {k: [(2, n, t) for _, n, t in rows] for k, rows in got.items()})
    assert fitted["collectives"]["all_gather"]["beta"] == pytest.approx(gather["beta"], rel=1e-6)
    out = tmp_path / "hardware.json"
    out.write_text(json.dumps(BASE))
    hw = from_profile(cl.add_to_profile(out, 1, fitted, {}))
    assert hw.inter_collectives["all_gather"]["beta"] == pytest.approx(gather["beta"])


def test_one_rank_per_node_measures_only_the_link_between_nodes(one_rank):
    assert set(cl.link_samples(0, 1, timer=_fake_timer)) == {"inter"}
    assert cl.pairs(1) == {"inter": 1} and cl.pairs(4) == {"intra": 1, "inter": 4}


def _worker(rank, world, local, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    samples = cl.link_samples(rank, local, sizes=(1 << 10, 1 << 16), reps=2)
    samples.update(cl.collectives_across_nodes(rank, world, local, (1 << 16,), 2))
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(samples))


def test_ping_pong_on_two_nodes_of_two_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "samples.json"
    mp.start_processes(_worker, args=(4, 2, port, str(out)), nprocs=4, start_method="fork")
    samples = json.loads(out.read_text())
    assert set(samples) == {"intra", "inter", *links.KINDS}
    for name in ("intra", "inter"):
        assert [n for n, _ in samples[name]] == [1 << 10, 1 << 16] and all(t > 0 for _, t in samples[name])
    for kind in links.KINDS:  # over one rank per node: 2 members
        assert [(k, n) for k, n, _ in samples[kind]] == [(2, 1 << 16)] and samples[kind][0][2] > 0


@pytest.mark.parametrize("env, why", [({}, "RANK is not set"),
                                      ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "at least 2 nodes"),
                                      ({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, "at least 2 nodes")])
def test_outside_torchrun_or_on_one_node_is_refused_in_one_line(monkeypatch, env, why):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(NdtrainError, match=why) as err:
        cl.layout_from_env()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, why", [(None, "run `ndtrain calibrate"), ("{", "cannot read"),
                                       ('{"links": {}}', "not a profile")])
def test_a_missing_or_foreign_base_profile_is_refused_and_left_alone(tmp_path, text, why):
    out = tmp_path / "hardware.json"
    if text is not None:
        out.write_text(text)
    with pytest.raises(NdtrainError, match=why) as err:
        cl.add_to_profile(out, 2, {"inter": INTER}, {})
    assert "\n" not in str(err.value)
    assert (out.read_text() if out.exists() else None) == text


def test_the_cli_dispatches_links_and_refuses_outside_torchrun(monkeypatch, tmp_path):
    from ndtrain.tools import calibrate_command

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(NdtrainError, match="runs under torchrun"):
        calibrate_command.main(["--links", "--out", str(tmp_path / "p.json")])
    assert not (tmp_path / "p.json").exists()

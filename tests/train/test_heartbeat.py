"""The watchdog's line names who stopped answering: heartbeats in a store, one process standing for
every rank (each Heartbeat is what one rank runs), a rank that stops beating (frozen, lost), a rank
behind in steps, and a store that does not answer."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ndtrain.train import recovery
from ndtrain.train.heartbeat import Heartbeat

INTERVAL = 0.05


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield master
    del master


def _ranks(store, world: int, attempt: str = "a1") -> list[Heartbeat]:
    return [Heartbeat(r, world, "127.0.0.1", store.port, f"node{r + 1}", attempt, INTERVAL) for r in range(world)]


def _beats(hb: Heartbeat, rank: int) -> int:
    return hb._store.add(f"{hb.prefix}/beat/{rank}", 0)


def _until_beaten(beats: list[Heartbeat], times: int = 2) -> None:
    """Every rank has beaten `times` times (counted, not timed: the test's own timeout bounds it)."""
    while min(_beats(beats[0], r) for r in range(len(beats))) < times:
        threading.Event().wait(INTERVAL)


def test_a_rank_that_stops_beating_is_named_with_its_host(store):
    beats = _ranks(store, 3)
    try:
        _until_beaten(beats)
        beats[2].close()  # what a frozen node does to its rank: no thread of it runs
        beats[2]._thread.join()
        said = beats[0].silent()
    finally:
        for hb in beats:
            hb.close()
    assert said.startswith("waiting on rank 2 on host node3, which stopped answering"), said
    assert "(no heartbeat in 0.15 s)" in said and "rank 1" not in said, said


def test_every_rank_answering_names_the_ranks_behind(store):
    beats = _ranks(store, 3)
    try:
        for hb, step in zip(beats, (5, 4, 5)):
            hb.step = step
        _until_beaten(beats)
        said = beats[0].silent()
        for hb in beats:
            hb.step = 5
        _until_beaten(beats, 4)
        inside = beats[0].silent()
    finally:
        for hb in beats:
            hb.close()
    assert said == "every rank answers; behind this rank's step 5: rank 1 on host node2 (step 4)", said
    assert inside == "every rank answers and is in step 5: the hang is inside the step itself", inside


def test_a_store_that_does_not_answer_names_its_node(store):
    hb = Heartbeat(0, 2, "127.0.0.1", store.port, "node1", "a2", INTERVAL, timeout_s=0.5)
    mute = socket.socket()  # accepts connections and never answers: the store's node frozen
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    try:
        hb.port = mute.getsockname()[1]
        said = hb.silent()
    finally:
        hb.close()
        mute.close()
    assert said == (f"the group's store at 127.0.0.1:{hb.port} does not answer either: rank 0's node (127.0.0.1) "
                    f"stopped answering"), said


def test_the_watchdog_line_carries_the_diagnosis(capfd, hang_deadline):
    fired = threading.Event()
    dog = recovery.Watchdog(0.05, 0, on_expire=fired.set, diagnose=lambda: "waiting on rank 1 on host node2")
    try:
        dog.arm(3)
        assert fired.wait(hang_deadline(60))
    finally:
        dog.close()
    line = next(ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("ndtrain watchdog:"))
    assert line.startswith("ndtrain watchdog: rank 0 step 3 exceeded train.step_deadline_s=0.05 s, "
                           "waiting on rank 1 on host node2; aborting"), line


def test_no_heartbeat_for_one_process_or_without_a_store(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert Heartbeat.from_env(0, 1, "h", "a", 1.0) is None
    monkeypatch.delenv("MASTER_ADDR")
    assert Heartbeat.from_env(0, 2, "h", "a", 1.0) is None

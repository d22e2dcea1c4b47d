"""The cluster in a box itself: each node has its own name, hosts file, /tmp and address, sees
the shared directory, reaches the others only over its link; each fault does what it says; and
nothing is left on the host afterwards (the fixture asserts that)."""

from __future__ import annotations

import subprocess
import sys
import time

import harness
import pytest

# A TCP echo of one line between two nodes, as a python one-liner run on each.
SERVE = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1); "
         "s.bind(('0.0.0.0',7777)); s.listen(); print('listening',flush=True); c,_=s.accept(); "
         "c.sendall(c.recv(64)); c.close()")
CONNECT = ("import socket,sys; c=socket.create_connection((sys.argv[1],7777),timeout=float(sys.argv[2])); "
           "c.sendall(b'hello'); print(c.recv(64).decode())")


def _connect(node, target: str, timeout_s: float) -> subprocess.CompletedProcess:
    return node.run([sys.executable, "-c", CONNECT, target, str(timeout_s)], timeout=timeout_s + 60)


@pytest.mark.timeout(300)
def test_nodes_are_separate_and_reach_each_other_by_name(make_cluster, guard):
    c = make_cluster(2, "loopback")
    n1, n2 = c.nodes
    out = n1.run(["sh", "-c", "hostname; getent hosts node1 node2; echo mine > /tmp/mark; "
                  f"echo shared > {c.shared}/mark; ls /tmp"]).stdout.split()
    assert out[:5] == ["node1", "127.0.1.1", "node1", n2.addr, "node2"] and "mark" in out
    seen = n2.run(["sh", "-c", f"hostname; cat {c.shared}/mark; ls /tmp"]).stdout.split()
    assert seen[:2] == ["node2", "shared"] and "mark" not in seen[2:]  # /tmp is the node's own
    assert (n1.tmp / "mark").read_text() == "mine\n"
    server = n2.popen([sys.executable, "-c", SERVE])
    assert server.stdout.readline().strip() == b"listening"
    got = _connect(n1, "node2", guard(10))
    assert got.stdout.strip() == "hello", got.stderr
    assert server.wait(timeout=guard(10)) == 0


@pytest.mark.timeout(300)
def test_each_fault_does_what_it_says(make_cluster, guard):
    c = make_cluster(2)
    n1, n2 = c.nodes
    # A cut link: nothing gets through; restored, it works again.
    server = n2.popen([sys.executable, "-c", SERVE])
    assert server.stdout.readline().strip() == b"listening"
    n2.link(False)
    assert _connect(n1, n2.addr, 2.0).returncode != 0  # refused or timed out: either way not through
    n2.link(True)
    # The first try may meet the neighbour entry that failed while the link was down ("No route
    # to host"); the kernel resolves it again on the next: retried until the hang guard.
    deadline = time.monotonic() + guard(10)
    while (got := _connect(n1, n2.addr, guard(10))).returncode != 0 and time.monotonic() < deadline:
        assert "No route to host" in got.stderr, got.stderr
    assert got.stdout.strip() == "hello", got.stderr
    server.wait(timeout=guard(10))
    # Freeze: every process of the node stops (no progress while frozen), and goes on when thawed.
    counter = n1.popen(["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i; done"])
    assert int(counter.stdout.readline()) == 1
    n1.freeze()
    pid = n1.pids()[0]
    assert (n1.cgroups["freezer"] / "freezer.state").read_text().strip() == "FROZEN"
    assert open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "D"  # a frozen task sleeps in D
    n1.thaw()
    # Kill: every process of the node dies; the node can start processes again.
    n1.kill_all()
    assert counter.wait(timeout=guard(10)) == -9 and n1.pids() == []
    assert n1.run(["hostname"]).stdout.strip() == "node1"
    # CPU quota and rate limit: set, read back, removed.
    n2.cpu_quota(0.5)
    assert int((n2.cgroups["cpu"] / "cpu.cfs_quota_us").read_text()) * 2 == int(
        (n2.cgroups["cpu"] / "cpu.cfs_period_us").read_text())
    n2.cpu_quota(None)
    assert (n2.cgroups["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "-1"
    n2.rate_limit(100)
    assert "tbf" in n2.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    n2.rate_limit(None)
    assert "tbf" not in n2.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout


@pytest.mark.timeout(120)
def test_what_a_killed_test_left_behind_is_removed_by_the_next(make_cluster):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone
    name = f"{harness.PREFIX}{dead.pid}-abcdef-sw"
    subprocess.run(["ip", "netns", "add", name], check=True)
    (harness.CGROUP / "cpu" / name).mkdir()
    try:
        c = make_cluster(1)
        assert name not in [p.name for p in harness.NETNS_DIR.iterdir()]
        assert not (harness.CGROUP / "cpu" / name).exists() and c.nodes[0].pids() == []
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        if (harness.CGROUP / "cpu" / name).exists():
            (harness.CGROUP / "cpu" / name).rmdir()

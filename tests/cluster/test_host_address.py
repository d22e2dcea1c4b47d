"""The address a rank shows its peers (train/host_address.py), on this host with the resolver and
the interface list patched: each branch of the choice, the refusal's one line, and the line for a
group that did not form. The same code on real namespaces: test_multinode.py."""

from __future__ import annotations

import pytest

from ndtrain.errors import UsageError
from ndtrain.train import host_address as ha

NODE1, NODE2 = "10.233.7.11", "10.233.7.12"


@pytest.fixture
def node(monkeypatch):
    """A host `node2` with eth0 = NODE2; addresses_of() answers from `names`, the route to anything
    non-loopback leaves through eth0."""
    names = {"node1": [NODE1], "node2": ["127.0.1.1"]}
    monkeypatch.setattr(ha.socket, "gethostname", lambda: "node2")
    monkeypatch.setattr(ha, "addresses_of", lambda host: names.get(host, []))
    ifaces = {"eth0": NODE2}
    monkeypatch.setattr(ha, "interfaces", lambda: dict(ifaces))
    monkeypatch.setattr(ha, "route_source", lambda addr: NODE2)
    return names, ifaces


def test_a_loopback_name_on_a_peer_node_takes_the_interface_that_reaches_the_master(node):
    env = {"MASTER_ADDR": "node1"}
    line = ha.choose_interface(world=2, local_world=1, backend="gloo", environ=env)
    assert env == {"MASTER_ADDR": "node1", "GLOO_SOCKET_IFNAME": "eth0"}
    assert "'node2' resolves to 127.0.1.1" in line and "eth0 (10.233.7.12)" in line and "MASTER_ADDR=node1" in line
    env = {"MASTER_ADDR": "node1"}
    ha.choose_interface(world=16, local_world=8, backend="nccl", environ=env)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_on_the_master_node_its_only_interface_is_taken_and_with_two_it_warns(node):
    names, ifaces = node
    env = {"MASTER_ADDR": "node2"}  # this host is the master: its name resolves to loopback here
    assert "only interface" in ha.choose_interface(2, 1, "gloo", env) and env["GLOO_SOCKET_IFNAME"] == "eth0"
    # Two: agents that all share this host need nothing, so it is a warning naming what to set, not a refusal.
    ifaces["ib0"] = "192.168.0.2"
    env = {"MASTER_ADDR": "node2"}
    line = ha.choose_interface(2, 1, "nccl", env)
    assert env == {"MASTER_ADDR": "node2"} and line.startswith("ndtrain: warning:") and "\n" not in line
    assert "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME" in line and "eth0 (10.233.7.12), ib0 (192.168.0.2)" in line


def test_a_peer_node_with_no_interface_on_the_route_to_the_master_is_refused(node):
    _, ifaces = node
    ifaces.clear()
    ifaces["ib0"] = "192.168.0.2"  # the route to MASTER_ADDR leaves from NODE2, which no interface holds
    with pytest.raises(UsageError) as info:
        ha.choose_interface(2, 1, "gloo", {"MASTER_ADDR": "node1"})
    msg = str(info.value)
    assert "\n" not in msg and "Set GLOO_SOCKET_IFNAME to the interface" in msg
    assert "ib0 (192.168.0.2)" in msg and "/etc/hosts" in msg


def test_nothing_is_set_where_nothing_is_needed(node):
    names, _ = node
    env = {"MASTER_ADDR": "node1"}
    assert ha.choose_interface(world=2, local_world=2, backend="gloo", environ=env) is None  # one host
    env = {"MASTER_ADDR": "node1", "GLOO_SOCKET_IFNAME": "ib0"}
    assert ha.choose_interface(2, 1, "gloo", env) is None and env["GLOO_SOCKET_IFNAME"] == "ib0"  # the user's
    names["node2"] = [NODE2]
    env = {"MASTER_ADDR": "node1"}
    assert ha.choose_interface(2, 1, "gloo", env) is None and env == {"MASTER_ADDR": "node1"}  # a routable name


def test_an_unresolvable_name_is_treated_as_loopback(node):
    names, _ = node
    del names["node2"]
    env = {"MASTER_ADDR": "node1"}
    assert "resolves to nothing" in ha.choose_interface(2, 1, "gloo", env) and env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_this_hosts_real_interfaces_and_routes():
    assert ha.is_loopback("127.0.1.1") and ha.is_loopback("::1") and not ha.is_loopback("10.0.0.1")
    assert all(not ha.is_loopback(a) for a in ha.interfaces().values())
    assert ha.route_source("127.0.0.1") == "127.0.0.1"  # a UDP connect picks the route, sends nothing


def test_a_group_that_did_not_form_says_how_long_it_took_and_why():
    exc = RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
                       "Connection refused, remote=[127.0.1.1]:50604\nmore")
    env = {"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    line = ha.group_failure_line(exc, 0, 2, timeout_s=300, elapsed_s=10.4, environ=env)
    assert "\n" not in line and "after 10 s (before train.timeout_s=300 ran out)" in line
    assert "within train.timeout_s" not in line and "127.0.1.1, a loopback address" in line
    assert "GLOO_SOCKET_IFNAME" in line and "MASTER_ADDR=node1 MASTER_PORT=29500" in line
    line = ha.group_failure_line(RuntimeError("wait timeout"), 1, 2, timeout_s=60, elapsed_s=60.2, environ=env)
    assert "within train.timeout_s=60" in line and "were all 2 ranks started" in line

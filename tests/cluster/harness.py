"""A cluster in a box: N nodes on this machine, each with its own network namespace and address on
a private bridge, its own hostname (UTS namespace) and hosts file, its own /tmp (mount namespace),
and its own cgroup (cpu quota, freezer); one directory every node sees at the same path stands for
the cluster's shared filesystem. Needs root, iproute2 and cgroup v1 `cpu` and `freezer`.

Nothing is made in the host's own network namespace: the bridge lives in a "switch" namespace of
its own, each node is a veth pair from that switch into the node's namespace, and the subnet has
no route anywhere else, so no packet can leave the namespaces made here. Every name made here
starts with `ndtc-<pid>-<random>` (the pid of the process that made it): `Cluster.close()` removes
everything (also after a failed test), and a later Cluster removes what a killed one left behind.

Each node is held by one idle process (`holder`) inside the node's namespaces; a command on the
node is `nsenter` into the holder's namespaces, after joining the node's cgroups, so killing a
node is killing every process of its cgroup, and the node can start processes again afterwards.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/run/netns")
PREFIX = "ndtc-"
MOUNT_BASE = Path("/var/tmp")  # not under /tmp: every node mounts its own /tmp over that
HOSTNAME_STYLES = ("own-address", "loopback")  # a node's own name -> its address, or 127.0.1.1 (Debian's default)


def missing_requirements() -> str:
    """Why a cluster cannot be made here, or "" when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, mounts, cgroups)"
    for tool in ("ip", "tc", "nsenter", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (apt-get install -y iproute2 util-linux hostname)"
    for ctl in ("cpu", "freezer"):
        if not (CGROUP / ctl / "cgroup.procs").exists():
            return f"needs the cgroup v1 `{ctl}` controller at {CGROUP / ctl}"
    if not MOUNT_BASE.is_dir():
        return f"needs {MOUNT_BASE}"
    return ""


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove namespaces and cgroups that a Cluster of a process that is gone left behind."""
    removed = []
    names = [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.is_dir() else []
    names += [p.name for ctl in ("cpu", "freezer") if (CGROUP / ctl).is_dir() for p in (CGROUP / ctl).iterdir()]
    for name in sorted(set(names)):
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if not m or _alive(int(m.group(1))):
            continue
        _kill_cgroup(CGROUP / "freezer" / name)
        for pid in _cgroup_pids(CGROUP / "cpu" / name):  # in case the freezer group was gone already
            os.kill(pid, signal.SIGKILL)
        for ctl in ("freezer", "cpu"):
            if (CGROUP / ctl / name).is_dir():
                _rmdir_cgroup(CGROUP / ctl / name)
        if (NETNS_DIR / name).exists():
            _sh("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


def _cgroup_pids(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_cgroup(freezer: Path) -> None:
    """SIGKILL every process of a freezer cgroup: frozen first, so none can fork meanwhile."""
    if not freezer.is_dir():
        return
    state = freezer / "freezer.state"
    state.write_text("FROZEN")
    for pid in _cgroup_pids(freezer):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    state.write_text("THAWED")  # a frozen process acts on SIGKILL only once thawed


def _rmdir_cgroup(d: Path, patience_s: float = 30.0) -> None:
    deadline = time.monotonic() + patience_s
    while d.is_dir():
        try:
            d.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _under_tmp() -> list[Path]:
    """The checkout and the Python prefix the nodes run from, where they lie under /tmp."""
    import sys

    found = []
    for path in (Path(__file__).resolve().parents[2], Path(sys.prefix).resolve()):
        if path.is_relative_to("/tmp") and path != Path("/tmp") and not any(path.is_relative_to(f) for f in found):
            found = [f for f in found if not f.is_relative_to(path)] + [path]
    return found


class Node:
    def __init__(self, cluster: "Cluster", index: int):
        self.cluster = cluster
        self.index = index
        self.name = f"node{index + 1}"
        self.addr = f"{cluster.subnet}.{index + 11}"
        self.netns = f"{cluster.prefix}-{self.name}"
        self.port = f"p{index + 1}"  # its veth's end on the switch
        self.tmp = cluster.base / self.name / "tmp"  # what the node sees as /tmp (inspectable from here)
        self.cgroups = {ctl: CGROUP / ctl / self.netns for ctl in ("cpu", "freezer")}
        self.holder: subprocess.Popen | None = None

    # ---- making it ------------------------------------------------------------------------------
    def _make(self, hosts_text: str) -> None:
        c = self.cluster
        _sh("ip", "netns", "add", self.netns)
        _sh("ip", "-n", c.switch, "link", "add", self.port, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        _sh("ip", "-n", c.switch, "link", "set", self.port, "master", "br0", "up")
        _sh("ip", "-n", self.netns, "addr", "add", f"{self.addr}/24", "dev", "eth0")
        _sh("ip", "-n", self.netns, "link", "set", "eth0", "up")
        _sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        for d in self.cgroups.values():
            d.mkdir()
        self.tmp.mkdir(parents=True)
        hosts = c.base / self.name / "hosts"
        hosts.write_text(hosts_text)
        # The node's own hostname and hosts file, and its /tmp, in mount and UTS namespaces that
        # only this node's processes enter. `ip netns exec` mounts the namespace's own /sys.
        # A checkout or venv under /tmp (a CI clone there) would vanish under the node's own /tmp:
        # each is bound to its own path inside the node's /tmp first, and /tmp is bound recursively.
        keep = "".join(f"mkdir -p {self.tmp / p.relative_to('/tmp')} && mount --bind {p} {self.tmp / p.relative_to('/tmp')} && "
                       for p in _under_tmp())
        script = (f"hostname {self.name} && mount --bind {hosts} /etc/hosts && {keep}mount --rbind {self.tmp} /tmp "
                  f"&& echo ready && exec sleep infinity")
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = self.holder.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{self.name}: could not make its namespaces: {self.holder.stderr.read()[:500]}")

    # ---- running on it ---------------------------------------------------------------------------
    def command(self, argv: list[str], cwd: str | Path = "/") -> list[str]:
        """argv as a process of this node: in its cgroups, then in its network, UTS and mount namespaces."""
        join = " && ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in self.cgroups.values())
        return ["sh", "-c", f'{join} && exec "$@"', "sh",
                "nsenter", "-t", str(self.holder.pid), "--net", "--uts", "--mount", f"--wd={cwd}", "--", *argv]

    def popen(self, argv: list[str], env: dict | None = None, log: Path | None = None,
              cwd: str | Path = "/") -> subprocess.Popen:
        out = open(log, "ab") if log else subprocess.PIPE
        try:
            return subprocess.Popen(self.command(argv, cwd), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            if log:
                out.close()

    def run(self, argv: list[str], timeout: float = 60.0, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), env=env, capture_output=True, text=True, timeout=timeout)

    def pids(self) -> list[int]:
        return _cgroup_pids(self.cgroups["freezer"])

    # ---- faults -----------------------------------------------------------------------------------
    def kill_all(self) -> None:
        """Every process of the node dies at once (a node lost: power, kernel panic, OOM of all)."""
        _kill_cgroup(self.cgroups["freezer"])

    def freeze(self, patience_s: float = 60.0) -> None:
        """Every process of the node stops where it is (a hung node: D state, NFS, a stuck driver).
        Returns once the kernel reports the whole cgroup frozen (it passes through FREEZING)."""
        state = self.cgroups["freezer"] / "freezer.state"
        state.write_text("FROZEN")
        deadline = time.monotonic() + patience_s
        while state.read_text().strip() != "FROZEN":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: still {state.read_text().strip()} after {patience_s:g} s")
            time.sleep(0.01)

    def thaw(self) -> None:
        (self.cgroups["freezer"] / "freezer.state").write_text("THAWED")

    def link(self, up: bool) -> None:
        """Cut or restore the node's cable (its port on the switch): the node keeps its address."""
        _sh("ip", "-n", self.cluster.switch, "link", "set", self.port, "up" if up else "down")

    def cpu_quota(self, fraction: float | None) -> None:
        """The node's processes together get `fraction` of one CPU (None: no limit)."""
        period = int((self.cgroups["cpu"] / "cpu.cfs_period_us").read_text())
        quota = -1 if fraction is None else max(1000, int(period * fraction))
        (self.cgroups["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))

    def rate_limit(self, mbit: float | None) -> None:
        """Both directions of the node's link limited to `mbit` Mbit/s (token bucket; None: removed)."""
        for ns, dev in ((self.netns, "eth0"), (self.cluster.switch, self.port)):
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if mbit is not None:
                burst = max(16 * 1024, int(mbit * 1e6 / 8 / 250))  # ~4 ms of traffic, never below 16 KiB
                _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", str(burst), "latency", "100ms")

    # ---- removing it -----------------------------------------------------------------------------
    def _remove(self) -> None:
        freezer = self.cgroups["freezer"]
        if freezer.is_dir():
            _kill_cgroup(freezer)
        if self.holder is not None and self.holder.poll() is None:
            os.killpg(self.holder.pid, signal.SIGKILL)
            self.holder.wait()
        for d in self.cgroups.values():
            if d.is_dir():
                _rmdir_cgroup(d)
        if (NETNS_DIR / self.netns).exists():
            _sh("ip", "netns", "del", self.netns, check=False)


class Cluster:
    """`with Cluster(2) as c:` two nodes, `c.nodes[0].name == "node1"`, `c.shared` on every node."""

    def __init__(self, n: int, hostnames: str = "own-address"):
        if hostnames not in HOSTNAME_STYLES:
            raise ValueError(f"hostnames must be one of {HOSTNAME_STYLES}, got {hostnames!r}")
        self.n, self.hostnames = n, hostnames
        self.prefix = f"{PREFIX}{os.getpid()}-{random.randrange(16**6):06x}"
        self.subnet = f"10.233.{random.randrange(1, 255)}"
        self.switch = f"{self.prefix}-sw"
        self.base = Path(tempfile.mkdtemp(prefix=self.prefix + "-", dir=MOUNT_BASE))
        self.shared = self.base / "shared"  # the same path on every node, like a cluster filesystem
        self.nodes = [Node(self, i) for i in range(n)]

    def hosts_file(self, node: Node) -> str:
        lines = ["127.0.0.1 localhost"]
        for other in self.nodes:
            own = other is node
            addr = "127.0.1.1" if own and self.hostnames == "loopback" else other.addr
            lines.append(f"{addr} {other.name}")
        return "\n".join(lines) + "\n"

    def start(self) -> "Cluster":
        remove_stale()
        self.shared.mkdir()
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            node._make(self.hosts_file(node))
        return self

    def close(self) -> None:
        errors = []
        for node in self.nodes:
            try:
                node._remove()
            except Exception as exc:  # noqa: BLE001  (remove the rest anyway, then say what failed)
                errors.append(f"{node.name}: {exc}")
        if (NETNS_DIR / self.switch).exists():
            _sh("ip", "netns", "del", self.switch, check=False)
        shutil.rmtree(self.base, ignore_errors=True)
        if errors:
            raise RuntimeError("cluster clean-up: " + "; ".join(errors))

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def leftovers(self) -> list[str]:
        """Anything of this cluster still on the host (empty after close())."""
        found = [p.name for p in NETNS_DIR.iterdir() if p.name.startswith(self.prefix)] if NETNS_DIR.is_dir() else []
        found += [str(d) for n in self.nodes for d in n.cgroups.values() if d.exists()]
        return found + ([str(self.base)] if self.base.exists() else [])

"""Which address a rank shows its peers when the world spans hosts.

Gloo advertises the address this host's own name resolves to. On Debian and Ubuntu a machine's
name resolves to 127.0.1.1 by default (/etc/hosts), and many images map it to 127.0.0.1: the
rendezvous still succeeds (it goes through MASTER_ADDR), then every peer is told to connect to
its own loopback, and the group fails or hangs. Before the group forms, a rank whose name
resolves to loopback while its peers are on other hosts uses the interface that reaches
MASTER_ADDR (GLOO_SOCKET_IFNAME, and NCCL_SOCKET_IFNAME for NCCL), unless the user chose one.
On a peer node the route to MASTER_ADDR names it; on the master's node, where MASTER_ADDR resolves
to loopback too, the only non-loopback interface does, and with several (or none) it warns in
one line naming what to set, since agents that all share this host need nothing."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from ndtrain.errors import UsageError
from ndtrain.launch_env import master_addr, master_port

_SIOCGIFFLAGS, _SIOCGIFADDR = 0x8913, 0x8915  # linux/sockios.h
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def addresses_of(host: str) -> list[str]:
    """host's addresses in resolver order (what Gloo and the TCP store try first), [] if none."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def interfaces() -> dict[str, str]:
    """IPv4 address of every interface that is up and not loopback, by name (Linux ioctls; {} elsewhere)."""
    out = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            if flags & _IFF_UP and not flags & _IFF_LOOPBACK:
                out[name] = addr
    return out


def route_source(addr: str) -> str | None:
    """This host's address on the route to `addr` (a UDP connect only picks the route: nothing is sent)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def socket_variables(backend: str) -> list[str]:
    # Gloo is used on GPUs too (CPU-side groups), so its variable is always set; NCCL's on NCCL only.
    return ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if backend == "nccl" else [])


def choose_interface(world: int, local_world: int, backend: str, environ=None) -> str | None:
    """Set the socket interface variables when this host's name resolves to loopback and the world
    spans hosts (WORLD_SIZE above LOCAL_WORLD_SIZE). Returns the one line that says so, None when
    nothing was needed (one host, a name that resolves to a routable address, or the variables
    already set); raises UsageError naming what to set when no interface is on the route to a
    remote MASTER_ADDR."""
    env = os.environ if environ is None else environ
    names = socket_variables(backend)
    if world <= local_world or all(env.get(n) for n in names):
        return None
    host = socket.gethostname()
    own = addresses_of(host)
    if own and not is_loopback(own[0]):
        return None
    seen = own[0] if own else "nothing"
    master = master_addr(env)
    master_addrs = [a for a in addresses_of(master) if not is_loopback(a)] if master else []
    ifaces = interfaces()
    if master_addrs:  # a peer node: the interface on the route to the master
        src = route_source(master_addrs[0])
        chosen = [n for n, a in ifaces.items() if a == src]
        why = f"the one that reaches MASTER_ADDR={master} ({master_addrs[0]})"
    else:  # this is the master's host (its name resolves to loopback here too): the only interface there is
        chosen = list(ifaces) if len(ifaces) == 1 else []
        why = f"this host's only interface besides loopback (MASTER_ADDR={master} is this host)"
    listed = ", ".join(f"{n} ({a})" for n, a in ifaces.items()) or "none found"
    if len(chosen) != 1 and not master_addrs:
        # The master is on this host: its peers may all be here too (several agents on one
        # machine), which works over loopback; only a warning, and the failure line names the
        # variable if remote peers were told to connect to loopback.
        return (f"ndtrain: warning: this host's name {host!r} resolves to {seen} (loopback); ranks on other "
                f"hosts could not reach this one: set {' and '.join(names)} to the interface that reaches "
                f"them (here: {listed})")
    if len(chosen) != 1:
        raise UsageError(f"this host's name {host!r} resolves to {seen}, a loopback address, but the world spans "
                         f"hosts (WORLD_SIZE={world}, {local_world} on this host): peers could not reach this rank. "
                         f"Set {' and '.join(names)} to the interface that reaches the other nodes "
                         f"(here: {listed}), or map {host!r} to that interface's address in /etc/hosts")
    iface = chosen[0]
    for n in names:
        env.setdefault(n, iface)
    return (f"ndtrain: this host's name {host!r} resolves to {seen} (loopback) and the world spans hosts: "
            f"ranks here use interface {iface} ({ifaces[iface]}), {why}; "
            f"set {names[0]} to choose another")


def group_failure_line(exc: BaseException, rank: int, world: int, timeout_s: float, elapsed_s: float,
                       environ=None) -> str:
    """The one line for a process group that did not form: what was asked, how long it really took
    (a refused connection fails long before the timeout, which then is not the cause), torch's
    first line, and the likely cause."""
    import re

    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    if elapsed_s >= 0.9 * timeout_s:
        when = f"within train.timeout_s={timeout_s:g}"
    else:
        when = f"after {elapsed_s:.0f} s (before train.timeout_s={timeout_s:g} ran out)"
    loop = re.search(r"remote=\[(127\.[0-9.]+|::1)\]", str(exc))
    if loop:
        hint = (f"a peer advertised {loop.group(1)}, a loopback address: its host's name resolves to loopback; "
                f"map each node's name to its own address in /etc/hosts, or set GLOO_SOCKET_IFNAME "
                f"(NCCL_SOCKET_IFNAME on GPUs) to the interface that reaches the other nodes, on every node")
    else:
        hint = f"were all {world} ranks started (torchrun, or `ndtrain train --nproc N`)?"
    return (f"rank {rank} of WORLD_SIZE={world} could not form the process group at "
            f"MASTER_ADDR={master_addr(environ)} MASTER_PORT={master_port(environ)} {when} "
            f"({first[:200]}); {hint}")

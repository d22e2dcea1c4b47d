"""Process-level setup: device, backend, process group, thread count, the C heap. Nothing
global: the returned `Runtime` is passed to whatever needs it."""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ndtrain.errors import ConfigError, NdtrainError
# The launch environment's one reader; its names stay importable from here.
from ndtrain.launch_env import launch_env, rank as env_rank, restart_count, run_id, under_launcher  # noqa: F401


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_device(device: str, backend: str) -> tuple[str, str]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        seen = visible_gpu() if device == "cpu" else None
        if seen:  # a GPU job that would otherwise train on the CPU, hours slower, without a word
            raise ConfigError("train.device", f"'auto' sees a GPU ({seen}) but torch {torch.__version__} cannot use "
                                              f"it ({cuda_unusable_reason()}); install a torch build that matches the "
                                              f"driver, or set train.device='cpu' to train on the CPU")
    if device == "cuda" and not torch.cuda.is_available():
        raise NdtrainError("train.device='cuda' but no CUDA device is available")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return device, backend


def visible_gpu(environ=None) -> str:
    """What says this host has an NVIDIA GPU meant for this process ('' when nothing does): a
    device node, the driver's tool, or a scheduler's CUDA_VISIBLE_DEVICES (one that hides every
    GPU, '' or '-1', says the opposite)."""
    env = os.environ if environ is None else environ
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if nodes:
        return nodes[0]
    if shutil.which("nvidia-smi"):
        return "nvidia-smi on PATH"
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and not visible.startswith("-"):
        return f"CUDA_VISIBLE_DEVICES={visible}"
    return ""


def cuda_unusable_reason() -> str:
    """Why torch cannot use CUDA here, in the words of whatever refused."""
    if torch.version.cuda is None:
        return "this torch is built without CUDA"
    try:
        torch.cuda.init()
    except Exception as exc:  # the driver's or the runtime's own text: too old, not loaded, no device
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        return f"CUDA {torch.version.cuda} runtime: {first[:200]}"
    return f"CUDA {torch.version.cuda} runtime reports no usable device"


ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the old name and torch >= 2.9's


def default_allocator(environ=None) -> bool:
    """On CUDA, expandable segments unless the user configured the allocator: a step's tensors of
    changing sizes (packed documents, MoE's per-expert groups) then grow one mapping instead of
    leaving cached blocks that fit nothing, the fragmentation behind out-of-memory errors with
    memory free. Read by the allocator when CUDA initializes, so this runs before. True when set."""
    env = os.environ if environ is None else environ
    if any(env.get(name) for name in ALLOC_CONF_ENV):
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


def env_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return launch_env()["WORLD_SIZE"]


def setup(train_cfg) -> Runtime:
    """Initialise the process group if launched with WORLD_SIZE > 1 (torchrun) unless a caller
    (a test harness) already did. On CUDA the rank's GPU is bound first and named to the group
    (`device_id`): NCCL then forms its communicator at init rather than at the first collective,
    and `new_group` splits it instead of building each sub-group from scratch."""
    device_type, backend = choose_device(train_cfg.device, train_cfg.backend)
    given = launch_env()
    world = env_world_size()
    local_rank = given["LOCAL_RANK"]
    if device_type == "cuda" and not torch.cuda.is_initialized():
        default_allocator()
    device = bind_device(device_type, local_rank)
    if world > 1 and not dist.is_initialized():
        import time

        from ndtrain.train.host_address import choose_interface, group_failure_line

        # Before the group forms: a host whose name resolves to loopback would advertise it to peers.
        said = choose_interface(world, given.get("LOCAL_WORLD_SIZE", world), backend)
        if said and local_rank == 0:
            print(said, file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=train_cfg.timeout_s), **group_device(device))
        except (RuntimeError, ValueError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
            from ndtrain.errors import RunError

            raise RunError(group_failure_line(exc, given["RANK"], world, train_cfg.timeout_s,
                                              time.monotonic() - started)) from None
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device.type == "cpu":
        if "OMP_NUM_THREADS" not in os.environ:
            # Ranks sharing a host share its cores; oversubscription is slower than 1 thread each.
            local_world = given.get("LOCAL_WORLD_SIZE", world)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        keep_freed_memory()
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


def bind_device(device_type: str, local_rank: int) -> torch.device:
    """This rank's device, made current before anything allocates on it (a process group, a
    mesh, the model). local_rank modulo the visible GPUs: a scheduler that shows each process
    only its own GPU (Slurm --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank) makes it index 0."""
    if device_type != "cuda":
        return torch.device(device_type)
    index = local_rank % max(1, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def group_device(device: torch.device) -> dict:
    """init_process_group's device binding: NCCL only (Gloo's CPU ranks have nothing to bind)."""
    return {"device_id": device} if device.type == "cuda" else {}


def keep_freed_memory() -> bool:
    """CPU ranks: glibc keeps freed blocks of up to 32 MiB in the heap for the next step's tensors.
    By default it hands each freed large block (activations, gradients, oneDNN's scratch) back to
    the kernel and page-faults a fresh one on the next allocation: 2,500-4,400 minor faults per
    forward + backward of the peers' model, 6,000-10,000 with oneDNN's linears, ~100-200 with
    this (one process, 20 steps each). The heap then holds what a step peaks at, which the next
    step needs again anyway. True when set (glibc only; elsewhere nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        return libc.mallopt(m_mmap_threshold, 32 << 20) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


# ---- processes that die together --------------------------------------------------------------
def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this worker when the process that started it dies (a launcher
    killed with SIGKILL cannot stop its workers itself), so no orphan goes on writing into the
    run directory. Linux only; elsewhere a no-op.

    The request only covers a parent alive when it is made, so a parent that died before it must
    be noticed here: its orphans are re-parented (to PID 1 or a subreaper). `expected_parent` is
    the launcher's pid when the launcher says so (`ndtrain train --nproc`); without it, only PID 1
    of the host is taken for a sign of death. In a container PID 1 is the entrypoint, and that is
    torchrun itself in both Kubernetes examples: every worker's parent is then PID 1, alive, and
    if it dies the kernel ends the whole PID namespace anyway."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    parent = os.getppid()
    if expected_parent:
        gone = parent != expected_parent
    else:
        gone = parent == 1 and in_child_pid_namespace() is False
    if gone:
        launcher = f"launcher (pid {expected_parent})" if expected_parent else "launcher"
        print(f"ndtrain train: worker pid {os.getpid()} (rank {env_rank()}): its {launcher} "
              f"exited before the worker could tie its life to it (its parent is now pid {parent}); "
              f"exiting rather than training without it", file=sys.stderr, flush=True)
        os._exit(1)


_INIT_PID_NS = 0xEFFFFFFC  # the host's PID namespace has this fixed inode (PROC_PID_INIT_INO, Linux >= 3.8)


def in_child_pid_namespace() -> bool | None:
    """True inside a PID namespace below the host's (a container, `unshare --pid`), whose PID 1
    is an entrypoint, not the host's init. None when the kernel does not say."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[<inode>]"
        return int(link.split("[", 1)[1].rstrip("]")) != _INIT_PID_NS
    except (OSError, IndexError, ValueError):
        return None


# ---- collectives every rank takes part in -------------------------------------------------------
# One process (no group, or a group of one) is the same code with no communication.
def group_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# `group`: a process group of every rank other than the default one (None), e.g. the
# checkpointer's, whose timeout is sized for file I/O rather than for a step's compute.
def barrier(group=None) -> None:
    if group_active():
        dist.barrier(group=group)


def broadcast_object(obj, src: int = 0, group=None):
    """Rank `src`'s `obj` (anything picklable) on every rank; the others pass a placeholder."""
    if not group_active():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def gather_objects(obj, group=None) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not group_active():
        return [obj]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def any_rank(flag: bool, device, group=None) -> bool:
    """Whether `flag` holds on any rank (a rank that saw an error would otherwise leave its peers
    waiting in the next collective). `device`: one the group's backend reduces on."""
    if not group_active():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def host_group(device: torch.device, timeout_s: float):
    """A Gloo group for the flags ranks agree on every step (a stop request) when the default
    group reduces on an accelerator: a flag agreed there is a device value read back, a sync
    of the GPU each step; on the host it is a small all-reduce and no sync. None where the
    default group already reduces on the host (CPU) or there is no group. Every rank must call
    it at the same point (creating a group is collective)."""
    if not group_active() or torch.device(device).type == "cpu":
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def peer_table() -> list[tuple[str, int]]:
    """(host, pid) of every rank, gathered once at start: when a collective later fails, a rank
    can say which peer died instead of quoting a socket address."""
    if not group_active():
        return []
    return gather_objects((socket.gethostname(), os.getpid()))


_PEER_FAILURES = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                  "timed out", "timeout", "socket", "nccl", "gloo")


def is_peer_failure(exc: BaseException) -> bool:
    """An exception out of a collective whose cause is another rank (dead, or hung), not this one."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(p in text for p in _PEER_FAILURES)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a killed child stays a zombie until its launcher reaps it


def peer_failure_message(exc: BaseException, peers: list[tuple[str, int]], rank: int) -> str:
    import time

    host = socket.gethostname()
    local = [r for r, (h, _) in enumerate(peers) if r != rank and h == host]
    deadline = time.monotonic() + 2.0  # a killed peer's sockets close a moment before it is gone
    while True:
        dead = [r for r in local if not _alive(peers[r][1])]
        if dead or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    first = first.split("] ", 1)[-1].split(". This is typically")[0][:160]
    if dead:
        who = ", ".join(f"rank {r} (pid {peers[r][1]})" for r in dead)
        return f"rank {rank}: {who} died, so this rank stops too ({first}); a restart resumes from the last checkpoint"
    return (f"rank {rank}: lost a peer in a collective ({first}); another rank died or hung, see its log; "
            f"a restart resumes from the last checkpoint")



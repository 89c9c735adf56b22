"""NUMA topology from sysfs, and placing this process on one node: CPU affinity plus memory binding."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from kvexport.errors import InputError, KvexportError

SYSFS = Path("/sys/devices/system")
MPOL_DEFAULT, MPOL_BIND = 0, 2
# set_mempolicy / get_mempolicy syscall numbers (glibc exposes no wrapper; libnuma wraps these)
_SYSCALLS = {"x86_64": (238, 239), "aarch64": (237, 236)}


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format; empty -> [])."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return sorted(set(out))


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]  # online CPUs of the node
    offline_cpus: tuple[int, ...]  # CPUs sysfs lists for the node that are offline now


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]
    online: tuple[int, ...]
    offline: tuple[int, ...]
    from_sysfs: bool  # False: no node directories (kernel without NUMA): one synthetic node

    def node(self, node_id: int) -> NumaNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise InputError(f"NUMA node {node_id} does not exist here; nodes: {', '.join(str(n.id) for n in self.nodes)} "
                         "(see `kvexport doctor`)")

    def to_dict(self) -> dict[str, object]:
        return {"nodes": {n.id: list(n.cpus) for n in self.nodes}, "offline_cpus": list(self.offline)}


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def read_topology(root: Path | str = SYSFS) -> Topology:
    """Nodes and their online CPUs from <root>/node/node*/cpulist and <root>/cpu/{online,offline}."""
    root = Path(root)
    online = parse_cpulist(_read(root / "cpu" / "online"))
    offline = set(parse_cpulist(_read(root / "cpu" / "offline")))
    if not online:
        online = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    node_dirs = sorted((p for p in (root / "node").glob("node[0-9]*") if p.name[4:].isdigit()), key=lambda p: int(p.name[4:]))
    nodes = []
    for d in node_dirs:
        listed = parse_cpulist(_read(d / "cpulist"))
        on = tuple(c for c in listed if c in online and c not in offline)
        off = tuple(c for c in listed if c not in on)
        nodes.append(NumaNode(int(d.name[4:]), on, off))
    if not nodes:
        return Topology((NumaNode(0, tuple(online), ()),), tuple(online), tuple(sorted(offline)), False)
    return Topology(tuple(nodes), tuple(online), tuple(sorted(offline)), True)


def choose_node(topo: Topology, requested: int | None, allowed: set[int] | None = None) -> NumaNode:
    """The requested node (it must have online CPUs), or the node holding most CPUs this process may use."""
    allowed = allowed if allowed is not None else (set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    if requested is not None:
        node = topo.node(requested)
        if not node.cpus:
            raise InputError(f"NUMA node {requested} has no online CPUs (offline: {list(node.offline_cpus)}); "
                             "choose another with --option numa_node=N")
        return node
    def usable(n: NumaNode) -> int:
        return len(set(n.cpus) & allowed) if allowed is not None else len(n.cpus)
    best = max(topo.nodes, key=lambda n: (usable(n), -n.id))
    if usable(best) == 0:
        raise InputError("no NUMA node has a CPU this process may run on; check taskset/cgroup limits")
    return best


def node_cpus_for_process(node: NumaNode, allowed: set[int] | None = None) -> list[int]:
    """The node's CPUs this process may use (a cgroup or taskset may allow fewer than the node has)."""
    allowed = allowed if allowed is not None else set(os.sched_getaffinity(0))
    cpus = [c for c in node.cpus if c in allowed]
    return cpus or list(node.cpus)


def pin_process(cpus: list[int]) -> None:
    """Pin every existing thread of this process (new threads inherit from their creator)."""
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            continue  # a thread that exited meanwhile, or one we may not touch
    os.sched_setaffinity(0, cpus)


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def bind_memory(node_id: int) -> None:
    """MPOL_BIND this thread's future allocations to one node (threads it starts later inherit it).

    Uses the set_mempolicy syscall directly (what libnuma's numa_set_membind does), so no libnuma
    package is needed. Pages already touched stay where they are: call before loading weights.
    """
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        raise KvexportError(f"memory binding is implemented for {', '.join(_SYSCALLS)}, not {platform.machine()}")
    maxnode = max(64, node_id + 1)
    words = (maxnode + 63) // 64
    mask = (ctypes.c_ulong * words)()
    mask[node_id // 64] = 1 << (node_id % 64)
    rc = _libc().syscall(nums[0], MPOL_BIND, mask, ctypes.c_ulong(maxnode + 1))
    if rc != 0:
        err = ctypes.get_errno()
        raise KvexportError(f"set_mempolicy(MPOL_BIND, node {node_id}) failed: {os.strerror(err)}; "
                            "a container may forbid it (run with --cap-add SYS_NICE) or pass --option numa_bind=0")


def memory_policy() -> tuple[int, list[int]]:
    """(mode, nodes) of this thread's memory policy, read back with get_mempolicy."""
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        raise KvexportError(f"get_mempolicy is wired for {', '.join(_SYSCALLS)} only")
    mode = ctypes.c_int(0)
    maxnode = 1024
    mask = (ctypes.c_ulong * (maxnode // 64))()
    rc = _libc().syscall(nums[1], ctypes.byref(mode), mask, ctypes.c_ulong(maxnode), None, ctypes.c_ulong(0))
    if rc != 0:
        raise KvexportError(f"get_mempolicy failed: {os.strerror(ctypes.get_errno())}")
    nodes = [w * 64 + b for w in range(len(mask)) for b in range(64) if mask[w] >> b & 1]
    return mode.value, nodes


def reset_memory_policy() -> None:
    nums = _SYSCALLS.get(platform.machine())
    if nums is not None:
        _libc().syscall(nums[0], MPOL_DEFAULT, None, ctypes.c_ulong(0))

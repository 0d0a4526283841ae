"""A cgroup per sandbox run: the kernel caps the run's total memory and its number of processes, whatever uid they run
as (root included), and everything left in it is killed before it is removed.

| | cgroup v2 (`/sys/fs/cgroup/cgroup.controllers`) | cgroup v1 (this machine) |
|---|---|---|
| where | one child of this process's own cgroup | a child of our own cgroup in the `memory` and the `pids` hierarchy |
| memory (all processes + the run's tmpfs pages) | `memory.max`, `memory.swap.max` = 0 | `memory.limit_in_bytes`, `memory.memsw.limit_in_bytes` |
| processes (threads count) | `pids.max` | `pids.max` |
| out of memory | the kernel kills the whole run (`memory.oom.group`) | the kernel kills one process; `Sandbox` polls `oom_kills()` and kills the rest |
| teardown | `cgroup.kill`, then rmdir | SIGKILL through a pidfd to each listed process until none is left, then rmdir |

Why a child of our *own* cgroup: whatever limits and accounting the machine's tooling puts on us still cover the run,
and a teardown of our group still reaches it. The machine allows it when that directory is writable (root) and, on v2,
its `cgroup.subtree_control` hands memory and pids down; v2 refuses that to a non-root cgroup that holds processes (ours
does), so on v2 this works at the root cgroup or under one delegated for the purpose, and otherwise `probe()` says why.

Joining: `RunCgroup.launcher()` is an argv prefix, `sh -c 'echo $$ > .../cgroup.procs; exec "$@"'`, run as root before
anything else: the launcher writes its own pid and execs the sandbox, so the program and every descendant start inside
and nothing runs outside between fork and join. If it cannot join it exits 125 with a message on stderr.

Cost: making, limiting and removing the directories takes ~0.2 ms; the join is what costs. Moving a process into a
cgroup takes the kernel's cgroup_threadgroup_rwsem for writing, which waits for an RCU grace period: ~10-16 ms on this
machine when no other migration happened just before, ~1 ms when they come back to back (bench/sandbox.py shows runs
with and without). It is a wait, not CPU, so concurrent runs overlap it. (v2's `favordynmods` mount option or clone3's CLONE_INTO_CGROUP avoid
it; neither is ours to choose here: the first is the machine's mount, the second is not reachable from subprocess.)

The v2 branch follows the kernel's cgroup-v2 interface; this machine is v1, so of it only the layout detection has
run here (tests, against a fake tree).

Stale groups (the host process was killed before it could remove them) are named `astratk-sandbox-<pid>-<n>`; the first
`probe()` of a later process kills and removes those whose pid is gone.

Extending: another controller needs its limit file in `RunCgroup.__init__` and, on v1, its hierarchy in `_layout`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import threading
import time
import warnings
from dataclasses import dataclass

PREFIX = "astratk-sandbox-"
_JOIN = ('for f do [ "$f" = -- ] && break; echo $$ > "$f" || { echo "astratk sandbox: cannot join cgroup $f" >&2; '
         'exit 125; }; shift; done; shift; exec "$@"')
_NAMES = itertools.count()


@dataclass(frozen=True)
class Layout:
    """Where run cgroups go: `parents[i]` is a directory in hierarchy i (v2: one; v1: memory then pids, or one when
    they are mounted together) and `rels[i]` its path as /proc/<pid>/cgroup shows it."""

    version: int  # 1 | 2
    parents: tuple[str, ...]
    rels: tuple[str, ...]


class RunCgroup:
    """One run's cgroup, created with its limits set. `close()` kills what is left and removes it."""

    def __init__(self, layout: Layout, memory_bytes: int, max_pids: int) -> None:
        self.layout = layout
        name = f"{PREFIX}{os.getpid()}-{next(_NAMES)}"
        self.dirs = tuple(os.path.join(p, name) for p in layout.parents)
        self.rels = tuple(f"{r.rstrip('/')}/{name}" for r in layout.rels)
        made: list[str] = []
        try:
            for d in self.dirs:
                os.mkdir(d)
                made.append(d)
            mem, pids = self.dirs[0], self.dirs[-1]
            if layout.version == 2:
                _write(mem, "memory.max", memory_bytes)
                _write(mem, "memory.swap.max", 0, optional=True)  # no swap: the cap is the run's real footprint
                _write(mem, "memory.oom.group", 1, optional=True)
            else:
                _write(mem, "memory.limit_in_bytes", memory_bytes)
                _write(mem, "memory.memsw.limit_in_bytes", memory_bytes, optional=True)  # set after: memsw >= mem
            _write(pids, "pids.max", max_pids)
        except BaseException:
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            raise

    def __repr__(self) -> str:
        return f"RunCgroup(v{self.layout.version}, {self.dirs!r})"

    def launcher(self) -> list[str]:
        """argv prefix that moves itself into this cgroup, then execs the rest of the command line."""
        return [_sh(), "-c", _JOIN, "sh", *(os.path.join(d, "cgroup.procs") for d in self.dirs), "--"]

    def oom_kills(self) -> int:
        """How many processes of the run the kernel killed for exceeding its memory."""
        name = "memory.events" if self.layout.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs[0], name)) as f:
                m = re.search(r"^oom_kill (\d+)$", f.read(), re.MULTILINE)
        except OSError:
            return 0
        return int(m.group(1)) if m else 0

    def pids(self) -> list[int]:
        return _read_pids(os.path.join(self.dirs[-1], "cgroup.procs"))

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the cgroup and wait until none is left."""
        if self.layout.version == 2 and os.path.exists(os.path.join(self.dirs[0], "cgroup.kill")):
            with contextlib.suppress(OSError):
                _write(self.dirs[0], "cgroup.kill", 1)
        end = time.perf_counter() + timeout
        while (pids := self.pids()) and time.perf_counter() < end:
            for pid in pids:
                _kill_if_member(pid, self.rels[-1])
            time.sleep(0.005)

    def close(self) -> None:
        self.kill()
        _rmdir_all(self.dirs)


def _kill_if_member(pid: int, rel: str) -> None:
    """SIGKILL `pid` only if it is still in the cgroup `rel`: the pidfd pins the process, so a pid that was freed and
    reused by a host process after we listed it is checked, and spared, rather than killed."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # already gone
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            member = any(line.rstrip("\n").split(":", 2)[2] == rel for line in f if line.count(":") >= 2)
        if member:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rmdir_all(dirs: tuple[str, ...], timeout: float = 5.0) -> None:
    end = time.perf_counter() + timeout
    for d in dirs:
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:  # EBUSY while the last killed processes finish exiting
                if time.perf_counter() >= end:
                    warnings.warn(f"sandbox cgroup {d} could not be removed ({e}); the next probe() of another "
                                  "process removes it", RuntimeWarning, stacklevel=3)
                    break
                time.sleep(0.01)


# ------------------------------------------------------------------------------------------------------ probe
_PROBE: dict[str, tuple[Layout | None, str]] = {}
_PROBE_LOCK = threading.Lock()


def probe() -> tuple[Layout | None, str]:
    """(layout, "") when run cgroups can be made here, else (None, why not). Tried for real once per process."""
    with _PROBE_LOCK:
        if "layout" not in _PROBE:
            _PROBE["layout"] = _probe()
        return _PROBE["layout"]


def own_memory_limit_mb() -> int | None:
    """The memory limit of the cgroup this process runs in (a container's or a job's), in MB; None without one.
    Read for the RAM guard when no run cgroup can be made: a pod capped below the machine's RAM is the real bound."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2: memory.max, and every ancestor's up to the root
            names, base = ("memory.max",), "/sys/fs/cgroup"
        elif "memory" in controllers.split(","):
            names, base = ("memory.limit_in_bytes",), "/sys/fs/cgroup/memory"
        else:
            continue
        path = rel.strip("/")
        while True:
            for name in names:
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(base, path, name)) as f:
                        value = f.read().strip()
                    if value != "max" and int(value) < 1 << 60:  # v1 says "no limit" with a huge number
                        limits.append(int(value) >> 20)
            if not path:
                break
            path = os.path.dirname(path)
    return min(limits) if limits else None


def _probe() -> tuple[Layout | None, str]:
    if not os.path.exists("/proc/self/cgroup"):
        return None, "no /proc/self/cgroup (not Linux)"
    if _sh() == "":
        return None, "no /bin/sh to join a cgroup with"
    with open("/proc/self/cgroup") as f:
        own = f.read()
    with open("/proc/self/mountinfo") as f:
        mounts = f.read()
    layout, why = _layout(own, mounts)
    if layout is None:
        return None, why
    _reap_stale(layout)
    try:
        RunCgroup(layout, 64 << 20, 8).close()
    except OSError as e:
        return None, f"cannot create a cgroup under {', '.join(layout.parents)}: {e}"
    return layout, ""


def _layout(own_cgroup: str, mountinfo: str) -> tuple[Layout | None, str]:
    """Our cgroup directories from /proc/self/cgroup and /proc/self/mountinfo; v2 when its memory and pids reach
    children of our cgroup, else v1 when both hierarchies are mounted."""
    paths: dict[str, str] = {}  # controller ("" for v2) -> our path in that hierarchy
    for line in own_cgroup.splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            paths[c] = path
    mounts: dict[str, tuple[str, str]] = {}  # controller ("" for v2) -> (mount root, mount point)
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, opts = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            mounts.setdefault("", (fields[3], _unescape(fields[4])))
        elif fstype == "cgroup":
            for c in ("memory", "pids"):
                if c in opts:
                    mounts.setdefault(c, (fields[3], _unescape(fields[4])))
    why = []
    if "" in mounts and "" in paths:
        d = _dir_of(mounts[""], paths[""])
        if d is None:
            why.append("cgroup v2: our cgroup is outside the mounted tree")
        elif (reason := _v2_delegate(d)) == "":
            return Layout(2, (d,), (paths[""],)), ""
        else:
            why.append(f"cgroup v2: {reason}")
    dirs = [_dir_of(mounts[c], paths[c]) if c in mounts and c in paths else None for c in ("memory", "pids")]
    if dirs[0] is not None and dirs[1] is not None:
        if dirs[0] == dirs[1]:  # memory and pids mounted together: one directory holds both
            return Layout(1, (dirs[0],), (paths["memory"],)), ""
        return Layout(1, (dirs[0], dirs[1]), (paths["memory"], paths["pids"])), ""
    why.append("cgroup v1: the memory and pids hierarchies are not both mounted and ours")
    return None, "; ".join(why)


def _v2_delegate(d: str) -> str:
    """'' when children of `d` get the memory and pids controllers (enabling them if we may), else why not."""
    try:
        with open(os.path.join(d, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        if {"memory", "pids"} <= enabled:
            return ""
        with open(os.path.join(d, "cgroup.controllers")) as f:
            if not {"memory", "pids"} <= set(f.read().split()):
                return f"{d} lacks the memory or pids controller"
        _write(d, "cgroup.subtree_control", "+memory +pids")
        return ""
    except OSError as e:  # EBUSY: a non-root cgroup holding processes (ours) may not hand controllers down
        return f"cannot hand memory and pids to children of {d} ({e}); run under a delegated cgroup"


def _dir_of(mount: tuple[str, str], path: str) -> str | None:
    root, point = mount
    if root == "/":
        return point.rstrip("/") + path if path != "/" else point
    if path == root or path.startswith(root.rstrip("/") + "/"):
        return point.rstrip("/") + path[len(root.rstrip("/")):]
    return None


def _reap_stale(layout: Layout) -> None:
    """Kill and remove run cgroups left by host processes that died before removing them."""
    for parent, rel in zip(layout.parents, layout.rels, strict=True):
        with contextlib.suppress(OSError):
            for name in os.listdir(parent):
                m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", name)
                if m is None or _alive(int(m.group(1))):
                    continue
                d = os.path.join(parent, name)
                if layout.version == 2:
                    with contextlib.suppress(OSError):
                        _write(d, "cgroup.kill", 1)
                for pid in _read_pids(os.path.join(d, "cgroup.procs")):
                    _kill_if_member(pid, f"{rel.rstrip('/')}/{name}")
                _rmdir_all((d,), timeout=1.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _read_pids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _write(d: str, name: str, value: object, optional: bool = False) -> None:
    path = os.path.join(d, name)
    if optional and not os.path.exists(path):
        return
    with open(path, "w") as f:
        f.write(str(value))


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)  # mountinfo octal-escapes spaces etc.


def _sh() -> str:
    # absolute: the launcher's environment may be empty, and then a PATH lookup would be the C library's default
    return shutil.which("sh", path="/usr/bin:/bin") or ""

"""Namespaces for the process sandbox (the fallback where bubblewrap is missing), and what a run can still reach.

Why: without namespaces a program run by the process fallback shares the host's /tmp, /var/tmp, /dev/shm and SysV IPC
(it could leave files, shared memory holding up to its memory cap, or a socket there for the next run or a host service
to find) and the host's network. `unshare` (util-linux) gives each run what the kernel allows here:

| | as root | without root, where user namespaces are allowed | neither |
|---|---|---|---|
| how | `unshare --mount --ipc --net` | `unshare --user --map-root-user --mount --ipc --net` (the program is the namespace's root, without capabilities) | nothing: as root, what the run's uid left is swept instead (`uids.sweep_files`, `uids.sweep_ipc`) |
| mounts | private tmpfs at /tmp, /var/tmp, /dev/shm (one of `max_disk_mb`), an empty /run, its own /dev/mqueue | same | the host's |
| IPC | SysV shared memory, semaphores and message queues of its own | same | the host's |
| network | no interface but a down lo; abstract Unix sockets of its own | same | the host's |

The mounts are made by `PRIVATE_MOUNTS`, a Python script run inside the new namespaces before the uid is dropped. The
program's working directory, a host directory, is bound at /run/sandbox (`PROCESS_WORKDIR`): it has to be reachable
after /tmp is covered, and /run is the one covered directory we build ourselves. Everything dies with the namespace: once the run's
last process exits, its tmpfs and IPC objects are gone.

What a network namespace does *not* hide: a Unix socket bound to a filesystem path. Connecting to one needs only write
permission on the socket file (a read-only mount does not stop it), and the process fallback sees the host's
filesystem. So `reachable_sockets` reads the kernel's socket tables (/proc/<pid>/net/unix of every network namespace we
can see) when a run starts and lists the bound paths the run would see and may write; a run reports `own_network` only
when it has a network namespace and that list is empty. Its limits: ACLs are not read (mode bits only), and a socket
bound by a relative path (the table does not say where) counts as reachable wherever the host's files are visible.

Extending: another private directory is another entry of `private_targets`; the script binds each to a directory of
the one tmpfs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PROCESS_WORKDIR = "/run/sandbox"  # the program's cwd under private mounts: the host workdir, bound
PRIVATE_RUN = "/run"  # replaced by an empty tmpfs (root's, 0755): holds only PROCESS_WORKDIR

# Run (by this host's Python, `python -I -S -c`) as root of the run's new mount namespace, before the uid is dropped.
# argv: a host directory holding `work` (the program's files) and an empty `run`; the tmpfs size; 1 when /dev/mqueue is
# a mount to replace; the directories to make private; `--`; the command (an absolute path). The new /run is built at
# <base>/run and moved over /run, so the workdir stays reachable wherever the host keeps it (under /tmp, or /run
# itself). The directories share one tmpfs, mounted at /run/.tmp while they are bound, then detached. Failing, it exits
# 125, as the cgroup launcher does. One process making the mount calls itself: a shell running `mount` for each took
# ~40 ms a run here, this ~14 ms.
PRIVATE_MOUNTS = r"""import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MS_BIND, MS_MOVE = 2, 4, 4096, 8192


def fail(what):
    sys.stderr.write(f"astratk sandbox: cannot make the run's private mounts ({what})\n")
    sys.exit(125)


def mount(source, target, fstype, flags, data):
    if libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                  data and data.encode()):
        fail(f"mount {target}: {os.strerror(ctypes.get_errno())}")


base, size, mq, *rest = sys.argv[1:]
targets, command = rest[:rest.index("--")], rest[rest.index("--") + 1:]
run = f"{base}/run"
try:
    mount("astratk", run, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    os.mkdir(f"{run}/sandbox")
    os.mkdir(f"{run}/.tmp")
    mount(f"{base}/work", f"{run}/sandbox", None, MS_BIND, None)
    mount("astratk", f"{run}/.tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={size}")
    mount(run, "/run", None, MS_MOVE, None)
    for i, target in enumerate(targets):
        os.mkdir(f"/run/.tmp/{i}")
        os.chmod(f"/run/.tmp/{i}", 0o1777)
        mount(f"/run/.tmp/{i}", target, None, MS_BIND, None)
    if libc.umount2(b"/run/.tmp", 0):
        fail(f"umount /run/.tmp: {os.strerror(ctypes.get_errno())}")
    os.rmdir("/run/.tmp")
    if mq == "1":
        mount("astratk", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV, None)
    os.chdir("/run/sandbox")
    os.execv(command[0], command)
except OSError as e:
    fail(e)
"""


@dataclass(frozen=True)
class Namespaces:
    """What the process fallback gives each run on this machine (`probe()`)."""

    net: bool  # a network namespace of its own: no route anywhere, the host's abstract Unix sockets out of reach
    mounts: bool  # mount and IPC namespaces of its own: private /tmp, /var/tmp, /dev/shm, /run, SysV IPC
    user: bool  # made through a user namespace (we are not root): the program is that namespace's root, no capabilities
    why: str  # why not, when `net` or `mounts` is False ("" otherwise)

    def argv(self, base: str | None, disk_mb: int) -> list[str]:
        """argv prefix that runs the rest of the command line in these namespaces, with the private mounts made (the
        program's files are in `base`/work, and `base`/run is an empty directory; see PRIVATE_MOUNTS)."""
        if not (self.net or self.mounts):
            return []
        argv = [_tool("unshare")] + (["--user", "--map-root-user"] if self.user else [])
        argv += (["--mount", "--ipc"] if self.mounts else []) + (["--net"] if self.net else []) + ["--"]
        if self.mounts:
            if base is None:
                raise ValueError("private mounts need the run's base directory")
            mq = "1" if os.path.ismount("/dev/mqueue") else "0"
            python = sys.executable or _tool("python3")  # the host's: only its standard library is used
            argv += [python, "-I", "-S", "-c", PRIVATE_MOUNTS, base, f"{disk_mb}m", mq, *private_targets(), "--"]
        return argv


def private_targets() -> list[str]:
    """The shared writable directories a run gets its own of (one tmpfs): those that are real directories here."""
    return [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d) and not os.path.islink(d)]


def private_dirs() -> tuple[str, ...]:
    """Host directories a run under private mounts does not see (their real paths)."""
    return tuple(os.path.realpath(d) for d in (*private_targets(), PRIVATE_RUN))


_PROBED: dict[bool, Namespaces] = {}
_LOCK = threading.Lock()


def probe() -> Namespaces:
    """What this machine allows, found by trying it once per process (per root or not): the same argv a run uses,
    running `true`."""
    root = os.geteuid() == 0
    with _LOCK:
        if root not in _PROBED:
            _PROBED[root] = _probe(root)
        return _PROBED[root]


def _probe(root: bool) -> Namespaces:
    if not os.path.exists("/proc/self/ns/mnt") or shutil.which("unshare") is None:
        return Namespaces(False, False, False, "no Linux namespaces or no util-linux `unshare` (apt-get install -y "
                                               "util-linux)")
    user = not root
    both = Namespaces(True, True, user, "")
    ok, err = _try(both)
    if ok:
        return both
    net_only = Namespaces(True, False, user, f"private mounts failed: {err}")
    ok, err2 = _try(net_only)
    if ok:
        return net_only
    how = "unshare --user (user namespaces may be disabled here)" if user else "unshare as root"
    return Namespaces(False, False, user, f"{how} failed: {err2 or err}")


def _try(ns: Namespaces) -> tuple[bool, str]:
    with base_dir() as base:
        try:
            p = subprocess.run([*ns.argv(base, 1), shutil.which("true") or "/bin/true"], check=False,
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, str(e)
        return p.returncode == 0, p.stderr.decode("utf-8", "replace").strip()[-300:]


@contextlib.contextmanager
def base_dir() -> Iterator[str]:
    """A fresh host directory holding `work` (the run's files go there) and `run` (PRIVATE_MOUNTS builds /run on it);
    removed afterwards."""
    base = tempfile.mkdtemp(prefix="astratk-sandbox-")
    try:
        # without private mounts the program reaches its cwd through base: others may pass, not list; only the owner
        # (the run's uid, once the sandbox chowns it) may enter work
        os.chmod(base, 0o711)
        os.mkdir(os.path.join(base, "work"), 0o700)
        os.mkdir(os.path.join(base, "run"), 0o700)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------------------- host Unix sockets
def bound_socket_paths() -> set[str]:
    """Paths of Unix sockets bound to the filesystem, from the table of every network namespace we can see (one
    process's /proc/<pid>/net/unix per namespace). Abstract sockets (`@name`) are left out: a network namespace of
    its own hides them."""
    seen: set[str] = set()
    paths: set[str] = set()
    for entry in ["self", *os.listdir("/proc")]:
        if entry != "self" and not entry.isdigit():
            continue
        try:
            netns = os.readlink(f"/proc/{entry}/ns/net")
            if netns in seen:
                continue
            seen.add(netns)
            with open(f"/proc/{entry}/net/unix", "rb") as f:
                next(f, None)  # the header
                for line in f:
                    # Num RefCount Protocol Flags Type St Inode Path: the path is the rest of the line, if bound
                    parts = line.rstrip(b"\n").split(None, 7)
                    if len(parts) == 8 and not parts[7].startswith(b"@"):
                        paths.add(os.fsdecode(parts[7]))
        except OSError:
            continue
    return paths


def reachable_sockets(uid: int | None, shown: Callable[[str], bool]) -> list[str]:
    """Bound socket paths a run would see (`shown(real path)`) and may connect to: write permission on the socket and
    search permission on every directory above it, for `uid` (its own group is `uid` too), or for us when None (the
    run is our uid, or the root of a user namespace of ours without capabilities). Sorted."""
    out = []
    for path in bound_socket_paths():
        if not os.path.isabs(path):
            if shown(path):  # bound relative to a directory the table does not give: cannot be ruled out
                out.append(path)
            continue
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError:
            continue  # gone, or not reachable by path from here
        if not stat.S_ISSOCK(st.st_mode) or not shown(real):
            continue
        if uid is None:
            if os.access(real, os.W_OK):
                out.append(path)
            continue
        try:
            if _may(st, uid, 2) and all(_may(os.stat(d), uid, 1) for d in _ancestors(real)):
                out.append(path)
        except OSError:
            continue
    return sorted(out)


def under(path: str, dirs: tuple[str, ...]) -> bool:
    """Whether `path` is one of `dirs` or below one of them."""
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def _may(st: os.stat_result, uid: int, bit: int) -> bool:
    """Mode-bit permission (bit 2 write, 1 search) for `uid`, whose group is `uid` alone."""
    if st.st_uid == uid:
        return bool(st.st_mode >> 6 & bit)
    if st.st_gid == uid:
        return bool(st.st_mode >> 3 & bit)
    return bool(st.st_mode & bit)


def _ancestors(path: str) -> list[str]:
    out = []
    while path not in ("", "/"):
        path = os.path.dirname(path)
        out.append(path)
    return out


def _tool(name: str) -> str:
    # absolute: the sandbox's environment is minimal, so a PATH lookup there would be the C library's default
    exe = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
    if exe is None:
        raise RuntimeError(f"the sandbox needs `{name}` (apt-get install -y util-linux)")
    return exe

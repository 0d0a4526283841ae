"""The command lines that start a sandbox run, and what they carry in: bwrap's arguments (read-only system, capped
tmpfs, clean environment), setpriv + prlimit's (the run's uid and rlimits), the interpreter, and memfds for files and
stdin. `sandbox.py` says why each limit is there; a new isolation back-end adds its argv builder here and its run
method to `Sandbox`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence

WORKDIR = "/sandbox"  # the program's cwd inside bwrap (a tmpfs); named so it cannot be mistaken for a host path
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}

_PROBE: dict[str, bool] = {}
_PROBE_LOCK = threading.Lock()


def bwrap_available() -> bool:
    """True when bubblewrap is installed and can build the sandbox here (probed once per process)."""
    with _PROBE_LOCK:
        if "bwrap" not in _PROBE:
            ok = False
            if shutil.which("bwrap") and sys.platform.startswith("linux"):
                argv = [bwrap_path(), *bwrap_base(os.geteuid() == 0, 1, "/bin/true"), "--", "true"]
                try:
                    ok = subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                                        env={}).returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    ok = False
            _PROBE["bwrap"] = ok
        return _PROBE["bwrap"]


def bwrap_path() -> str:
    # absolute: the child's environment is empty, so a PATH lookup would only search /bin:/usr/bin
    return shutil.which("bwrap") or "bwrap"


def bwrap_base(as_root: bool, disk_mb: int, python: str) -> list[str]:
    # As root: no user namespace (processes must really be the unprivileged uid setpriv drops to, or RLIMIT_NPROC
    # would not bind); without root bwrap needs the user namespace to build the others.
    ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv = (ns if as_root else ["--unshare-all"]) + ["--die-with-parent", "--new-session", "--clearenv"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    prefix = prefix_of(python)
    if prefix and not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        # bwrap creates missing parents with the host's modes (/root is 0700: the dropped uid could not enter it)
        parts = prefix.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            argv += ["--perms", "0755", "--dir", "/" + "/".join(parts[: i + 1])]
        argv += ["--ro-bind", prefix, prefix]
    size = str(disk_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--perms", "1777", "--size", size, "--tmpfs", WORKDIR, "--chdir", WORKDIR]
    for k, v in dict(ENV, HOME=WORKDIR, TMPDIR="/tmp").items():
        argv += ["--setenv", k, v]
    return argv


def prefix_of(python: str) -> str | None:
    """The installation prefix to expose for an interpreter: <prefix>/bin/python3.X -> <prefix>."""
    parent = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    return parent if parent not in ("", "/") else None


def default_python() -> str:
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(sys.executable)  # outside a venv's view: the base interpreter it links to


def others_can_run(path: str) -> bool:
    """Whether a uid that is neither owner nor group can execute `path` (every ancestor searchable)."""
    if not os.path.exists(path) or not os.stat(path).st_mode & 0o001:
        return False
    while path not in ("", "/"):
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True


def tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise RuntimeError(f"the sandbox needs util-linux's `{name}` (apt-get install -y util-linux)")
    return exe


def memfd(name: str, content: str | bytes, readonly: bool = False) -> int:
    """An anonymous in-memory file holding `content`, offset 0 (bwrap copies it into the tmpfs; stdin reads it)."""
    data = content.encode() if isinstance(content, str) else content
    fd = os.memfd_create(name.replace("/", "_"), os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if readonly:  # the program gets a read-only descriptor, so it cannot grow this file in our memory
            ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            os.close(fd)
            return ro
        os.lseek(fd, 0, os.SEEK_SET)
        return fd
    except BaseException:
        os.close(fd)
        raise


def limits(cpu: float, uid: int | None, memory_mb: int, max_file_mb: int, max_procs: int) -> list[str]:
    """prlimit arguments. CPU: soft limit sends SIGXCPU, the hard one a second later SIGKILL."""
    c = max(1, int(cpu + 0.999))
    out = [f"--cpu={c}:{c + 1}", f"--as={memory_mb << 20}", f"--fsize={max_file_mb << 20}",
           "--nofile=256", "--core=0"]
    if uid is not None:  # with our own uid the count is ours alone; for a shared uid it would count the host's
        out.append(f"--nproc={max_procs}")
    return out


def program_argv(python: str, cpu: float, uid: int | None, args: Sequence[str], host: bool, *, memory_mb: int,
                 max_file_mb: int, max_procs: int, userns: bool = False) -> list[str]:
    """As root, setpriv drops to the run's uid (no capabilities, no new privileges), then prlimit sets the
    limits and execs the interpreter. `host`: the tools' host paths (else names, found by PATH inside bwrap).
    `userns`: the command starts as root of a user namespace of ours; setpriv drops its capabilities."""
    find = tool if host else str
    argv: list[str] = []
    if uid is not None:
        argv += [find("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs"]
    elif userns:
        argv += [find("setpriv"), "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    rlimits = limits(cpu, uid, memory_mb, max_file_mb, max_procs)
    return argv + [find("prlimit"), *rlimits, "--", python, "-I", "-B", "main.py", *args]

"""Uids of their own for sandbox runs, leased so no two live runs share one, and swept so none outlives its run.

Why: everything here may run as root, and RLIMIT_NPROC does not bind root. A run that drops to a uid
no other process uses gets a process count of its own, which RLIMIT_NPROC then caps, and `sweep` can kill everything
the run left behind, wherever it moved, with one `kill(-1)` sent as that uid.

Leases are flocks on per-uid files (in this process or any other; the kernel drops a lock when its holder dies). A uid
whose processes are still dying from an earlier run is swept before it is handed out, or skipped.

Where a run had no private mounts (the process sandbox where no mount namespace can be made), what its uid left in the
host's shared writable places goes too: `sweep_files` (/tmp, /var/tmp, /dev/shm, /run/lock, and any directory below
them others may write) and `sweep_ipc` (SysV shared memory, semaphores, message queues). Other world-writable
directories of a host, if it has any, are not searched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator


def uid_pids(uid: int, zombies: bool = False) -> list[int]:
    """Processes whose real uid is `uid`. Zombies only with `zombies`: they hold no memory, and the run's own killed
    child stays one until we reap it, but until their parent reaps them they count against RLIMIT_NPROC."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"State:") and line.split()[1] in (b"Z", b"X") and not zombies:
                        break
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(entry))
                        break
        except OSError:
            continue
    return pids


def sweep(uid: int, timeout: float = 5.0) -> None:
    """Kill every process of `uid`: `kill(-1, SIGKILL)` sent *as* that uid reaches all of them in one atomic pass
    (the kernel holds the task list while it signals, so a fork bomb cannot outrun it), whatever session they moved
    to. Then wait until they are gone, so the uid's process count is back to 0 for the next lease."""
    if not uid_pids(uid):
        return
    killer = shutil.which("kill") or "/bin/kill"
    argv = [killer, "-9", "-1"] if os.path.exists(killer) else [sys.executable, "-c", "import os; os.kill(-1, 9)"]
    with contextlib.suppress(OSError):
        subprocess.run(argv, check=False, user=uid, group=uid, extra_groups=[], env={}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    wait_gone(uid, timeout)


def wait_gone(uid: int, timeout: float = 5.0, zombies: bool = False) -> None:
    end = time.perf_counter() + timeout
    while uid_pids(uid, zombies) and time.perf_counter() < end:
        time.sleep(0.01)


SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # writable by every uid on a usual Linux host
_IPC = {"shm": "-m", "sem": "-s", "msg": "-q"}  # /proc/sysvipc table -> ipcrm's option for its ids


def sweep_files(uid: int, dirs: tuple[str, ...] = SHARED_DIRS) -> list[str]:
    """Remove every entry `uid` owns in `dirs` and in the directories below them that others may write (where the
    uid could have put one too: a sticky /tmp subdirectory, say); a directory it owns goes whole. Call it once the
    uid's processes are gone. Returns what was removed."""
    removed = []
    stack = [d for d in dirs if os.path.isdir(d) and not os.path.islink(d)]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid:
                with contextlib.suppress(OSError):
                    if stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(entry.path)  # does not follow symlinks the program may have planted
                    else:
                        os.unlink(entry.path)
                    removed.append(entry.path)
            elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002:
                stack.append(entry.path)
    return removed


def sweep_ipc(uid: int) -> list[str]:
    """Remove the SysV IPC objects (shared memory, semaphores, message queues) `uid` owns or created: shared memory
    outlives its processes and would hold host memory. Returns them as "shm:<id>"."""
    ipcrm = shutil.which("ipcrm", path="/usr/bin:/bin")
    removed = []
    for kind, opt in _IPC.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
        except (OSError, ValueError):
            continue
        col = {name: i for i, name in enumerate(header)}
        for row in rows:
            if uid in (int(row[col["uid"]]), int(row[col["cuid"]])) and ipcrm is not None:
                ident = row[col["shmid" if kind == "shm" else "semid" if kind == "sem" else "msqid"]]
                if subprocess.run([ipcrm, opt, ident], check=False, capture_output=True).returncode == 0:
                    removed.append(f"{kind}:{ident}")
    return removed


_LEASE_DIR = os.path.join(tempfile.gettempdir(), "astratk-sandbox-uids")
_LEASED: set[int] = set()
_LEASE_LOCK = threading.Lock()


@contextlib.contextmanager
def lease(base: int, slots: int) -> Iterator[int | None]:
    """A uid no other run uses right now, in this process or any other (flock on a per-uid file; the kernel drops the
    lock if the holder dies). None when we are not root: then nothing can be dropped to."""
    if os.geteuid() != 0:
        yield None
        return
    os.makedirs(_LEASE_DIR, mode=0o700, exist_ok=True)
    start = random.randrange(slots)
    for attempt in range(100):
        for k in range(slots):
            uid = base + (start + k) % slots
            with _LEASE_LOCK:
                if uid in _LEASED:
                    continue
                _LEASED.add(uid)
            fd = os.open(os.path.join(_LEASE_DIR, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                with _LEASE_LOCK:
                    _LEASED.discard(uid)
                continue
            if uid_pids(uid, zombies=True):  # leftovers of an earlier run still dying (a namespace's processes
                sweep(uid)  # die asynchronously after bwrap exits) would count against this run's process limit
                wait_gone(uid, zombies=True)  # killed ones stay zombies until their parent reaps them
                if uid_pids(uid, zombies=True):  # not reaped in time: use another uid
                    os.close(fd)
                    with _LEASE_LOCK:
                        _LEASED.discard(uid)
                    continue
            try:
                yield uid
            finally:
                os.close(fd)  # releases the flock
                with _LEASE_LOCK:
                    _LEASED.discard(uid)
            return
        time.sleep(0.01 * (attempt + 1))
    raise RuntimeError(f"all {slots} sandbox uids from {base} are in use; raise uid_slots")

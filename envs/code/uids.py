"""Uids of their own for sandbox runs, leased so no two live runs share one, and swept so none outlives its run.

Why: everything here may run as root, and RLIMIT_NPROC does not bind root. A run that drops to a uid
no other process uses gets a process count of its own, which RLIMIT_NPROC then caps, and `sweep` can kill everything
the run left behind, wherever it moved, with one `kill(-1)` sent as that uid.

Leases are flocks on per-uid files (in this process or any other; the kernel drops a lock when its holder dies). A uid
whose processes are still dying from an earlier run is swept before it is handed out, or skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
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

"""One launched sandbox run, from start to `SandboxResult`: both pipes read with output caps, the wall clock and the
cgroup's OOM kills watched, then everything the run left (processes, files, IPC) cleared away. A new way a run can
end gets its `killed_by` name in `execute` or `collect`, and its line in `SandboxResult`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from astratk.envs.code import cgroup as cgroups
from astratk.envs.code import namespaces, uids
from astratk.envs.code.launch import ENV, WORKDIR

POLL_S = 0.05  # how often the reader loop checks for exit, deadline and OOM kills when no output arrives


@dataclass(frozen=True)
class SandboxResult:
    """What one run did. `returncode` < 0 is the signal that ended it (bwrap's 128+N is mapped back to -N)."""

    returncode: int
    stdout: str  # first max_output_bytes of stdout (utf-8, undecodable bytes replaced)
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool  # wall clock ran out and the run was killed
    killed_by: str | None  # "wall_timeout" | "output_limit" | "cpu_limit" | "memory_limit" (the run's cgroup ran out)
    #                         | "SIG<NAME>" | None (exited by itself)
    isolation: str  # "bwrap" | "process": what actually contained this run
    own_uid: bool  # ran as a uid of its own, so the process limit bound (False only when not started as root)
    wall_s: float
    cgroup: bool  # a cgroup of its own capped the run's total memory and process count
    own_network: bool  # nothing outside the run reachable by any socket: a network namespace of its own and no host
    #                    Unix socket the run could see and write when it started (`sandbox`'s docstring)
    own_mounts: bool  # private /tmp, /var/tmp, /dev/shm and IPC: nothing it left there outlives the run

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_by is None


def execute(argv: list[str], stdin_fd: int, pass_fds: tuple[int, ...], cwd: str | None, wall: float, isolation: str,
            uid: int | None, cg: cgroups.RunCgroup | None, own_network: bool, *, own_mounts: bool,
            max_output_bytes: int) -> SandboxResult:
    """Start `argv` (bwrap's, or the process fallback's) and wait for the run's end; `cg` is the run's cgroup."""
    start = time.perf_counter()
    if isolation == "process" and own_mounts:  # the private /run/sandbox and /tmp
        env = dict(ENV, HOME=namespaces.PROCESS_WORKDIR, TMPDIR="/tmp")
    else:
        env = dict(ENV, HOME=cwd or WORKDIR, TMPDIR=cwd or "/tmp")
    # Everything before the program runs as root: the launcher joins the run's cgroup, then (process mode) unshare
    # makes the namespaces and the private mounts, then setpriv drops to the run's uid. Nothing is done between
    # fork and exec in Python (no preexec_fn), so this stays thread-safe.
    argv = (cg.launcher() if cg is not None else []) + argv
    proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                            env=env if isolation == "process" else {}, pass_fds=pass_fds, close_fds=True,
                            start_new_session=True)
    sweep = uid if isolation == "process" else None
    out, err, killed_by = collect(proc, start + wall, sweep, cg, max_output_bytes)
    try:  # pipes closed need not mean exited: a program may close its stdout and stderr, then loop
        rc = proc.wait(timeout=max(0.0, start + wall - time.perf_counter()))
    except subprocess.TimeoutExpired:
        killed_by = killed_by or "wall_timeout"
        _kill(proc, sweep, cg)
        rc = proc.wait()
    if cg is not None:
        if killed_by is None and cg.oom_kills():
            killed_by = "memory_limit"  # a process died of it, even if the program went on and exited
        cg.kill()  # descendants that outlived the program, whatever uid or session they have
    if isolation == "process" and uid is not None:
        uids.sweep(uid)  # daemons a program left behind, even those that escaped its session
        if not own_mounts:  # the host's /tmp, /dev/shm, SysV IPC: what it left there goes too
            uids.sweep_files(uid)
            uids.sweep_ipc(uid)
    elif killed_by is not None and uid is not None:
        uids.wait_gone(uid)  # the namespace dies with bwrap; wait so the next lease of this uid starts at 0
    if isolation == "bwrap" and rc > 128 and killed_by is None:
        rc = -(rc - 128)  # bwrap reports a signal death of the program as 128+N
    if killed_by is None and rc < 0:
        killed_by = "cpu_limit" if -rc == signal.SIGXCPU else _signame(-rc)
    return SandboxResult(returncode=rc, stdout=out[0].decode("utf-8", "replace"),
                         stderr=err[0].decode("utf-8", "replace"), stdout_truncated=out[1],
                         stderr_truncated=err[1], timed_out=killed_by == "wall_timeout", killed_by=killed_by,
                         isolation=isolation, own_uid=uid is not None, wall_s=time.perf_counter() - start,
                         # a program running as our own uid outside bwrap could write itself out of the cgroup
                         cgroup=cg is not None and (isolation == "bwrap" or uid is not None),
                         own_network=own_network, own_mounts=own_mounts)


def collect(proc: subprocess.Popen, deadline: float, sweep_uid: int | None, cg: cgroups.RunCgroup | None, cap: int
            ) -> tuple[tuple[bytes, bool], tuple[bytes, bool], str | None]:
    """Read both pipes until EOF, keeping at most `cap` bytes each; kill on deadline, overflow or the
    first OOM kill in the run's cgroup (v1 kills one process; the rest of the run goes with it, as on v2)."""
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    trunc = dict.fromkeys(bufs, False)
    killed_by: str | None = None
    exited_at: float | None = None
    oom_check = 0.0
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            now = time.perf_counter()
            if cg is not None and killed_by is None and now >= oom_check:
                oom_check = now + POLL_S
                if cg.oom_kills():
                    killed_by = "memory_limit"
                    _kill(proc, sweep_uid, cg)
                    deadline = now + 5.0
            if now >= deadline and killed_by is None:
                killed_by = "wall_timeout"
                _kill(proc, sweep_uid, cg)
                deadline = now + 5.0  # the pipes close once the killed processes are gone
            elif now >= deadline:
                break  # killed and still not closed: give up on the pipes rather than hang
            if exited_at is None and _exited(proc):
                exited_at = now
            elif exited_at is not None and now - exited_at > 0.2 and (sweep_uid is not None or cg is not None):
                _kill(proc, sweep_uid, cg)  # the program exited but a descendant keeps the pipes open
                sweep_uid = cg = None
            for key, _ in sel.select(timeout=min(POLL_S, max(0.0, deadline - now))):
                fd = key.fd
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                if len(buf) + len(chunk) > cap:
                    buf += chunk[: cap - len(buf)]
                    trunc[fd] = True
                    if killed_by is None:
                        killed_by = "output_limit"
                        _kill(proc, sweep_uid, cg)
                else:
                    buf += chunk
    fo, fe = list(bufs)
    proc.stdout.close()
    proc.stderr.close()
    return (bytes(bufs[fo]), trunc[fo]), (bytes(bufs[fe]), trunc[fe]), killed_by


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the program exited, *without* reaping it: until `wait` reaps it, its pid (its process group's id)
    cannot be reused, so `_kill`'s killpg never reaches an unrelated group that took the number."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill(proc: subprocess.Popen, uid: int | None, cg: cgroups.RunCgroup | None) -> None:
    """Kill the run's session (bwrap: the namespace dies with it), everything in its cgroup and, in process mode,
    everything its uid owns."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if cg is not None:
        cg.kill()
    if uid is not None:
        uids.sweep(uid)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"

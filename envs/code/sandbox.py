"""Run untrusted Python in a separate, limited, disposable process, and say how well it was contained.

Two isolation levels; `Sandbox(isolation="auto")` takes the strongest this machine allows and every `SandboxResult`
names the one used (`isolation`), so weaker containment is never silent:

| | `bwrap` (bubblewrap, `apt-get install -y bubblewrap`) | `process` (fallback) |
|---|---|---|
| process | own pid namespace; killing it kills every descendant | own session; descendants swept by uid |
| network | own empty network namespace (no interfaces but lo) | own network namespace where one can be made (`namespaces.py`: as root, or through a user namespace); otherwise the host's |
| IPC | own IPC namespace | own IPC namespace with the mounts below; otherwise the host's, and what the run's uid left there is removed |
| files | read-only /usr, /etc; tmpfs / , /tmp and cwd `/sandbox` (size-capped); nothing else of the host | the host's files, as an unprivileged uid, with private /tmp, /var/tmp, /dev/shm (one tmpfs of `max_disk_mb`) and an empty /run where a mount namespace can be made (`own_mounts`), cwd `/run/sandbox` (a fresh host dir, bound); otherwise the host's /tmp etc., and what the run's uid left in them is removed after the run (`uids.sweep_files`) |
| environment | empty except PATH, HOME, LANG | same |
| limits | rlimits: CPU, address space, file size, open files, no core; processes (RLIMIT_NPROC) | same |
| whole run | a cgroup of its own where the machine allows (`cgroup`): total memory, tmpfs included, and process count | same |

What results report, so weaker containment is never silent: `isolation`, `own_uid`, `cgroup` (below), `own_mounts`
(nothing the run writes to /tmp, /var/tmp, /dev/shm or SysV IPC outlives it or is seen by another run) and
`own_network`: the run could open no connection to anything outside it. That takes a network namespace of its own (no
route anywhere; the host's abstract Unix sockets are another namespace's) *and* no host Unix socket bound to a path
the run can see and write, which a network namespace does not hide (`namespaces.reachable_sockets`, checked as the
run starts: bwrap sees only the read-only system directories; the process fallback sees all of the host's files but its
private directories, so a world-writable socket elsewhere makes its runs report `own_network` False;
`Sandbox.reachable_sockets()` lists them).

Why an unprivileged uid: everything here may run as root, and RLIMIT_NPROC does not bind root. So as
root each run drops to a uid of its own (`uid_base` + slot, leased through a lock file, so concurrent runs, in this or
another process, never share a process count), and its process limit then binds. bwrap runs without a user namespace
for the same reason: inside a user namespace the processes would still be kernel uid 0, which RLIMIT_NPROC exempts.
Without root no uid can be dropped: `own_uid` is then False and a fork bomb is stopped only by the wall clock (the
process fallback then takes its namespaces through a user namespace, where the kernel allows one: `namespaces.py`).

The interpreter: the host's `sys.executable` often lives in a virtual environment under a directory the sandbox cannot
see (and should not: it holds the trainer's packages). By default programs run under `/usr/bin/python3` (Debian's;
stdlib plus any `python3-*` apt packages), the same interpreter in both modes. When it is missing, or with
`python=sys.executable`, the real file behind the path runs (a venv's python links to its base interpreter, so the
venv's packages stay out) and in bwrap mode its prefix (`<prefix>/bin/python3.X`) is bound read-only at the same path.

Output: each of stdout and stderr keeps its first `max_output_bytes` and the run is killed as soon as either exceeds it
(`killed_by="output_limit"`), so memory stays bounded and a `while True: print()` costs nothing more.

Memory: RLIMIT_AS caps each process at `memory_mb` (a clean MemoryError), so without more one run could hold
max_procs x memory_mb (+ its two tmpfs): 64 x 512 MB is 32 GB. So where the machine allows (root, or a delegated v2
cgroup) each run gets a cgroup of its own (`cgroup.py`, a child of our own cgroup, v1 or v2) capping the run's total at
`run_memory_mb` (default `memory_mb`) and its processes at max_procs (+2 for bwrap's own) whatever their uid; a run
that exceeds it is killed whole (`killed_by="memory_limit"`), and the cgroup is emptied and removed after every run.
Where none can be made (`cgroup.probe()` says why), a guard refuses at construction, as root, any configuration whose
max_procs x memory_mb (+ tmpfs) exceeds `RAM_SHARE` of this machine's memory (or of our own cgroup's memory limit, a
container's, when lower), with the fix in the message; a max_procs left at its default (16) is lowered to fit instead,
one given explicitly never is. Without root and without a cgroup nothing bounds the process count (`own_uid`
and `cgroup` both False in the results), so there is nothing to check. `cgroup=False` forces the guard, `cgroup=True`
refuses to construct without a cgroup. Results say which held the run (`SandboxResult.cgroup`).

`run` is safe to call from many threads at once: it keeps no shared state besides the uid leases and a cached probe.
bwrap's --die-with-parent is tied to the calling *thread*: `run` blocks that thread until the sandbox is gone.

Example:
    >>> sb = Sandbox(wall_s=5, max_procs=16)
    >>> r = sb.run("print(input()[::-1])", stdin="abc")
    >>> (r.returncode, r.stdout, r.isolation in ("bwrap", "process"))
    (0, 'cba\\n', True)
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from astratk.envs.code import cgroup as cgroups
from astratk.envs.code import namespaces, uids

Isolation = Literal["auto", "bwrap", "process"]
WORKDIR = "/sandbox"  # the program's cwd inside bwrap (a tmpfs); named so it cannot be mistaken for a host path
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
_POLL_S = 0.05  # how often the reader loop checks for exit, deadline and OOM kills when no output arrives
RAM_SHARE = 0.5  # without a cgroup, the most of this machine's memory one run's worst case may claim
DEFAULT_MAX_PROCS = 16  # max_procs when not given; lowered (never below 1) where the RAM guard would refuse it
_OWN_PIDS = 2  # processes of a run that are not the program's: bwrap and its pid-1 reaper (root, outside RLIMIT_NPROC)


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
    #                    Unix socket the run could see and write when it started (module docstring)
    own_mounts: bool  # private /tmp, /var/tmp, /dev/shm and IPC: nothing it left there outlives the run

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_by is None


class Sandbox:
    """Limits are per run; `cpu_s` and `memory_mb` are per process (rlimits), `max_procs` per run (own uid and, where
    one can be made, the run's cgroup), `run_memory_mb` (default `memory_mb`) per run (the cgroup).

    `max_disk_mb` sizes each tmpfs (cwd and /tmp) in bwrap mode, and in process mode the one behind its private /tmp,
    /var/tmp and /dev/shm; its cwd is a host directory, where only `max_file_mb` bounds files.
    `cgroup`: None uses one where the machine allows, True requires one, False never makes one (the RAM guard applies).
    """

    def __init__(self, isolation: Isolation = "auto", cpu_s: float = 10.0, wall_s: float = 20.0, memory_mb: int = 512,
                 max_procs: int | None = None, max_file_mb: int = 16, max_output_bytes: int = 1 << 20, max_disk_mb: int = 64,
                 python: str | None = None, uid_base: int = 1_000_000, uid_slots: int = 1024,
                 run_memory_mb: int | None = None, cgroup: bool | None = None) -> None:
        if isolation not in ("auto", "bwrap", "process"):
            raise ValueError(f"isolation must be 'auto', 'bwrap' or 'process', got {isolation!r}")
        run_memory_mb = memory_mb if run_memory_mb is None else run_memory_mb
        self._procs_given = max_procs is not None
        max_procs = DEFAULT_MAX_PROCS if max_procs is None else max_procs
        for name, v in (("cpu_s", cpu_s), ("wall_s", wall_s), ("memory_mb", memory_mb), ("max_procs", max_procs),
                        ("max_file_mb", max_file_mb), ("max_output_bytes", max_output_bytes),
                        ("max_disk_mb", max_disk_mb), ("uid_slots", uid_slots), ("run_memory_mb", run_memory_mb)):
            if v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if isolation == "bwrap" and not bwrap_available():
            raise ValueError("isolation='bwrap' but bubblewrap is missing or cannot create namespaces here; "
                             "install it (`apt-get install -y bubblewrap`) or use isolation='auto'/'process'")
        self.requested = isolation
        self.isolation = "bwrap" if isolation == "bwrap" or (isolation == "auto" and bwrap_available()) else "process"
        self.cpu_s, self.wall_s, self.memory_mb, self.max_procs = cpu_s, wall_s, memory_mb, max_procs
        self.max_file_mb, self.max_output_bytes, self.max_disk_mb = max_file_mb, max_output_bytes, max_disk_mb
        # the real file: a venv's python is a link to its base interpreter, which is what runs inside (the venv's
        # packages stay outside); its prefix is bound read-only when it is not under /usr
        self.python = os.path.realpath(python) if python else _default_python()
        self.uid_base, self.uid_slots = uid_base, uid_slots
        if self.isolation == "process" and os.geteuid() == 0 and not _others_can_run(self.python):
            raise ValueError(f"the process sandbox runs programs as an unprivileged uid, which cannot reach "
                             f"{self.python} (a parent directory is not world-executable); pass python= an "
                             "interpreter under /usr (apt-get install -y python3) or install bubblewrap")
        self.run_memory_mb = run_memory_mb
        self._layout, why = cgroups.probe() if cgroup is not False else (None, "cgroup=False")
        if cgroup and self._layout is None:
            raise ValueError(f"cgroup=True but no cgroup can be made here: {why}; pass cgroup=None to use the RAM "
                             "guard instead")
        self.cgroup = self._layout is not None
        # what the process fallback can get here (bwrap makes its own); results say what each run had
        self._ns = namespaces.probe() if self.isolation == "process" else None
        self.netns = self._ns is None or self._ns.net  # runs get a network namespace of their own
        self.own_mounts = self._ns is None or self._ns.mounts  # ... and private /tmp, /var/tmp, /dev/shm, /run, IPC
        self._check_memory_bound(why)

    def __repr__(self) -> str:
        return (f"Sandbox(isolation={self.isolation!r}, cgroup={self.cgroup}, netns={self.netns}, "
                f"own_mounts={self.own_mounts}, cpu_s={self.cpu_s}, "
                f"wall_s={self.wall_s}, memory_mb={self.memory_mb}, run_memory_mb={self.run_memory_mb}, "
                f"max_procs={self.max_procs}, python={self.python!r})")

    def _check_memory_bound(self, no_cgroup: str) -> None:
        """The most one run can hold must fit in RAM_SHARE of this machine. With a cgroup that is run_memory_mb;
        without, as root, every one of max_procs processes may fill its address-space limit, plus bwrap's two tmpfs.
        Without root and cgroup nothing bounds the process count, so there is no product to check (`own_uid`)."""
        ram_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
        limit_mb = cgroups.own_memory_limit_mb()  # a container's cap, when below the machine's RAM, is the bound
        if limit_mb is not None and limit_mb < ram_mb:
            ram_mb = limit_mb
        cap = int(RAM_SHARE * ram_mb)
        if self.cgroup and self.run_memory_mb > cap:
            raise ValueError(f"run_memory_mb={self.run_memory_mb} is over {RAM_SHARE:.0%} of this machine's "
                             f"{ram_mb} MB; pass run_memory_mb <= {cap}")
        tmpfs = 2 * self.max_disk_mb if self.isolation == "bwrap" else self.max_disk_mb if self.own_mounts else 0
        guarded = not self.cgroup and os.geteuid() == 0
        if guarded and not self._procs_given:  # the default adapts; a value the caller gave is never lowered
            self.max_procs = max(1, min(self.max_procs, (cap - tmpfs) // self.memory_mb))
        worst = self.max_procs * self.memory_mb + tmpfs
        if guarded and worst > cap:
            raise ValueError(
                f"no cgroup can cap a run's total memory here ({no_cgroup}), so one run could hold max_procs x "
                f"memory_mb = {self.max_procs} x {self.memory_mb} MB (+{tmpfs} MB tmpfs) = {worst} MB, over "
                f"{RAM_SHARE:.0%} of this machine's {ram_mb} MB; lower them so the product stays under {cap} MB "
                f"(e.g. max_procs={max(1, (cap - tmpfs) // self.memory_mb)}), or run where /sys/fs/cgroup is writable")

    # ------------------------------------------------------------------------------------------------------ run
    def run(self, code: str, stdin: str | bytes | None = None, files: Mapping[str, str | bytes] | None = None,
            args: Sequence[str] = (), wall_s: float | None = None, cpu_s: float | None = None) -> SandboxResult:
        """Run `code` as `main.py` in a fresh working directory holding `files` (read-only to the program), with
        `stdin` on standard input and `args` as `sys.argv[1:]`. `wall_s`/`cpu_s` override the sandbox's for this run."""
        files = dict(files or {})
        for name in files:
            _check_name(name)
        if "main.py" in files:
            raise ValueError("files may not contain 'main.py': it holds `code`")
        files["main.py"] = code
        wall = self.wall_s if wall_s is None else wall_s
        cpu = self.cpu_s if cpu_s is None else cpu_s
        with uids.lease(self.uid_base, self.uid_slots) as uid, self._run_cgroup() as cg:
            own_network = self.netns and not self._reachable_sockets(uid)
            if self.isolation == "bwrap":
                return self._run_bwrap(files, stdin, args, wall, cpu, uid, cg, own_network)
            return self._run_process(files, stdin, args, wall, cpu, uid, cg, own_network)

    def reachable_sockets(self) -> list[str]:
        """Host Unix sockets bound to a path a run could connect to now (why runs report `own_network` False when
        they have a network namespace): every run uid has the same rights on them, so `uid_base`'s are checked."""
        return self._reachable_sockets(self.uid_base if os.geteuid() == 0 else None)

    def _reachable_sockets(self, uid: int | None) -> list[str]:
        if self.isolation == "bwrap":
            view = tuple(os.path.realpath(d) for d in _SYSTEM_DIRS) + tuple(filter(None, [_prefix_of(self.python)]))
            return namespaces.reachable_sockets(uid, lambda p: namespaces.under(p, view))
        if self.own_mounts:
            hidden = namespaces.private_dirs()
            return namespaces.reachable_sockets(uid, lambda p: not namespaces.under(p, hidden))
        return namespaces.reachable_sockets(uid, lambda p: True)

    @contextlib.contextmanager
    def _run_cgroup(self) -> Iterator[cgroups.RunCgroup | None]:
        if self._layout is None:
            yield None
            return
        cg = cgroups.RunCgroup(self._layout, self.run_memory_mb << 20, self.max_procs + _OWN_PIDS)
        try:
            yield cg
        finally:
            cg.close()  # kills whatever is left in it, then removes it

    def _limits(self, cpu: float, uid: int | None) -> list[str]:
        """prlimit arguments. CPU: soft limit sends SIGXCPU, the hard one a second later SIGKILL."""
        c = max(1, int(cpu + 0.999))
        out = [f"--cpu={c}:{c + 1}", f"--as={self.memory_mb << 20}", f"--fsize={self.max_file_mb << 20}",
               "--nofile=256", "--core=0"]
        if uid is not None:  # with our own uid the count is ours alone; for a shared uid it would count the host's
            out.append(f"--nproc={self.max_procs}")
        return out

    def _program_argv(self, cpu: float, uid: int | None, args: Sequence[str], host: bool,
                      userns: bool = False) -> list[str]:
        """As root, setpriv drops to the run's uid (no capabilities, no new privileges), then prlimit sets the
        limits and execs the interpreter. `host`: the tools' host paths (else names, found by PATH inside bwrap).
        `userns`: the command starts as root of a user namespace of ours; setpriv drops its capabilities."""
        tool = _tool if host else str
        argv: list[str] = []
        if uid is not None:
            argv += [tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                     "--bounding-set=-all", "--no-new-privs"]
        elif userns:
            argv += [tool("setpriv"), "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        return argv + [tool("prlimit"), *self._limits(cpu, uid), "--", self.python, "-I", "-B", "main.py", *args]

    def _run_bwrap(self, files: dict[str, str | bytes], stdin: str | bytes | None, args: Sequence[str], wall: float,
                   cpu: float, uid: int | None, cg: cgroups.RunCgroup | None, own_network: bool) -> SandboxResult:
        fds: list[int] = []
        try:
            argv = [_bwrap_path(), *_bwrap_base(uid is not None, self.max_disk_mb, self.python)]
            for name in sorted(files):
                fd = _memfd(name, files[name])
                fds.append(fd)
                argv += ["--perms", "0644", "--file", str(fd), f"{WORKDIR}/{name}"]
            argv += ["--", *self._program_argv(cpu, uid, args, host=False)]
            stdin_fd = _memfd("stdin", stdin or b"", readonly=True)
            file_fds = tuple(fds)
            fds.append(stdin_fd)
            return self._execute(argv, stdin_fd, file_fds, None, wall, "bwrap", uid, cg, own_network)
        finally:
            for fd in fds:
                os.close(fd)

    def _run_process(self, files: dict[str, str | bytes], stdin: str | bytes | None, args: Sequence[str],
                     wall: float, cpu: float, uid: int | None, cg: cgroups.RunCgroup | None,
                     own_network: bool) -> SandboxResult:
        assert self._ns is not None
        with namespaces.base_dir() as base:  # base/work: the program's files and cwd; base/run: its private /run
            workdir = os.path.join(base, "work")
            stdin_fd = -1
            try:
                self._write_files(workdir, files)
                if uid is not None:
                    os.chown(workdir, uid, uid)
                stdin_fd = _memfd("stdin", stdin or b"", readonly=True)
                argv = self._ns.argv(base, self.max_disk_mb) + self._program_argv(
                    cpu, uid, args, host=True, userns=self._ns.user and (self._ns.net or self._ns.mounts))
                return self._execute(argv, stdin_fd, (), workdir, wall, "process", uid, cg, own_network)
            finally:
                if stdin_fd >= 0:
                    os.close(stdin_fd)

    @staticmethod
    def _write_files(workdir: str, files: dict[str, str | bytes]) -> None:
        for name, content in files.items():
            path = os.path.join(workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)

    # -------------------------------------------------------------------------------------------------- execute
    def _execute(self, argv: list[str], stdin_fd: int, pass_fds: tuple[int, ...], cwd: str | None, wall: float,
                 isolation: str, uid: int | None, cg: cgroups.RunCgroup | None, own_network: bool) -> SandboxResult:
        start = time.perf_counter()
        own_mounts = self.own_mounts
        if isolation == "process" and own_mounts:  # the private /run/sandbox and /tmp
            env = dict(_ENV, HOME=namespaces.PROCESS_WORKDIR, TMPDIR="/tmp")
        else:
            env = dict(_ENV, HOME=cwd or WORKDIR, TMPDIR=cwd or "/tmp")
        # Everything before the program runs as root: the launcher joins the run's cgroup, then (process mode) unshare
        # makes the namespaces and the private mounts, then setpriv drops to the run's uid. Nothing is done between
        # fork and exec in Python (no preexec_fn), so this stays thread-safe.
        argv = (cg.launcher() if cg is not None else []) + argv
        proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                env=env if isolation == "process" else {}, pass_fds=pass_fds, close_fds=True,
                                start_new_session=True)
        sweep = uid if isolation == "process" else None
        out, err, killed_by = self._collect(proc, start + wall, sweep, cg)
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

    def _collect(self, proc: subprocess.Popen, deadline: float, sweep_uid: int | None, cg: cgroups.RunCgroup | None
                 ) -> tuple[tuple[bytes, bool], tuple[bytes, bool], str | None]:
        """Read both pipes until EOF, keeping at most max_output_bytes each; kill on deadline, overflow or the
        first OOM kill in the run's cgroup (v1 kills one process; the rest of the run goes with it, as on v2)."""
        assert proc.stdout is not None and proc.stderr is not None
        cap = self.max_output_bytes
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
                    oom_check = now + _POLL_S
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
                for key, _ in sel.select(timeout=min(_POLL_S, max(0.0, deadline - now))):
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


# ------------------------------------------------------------------------------------------------------ helpers
_PROBE: dict[str, bool] = {}
_PROBE_LOCK = threading.Lock()


def bwrap_available() -> bool:
    """True when bubblewrap is installed and can build the sandbox here (probed once per process)."""
    with _PROBE_LOCK:
        if "bwrap" not in _PROBE:
            ok = False
            if shutil.which("bwrap") and sys.platform.startswith("linux"):
                argv = [_bwrap_path(), *_bwrap_base(os.geteuid() == 0, 1, "/bin/true"), "--", "true"]
                try:
                    ok = subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                                        env={}).returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    ok = False
            _PROBE["bwrap"] = ok
        return _PROBE["bwrap"]


def _bwrap_path() -> str:
    # absolute: the child's environment is empty, so a PATH lookup would only search /bin:/usr/bin
    return shutil.which("bwrap") or "bwrap"


def _bwrap_base(as_root: bool, disk_mb: int, python: str) -> list[str]:
    # As root: no user namespace (processes must really be the unprivileged uid setpriv drops to, or RLIMIT_NPROC
    # would not bind); without root bwrap needs the user namespace to build the others.
    ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv = (ns if as_root else ["--unshare-all"]) + ["--die-with-parent", "--new-session", "--clearenv"]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    prefix = _prefix_of(python)
    if prefix and not any(prefix == d or prefix.startswith(d + "/") for d in _SYSTEM_DIRS):
        # bwrap creates missing parents with the host's modes (/root is 0700: the dropped uid could not enter it)
        parts = prefix.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            argv += ["--perms", "0755", "--dir", "/" + "/".join(parts[: i + 1])]
        argv += ["--ro-bind", prefix, prefix]
    size = str(disk_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
             "--perms", "1777", "--size", size, "--tmpfs", WORKDIR, "--chdir", WORKDIR]
    for k, v in dict(_ENV, HOME=WORKDIR, TMPDIR="/tmp").items():
        argv += ["--setenv", k, v]
    return argv


def _prefix_of(python: str) -> str | None:
    """The installation prefix to expose for an interpreter: <prefix>/bin/python3.X -> <prefix>."""
    parent = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    return parent if parent not in ("", "/") else None


def _default_python() -> str:
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(sys.executable)  # outside a venv's view: the base interpreter it links to


def _others_can_run(path: str) -> bool:
    """Whether a uid that is neither owner nor group can execute `path` (every ancestor searchable)."""
    if not os.path.exists(path) or not os.stat(path).st_mode & 0o001:
        return False
    while path not in ("", "/"):
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise RuntimeError(f"the sandbox needs util-linux's `{name}` (apt-get install -y util-linux)")
    return exe


def _check_name(name: str) -> None:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"sandbox file name {name!r} must be a relative path without '.', '..' or empty parts")


def _memfd(name: str, content: str | bytes, readonly: bool = False) -> int:
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

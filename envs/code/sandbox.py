"""Run untrusted Python in a separate, limited, disposable process, and say how well it was contained.

This module holds `Sandbox`: its limits and guards, and one method per isolation back-end; `launch.py` builds the
command lines a run starts with, `execute.py` runs one and collects its `SandboxResult`.

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
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

from astratk.envs.code import cgroup as cgroups
from astratk.envs.code import launch, namespaces, uids
from astratk.envs.code.execute import SandboxResult, execute

Isolation = Literal["auto", "bwrap", "process"]
RAM_SHARE = 0.5  # without a cgroup, the most of this machine's memory one run's worst case may claim
DEFAULT_MAX_PROCS = 16  # max_procs when not given; lowered (never below 1) where the RAM guard would refuse it
_OWN_PIDS = 2  # processes of a run that are not the program's: bwrap and its pid-1 reaper (root, outside RLIMIT_NPROC)


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
        if isolation == "bwrap" and not launch.bwrap_available():
            raise ValueError("isolation='bwrap' but bubblewrap is missing or cannot create namespaces here; "
                             "install it (`apt-get install -y bubblewrap`) or use isolation='auto'/'process'")
        self.requested = isolation
        bwrap = isolation == "bwrap" or (isolation == "auto" and launch.bwrap_available())
        self.isolation = "bwrap" if bwrap else "process"
        self.cpu_s, self.wall_s, self.memory_mb, self.max_procs = cpu_s, wall_s, memory_mb, max_procs
        self.max_file_mb, self.max_output_bytes, self.max_disk_mb = max_file_mb, max_output_bytes, max_disk_mb
        # the real file: a venv's python is a link to its base interpreter, which is what runs inside (the venv's
        # packages stay outside); its prefix is bound read-only when it is not under /usr
        self.python = os.path.realpath(python) if python else launch.default_python()
        self.uid_base, self.uid_slots = uid_base, uid_slots
        if self.isolation == "process" and os.geteuid() == 0 and not launch.others_can_run(self.python):
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
            view = (tuple(os.path.realpath(d) for d in launch.SYSTEM_DIRS)
                    + tuple(filter(None, [launch.prefix_of(self.python)])))
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

    def _run_bwrap(self, files: dict[str, str | bytes], stdin: str | bytes | None, args: Sequence[str], wall: float,
                   cpu: float, uid: int | None, cg: cgroups.RunCgroup | None, own_network: bool) -> SandboxResult:
        fds: list[int] = []
        try:
            argv = [launch.bwrap_path(), *launch.bwrap_base(uid is not None, self.max_disk_mb, self.python)]
            for name in sorted(files):
                fd = launch.memfd(name, files[name])
                fds.append(fd)
                argv += ["--perms", "0644", "--file", str(fd), f"{launch.WORKDIR}/{name}"]
            argv += ["--", *self._program_argv(cpu, uid, args, host=False)]
            stdin_fd = launch.memfd("stdin", stdin or b"", readonly=True)
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
                stdin_fd = launch.memfd("stdin", stdin or b"", readonly=True)
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

    def _program_argv(self, cpu: float, uid: int | None, args: Sequence[str], host: bool,
                      userns: bool = False) -> list[str]:
        # the limits as they are at this run: a caller may change the attributes between runs
        return launch.program_argv(self.python, cpu, uid, args, host, memory_mb=self.memory_mb,
                                   max_file_mb=self.max_file_mb, max_procs=self.max_procs, userns=userns)

    def _execute(self, argv: list[str], stdin_fd: int, pass_fds: tuple[int, ...], cwd: str | None, wall: float,
                 isolation: str, uid: int | None, cg: cgroups.RunCgroup | None, own_network: bool) -> SandboxResult:
        return execute(argv, stdin_fd, pass_fds, cwd, wall, isolation, uid, cg, own_network,
                       own_mounts=self.own_mounts, max_output_bytes=self.max_output_bytes)


def _check_name(name: str) -> None:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"sandbox file name {name!r} must be a relative path without '.', '..' or empty parts")

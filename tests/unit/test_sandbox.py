"""The sandbox contains hostile programs: fork bombs, infinite loops, memory bombs (also ones that fork first),
network connections (TCP, and host Unix sockets by path and abstract name), writes outside the sandbox (also to /tmp,
/var/tmp and /dev/shm, and SysV shared memory), secret-reading and output floods each end contained, and the host can
still fork, has no stray processes or cgroups, and holds no file the program wrote. Every test runs in each isolation
mode this machine has: bubblewrap when it is installed (`apt-get install -y bubblewrap`), and always the process
fallback (whose weaker containment where the machine allows no namespaces, the host's network, is asserted to be
*reported*, not hidden). The fallback's other ways (no mount namespace: files swept; no root: a user namespace) are
forced by simulating what the machine allows.

Skips that would hide the strongest containment turn into failures on request: `ASTRATK_REQUIRE_BWRAP=1` (CI sets it)
when bubblewrap cannot create namespaces, `ASTRATK_REQUIRE_CGROUP=1` when no per-run cgroup can be made."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from astratk.envs.code import cgroup as cgroups
from astratk.envs.code import namespaces
from astratk.envs.code.execute import SandboxResult
from astratk.envs.code.launch import bwrap_available
from astratk.envs.code.sandbox import RAM_SHARE, Sandbox

ROOT = os.geteuid() == 0
REQUIRE_BWRAP = os.environ.get("ASTRATK_REQUIRE_BWRAP") == "1"
REQUIRE_CGROUP = os.environ.get("ASTRATK_REQUIRE_CGROUP") == "1"
NO_BWRAP = "bubblewrap is not installed or cannot create namespaces here (apt-get install -y bubblewrap)"
# with ASTRATK_REQUIRE_BWRAP=1 the bwrap cases are not skipped: `need_mode` fails them with the reason
MODES = [pytest.param("bwrap", marks=pytest.mark.skipif(not bwrap_available() and not REQUIRE_BWRAP, reason=NO_BWRAP)),
         "process"]
# A uid range of this test process's own: other processes (a concurrent test run) may be sandboxing too, and their
# live programs must not count as our strays.
UID_SLOTS = 64
UID_BASE = 2_000_000 + (os.getpid() % 4096) * UID_SLOTS


def need_mode(mode: str) -> None:
    if mode == "bwrap" and not bwrap_available():
        pytest.fail(f"ASTRATK_REQUIRE_BWRAP=1 but {NO_BWRAP}")


def cgroup_mkdir_works() -> bool:
    """Whether, asked directly (not through the sandbox), we may make a cgroup under our own with memory and pids
    limits (v1 at /sys/fs/cgroup/{memory,pids}, or v2 at /sys/fs/cgroup with both handed down)."""
    v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    dirs = {}  # controller -> our cgroup's directory
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ("memory", "pids"):
                if not v2 and c in ctrls.split(","):
                    dirs[c] = f"/sys/fs/cgroup/{c}{path}"
                if v2 and ctrls == "":
                    dirs[c] = f"/sys/fs/cgroup{path}"
    limits = {"memory": ("memory.max", "memory.limit_in_bytes"), "pids": ("pids.max",)}
    made: list[str] = []
    try:
        for c in ("memory", "pids"):
            d = os.path.join(dirs.get(c, "/nonexistent"), f"astratk-test-{os.getpid()}")
            if d not in made:
                os.mkdir(d)
                made.append(d)
            if not any(os.path.exists(os.path.join(d, name)) for name in limits[c]):
                return False
        return True
    except OSError:
        return False
    finally:
        for d in made:
            os.rmdir(d)


def need_cgroup() -> None:
    layout, why = cgroups.probe()
    if layout is None:
        if REQUIRE_CGROUP or cgroup_mkdir_works():  # the machine allows one but the sandbox made none: a bug
            pytest.fail(f"no per-run cgroup made, though this machine allows one (or ASTRATK_REQUIRE_CGROUP=1): {why}")
        pytest.skip(f"no per-run cgroup can be made here: {why}")


def sandbox(mode: str, **kw) -> Sandbox:
    need_mode(mode)
    opts = {"wall_s": 10.0, "cpu_s": 5.0, "memory_mb": 256, "max_procs": 16, "max_output_bytes": 4096} | kw
    return Sandbox(isolation=mode, uid_base=UID_BASE, uid_slots=UID_SLOTS, **opts)


def stray_processes() -> list[tuple[int, int]]:
    """(pid, uid) of live processes owned by any sandbox uid."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            uid = int(fields["Uid"].split()[0])
            if UID_BASE <= uid < UID_BASE + UID_SLOTS and not fields["State"].strip().startswith(("Z", "X")):
                out.append((int(entry), uid))
    return out


def world_executable(path: str) -> bool:
    while path not in ("", "/"):
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True


def sandbox_cgroups() -> list[str]:
    """Run cgroups this test process made that still exist, found by walking /sys/fs/cgroup (not through the
    sandbox's own bookkeeping)."""
    name = re.compile(re.escape(f"{cgroups.PREFIX}{os.getpid()}-") + r"\d+")
    found = []
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(root, d) for d in dirs if name.fullmatch(d)]
    return found


def host_is_fine() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork and exec
    assert stray_processes() == []
    assert sandbox_cgroups() == []


@pytest.mark.parametrize("mode", MODES)
def test_runs_a_program_with_stdin_files_and_args(mode):
    r = sandbox(mode).run("import sys\nprint(input()[::-1], open('data/x.txt').read(), sys.argv[1:])",
                          stdin="abc", files={"data/x.txt": "hello"}, args=["-v"])
    assert (r.returncode, r.stdout, r.killed_by, r.timed_out) == (0, "cba hello ['-v']\n", None, False)
    assert r.isolation == mode and r.ok
    assert r.own_uid == ROOT


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_hits_the_process_limit_and_leaves_nothing_behind(mode):
    if not ROOT:
        pytest.skip("without root no uid can be dropped and RLIMIT_NPROC would count the host's processes")
    counting = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n"
                "        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\nprint(n)\n")
    r = sandbox(mode, max_procs=16).run(counting)
    assert r.returncode == 0 and 0 < int(r.stdout) < 16  # the limit binds although we are root
    host_is_fine()  # the 15 sleeping children died with the run
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = sandbox(mode, wall_s=1.5).run(bomb)
    assert r.timed_out and r.killed_by == "wall_timeout" and not r.ok
    host_is_fine()


@pytest.mark.parametrize("mode", MODES)
def test_daemon_that_escapes_the_session_is_killed(mode):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')\n"
    r = sandbox(mode).run(code)
    assert r.stdout == "parent done\n" and r.wall_s < 5, r
    host_is_fine()


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_and_sleep_are_stopped(mode):
    r = sandbox(mode, cpu_s=1, wall_s=4).run("while True:\n    pass\n")
    assert r.killed_by in ("cpu_limit", "wall_timeout") and not r.ok  # CPU limit, or the wall clock on a busy host
    r = sandbox(mode, wall_s=1).run("import time\ntime.sleep(60)\n")
    assert r.timed_out and r.killed_by == "wall_timeout" and r.wall_s < 5
    host_is_fine()


@pytest.mark.parametrize("mode", MODES)
def test_closing_stdout_does_not_escape_the_wall_clock(mode):
    r = sandbox(mode, wall_s=1).run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n")
    assert r.timed_out and r.wall_s < 5
    host_is_fine()


@pytest.mark.parametrize("mode", MODES)
def test_host_interpreter_outside_usr_runs_without_its_venv(mode):
    if mode == "process" and ROOT and not world_executable(os.path.realpath(sys.executable)):
        with pytest.raises(ValueError, match="unprivileged uid, which cannot reach"):  # refused up front, with a fix
            sandbox(mode, python=sys.executable)
        return
    r = sandbox(mode, python=sys.executable).run("import sys\nprint(sys.prefix == sys.base_prefix, sys.version)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["True", sys.version.split()[0]]


@pytest.mark.parametrize("mode", MODES)
def test_memory_bomb_fails_inside(mode):
    r = sandbox(mode, memory_mb=200).run("x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n")
    assert r.returncode != 0 and "MemoryError" in r.stderr
    host_is_fine()


@pytest.mark.parametrize("mode", MODES)
def test_file_size_is_limited(mode):
    r = sandbox(mode, max_file_mb=1).run("open('big', 'wb').write(b'x' * (4 << 20))\n")
    assert r.returncode != 0 and "File too large" in r.stderr


def unshare_net_works() -> bool:
    """Whether this machine lets us make a network namespace, asked directly (not through the sandbox)."""
    try:
        return ROOT and subprocess.run(["unshare", "--net", "--", "true"], check=False,
                                       capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.parametrize("mode", MODES)
def test_no_network(mode):
    sb = sandbox(mode)
    assert sb.netns == (mode == "bwrap" or unshare_net_works())  # used wherever the machine allows it
    with socket.socket() as server:  # a host service the sandbox must not reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (f"import socket\nfor addr in [('1.1.1.1', 80), ('127.0.0.1', {port})]:\n    try:\n"
                "        socket.create_connection(addr, timeout=2)\n        print('connected', addr)\n"
                "    except OSError as e:\n        print('refused', addr)\n")
        r = sb.run(code)
        try:
            server.accept()[0].close()
            seen = True
        except BlockingIOError:
            seen = False
    assert r.returncode == 0, r
    assert r.own_network == (sb.netns and not sb.reachable_sockets())
    if sb.netns:
        assert "connected" not in r.stdout and r.stdout.count("refused") == 2 and not seen
    else:  # reported as shared: then the report is true (the listener saw the program)
        assert f"connected ('127.0.0.1', {port})" in r.stdout and seen and not r.own_network


@pytest.mark.parametrize("mode", MODES)
def test_cannot_write_outside(mode):
    tag = uuid.uuid4().hex
    # /tmp, /var/tmp, /dev/shm: a run's own (bwrap; the process fallback where it can have a mount namespace), or
    # swept after the run (test_what_a_run_leaves_in_the_hosts_temp_dirs_is_swept_without_a_mount_namespace)
    targets = ["/root", "/work", "/tmp", "/var/tmp", "/dev/shm"]
    if not ROOT and mode == "process":
        pytest.skip("without root the process fallback writes wherever this user can")
    paths = [f"{d}/evil-{tag}" for d in targets] + [f"{os.getcwd()}/evil-{tag}"]
    code = f"for p in {paths!r}:\n    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n" \
           "    except OSError:\n        pass\n"
    try:
        r = sandbox(mode).run(code)
        assert r.returncode == 0
        assert "wrote /root" not in r.stdout and "wrote /work" not in r.stdout  # a run's own /tmp is writable
        assert not any(os.path.exists(p) for p in paths)  # ... but it is not the host's
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


# ------------------------------------------------------------------- shared temp dirs, SysV IPC, Unix sockets
LEAVE_BEHIND = """import ctypes, os
tag, key = {tag!r}, {key}
shm_mb = 0
for i in range(10):  # 100 MB of host memory, were /dev/shm the host's
    try:
        with open(f"/dev/shm/{{tag}}-{{i}}", "wb") as f:
            f.write(b"x" * (10 << 20))
        shm_mb += 10
    except OSError:
        break
for d in ("/tmp", "/var/tmp"):
    try:
        open(f"{{d}}/{{tag}}-file", "w").write("x")
        os.mkdir(f"{{d}}/{{tag}}-dir")
        open(f"{{d}}/{{tag}}-dir/f", "w").write("x")
    except OSError:
        pass
# a SysV shared-memory segment (IPC_CREAT | 0600): it outlives its process unless someone removes it
segment = ctypes.CDLL(None, use_errno=True).shmget(key, 1 << 20, 0o1600)
print(shm_mb, segment >= 0)
"""


def leave_behind() -> tuple[str, int, str]:
    """(tag, SysV key, program) for a program that leaves 100 MB in /dev/shm, files and a directory in /tmp and
    /var/tmp, and a SysV shared-memory segment, each named by the tag (or keyed by the key)."""
    tag = f"astratk-test-{uuid.uuid4().hex}"
    key = int(tag[-7:], 16) + 1
    return tag, key, LEAVE_BEHIND.format(tag=tag, key=key)


def leftovers(tag: str, key: int) -> list[str]:
    """What the program left on the host: files named by `tag` in the shared temp dirs, and a segment keyed `key`."""
    found = [p for d in ("/tmp", "/var/tmp", "/dev/shm") for p in glob.glob(f"{d}/{tag}*")]
    with open("/proc/sysvipc/shm") as f:
        found += [f"shm key {key}" for line in f if line.split()[0] == str(key)]
    return found


def remove_leftovers(tag: str, key: int) -> None:
    for p in leftovers(tag, key):
        if p.startswith("shm key"):
            subprocess.run(["ipcrm", "-M", str(key)], check=False, capture_output=True)
        elif os.path.isdir(p):
            subprocess.run(["rm", "-rf", p], check=False)
        else:
            os.unlink(p)


@pytest.mark.parametrize("mode", MODES)
def test_nothing_a_run_leaves_in_temp_dirs_or_ipc_outlives_it(mode):
    """/dev/shm, /tmp, /var/tmp and SysV IPC are the run's own (bwrap; the fallback with a mount namespace) or swept
    after it: either way the host holds nothing of it after the run, and the results say which (`own_mounts`)."""
    sb = sandbox(mode)
    if mode == "process" and not ROOT and not sb.own_mounts:
        pytest.skip(f"without root or a user namespace ({namespaces.probe().why}) the fallback shares this user's "
                    "temp dirs: nothing tells the run's files from the user's (reported: own_mounts False)")
    tag, key, code = leave_behind()
    try:
        r = sb.run(code)
        assert r.returncode == 0, r
        assert leftovers(tag, key) == []
    finally:
        remove_leftovers(tag, key)
    shm_mb, segment = r.stdout.split()
    assert r.own_mounts == sb.own_mounts and r.own_mounts == (mode == "bwrap" or namespaces.probe().mounts)
    if mode == "process" and r.own_mounts:  # its own /dev/shm and IPC: capped, and gone with the run
        assert segment == "True" and 0 < int(shm_mb) <= sb.max_disk_mb, r
    host_is_fine()


def test_without_a_mount_namespace_what_a_run_leaves_is_swept(monkeypatch):
    """Where no mount namespace can be made (simulated), the program writes the host's /dev/shm and /tmp; what the
    run's uid left there, and its SysV segment, is removed after the run; the host's own files stay."""
    if not ROOT:
        pytest.skip("only a uid of the run's own tells its files from this user's")
    monkeypatch.setitem(namespaces._PROBED, True, namespaces.Namespaces(True, False, False, "simulated: no mounts"))
    sb = sandbox("process", run_memory_mb=512)
    assert not sb.own_mounts
    tag, key, code = leave_behind()
    # the host's own file, in a directory the run wrote to: it must stay
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="astratk-test-keep-") as keep:
        try:
            r = sb.run(code)
            assert r.returncode == 0 and not r.own_mounts, r
            assert r.stdout == "100 True\n", r  # it did write the host's /dev/shm and make a segment ...
            assert leftovers(tag, key) == []  # ... and none of it is left
            assert os.path.exists(keep.name)
        finally:
            remove_leftovers(tag, key)
    host_is_fine()


SOCKET_PROBE = """import socket
for name, addr in {addrs!r}:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(addr)
        print("connected", name)
    except OSError as e:
        print("refused", name, e.errno)
"""


@contextlib.contextmanager
def unix_listener(addr: str, mode: int = 0o777):
    """A host service listening on a Unix socket (a path made `mode`, or an abstract name "\\0..."); yields a function
    that says whether anyone connected."""
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(addr)
        if not addr.startswith("\0"):
            os.chmod(addr, mode)
        server.listen()
        server.setblocking(False)

        def seen() -> bool:
            try:
                server.accept()[0].close()
                return True
            except BlockingIOError:
                return False

        yield seen


@pytest.mark.parametrize("mode", MODES)
def test_host_unix_sockets_in_a_shared_temp_dir_are_out_of_reach(mode):
    """A world-writable socket in /tmp and an abstract one: a network namespace hides only the abstract one, the
    private /tmp the other. A run never reports `own_network` while it reached either."""
    shared = tempfile.mkdtemp(prefix="astratk-test-", dir="/tmp")
    os.chmod(shared, 0o755)
    path, abstract = os.path.join(shared, "service.sock"), f"\0astratk-test-{uuid.uuid4().hex}"
    try:
        with unix_listener(path) as path_seen, unix_listener(abstract) as abstract_seen:
            sb = sandbox(mode)
            r = sb.run(SOCKET_PROBE.format(addrs=[("path", path), ("abstract", abstract)]))
            reached = {"path": path_seen(), "abstract": abstract_seen()}
    finally:
        subprocess.run(["rm", "-rf", shared], check=False)
    assert r.returncode == 0, r
    assert reached == {n: f"connected {n}" in r.stdout for n in reached}, r
    if r.own_network:
        assert not any(reached.values()), r  # the report is true
    if mode == "bwrap" or (sb.netns and sb.own_mounts):
        assert not any(reached.values()), r  # ... and isolated wherever the machine allows
        assert r.own_network or sb.reachable_sockets(), r  # saying so, unless another host socket is in reach (named)


@pytest.mark.parametrize("mode", MODES)
def test_a_host_socket_the_run_can_reach_is_reported(mode):
    """A world-writable socket in a host directory the fallback sees (not a private one): it reaches it and says
    so (`own_network` False, `reachable_sockets()` names it); one only root may write is not counted; bwrap sees
    neither."""
    if not ROOT:
        pytest.skip("makes a directory under /var/lib")
    visible = tempfile.mkdtemp(prefix="astratk-test-", dir=next(d for d in ("/var/lib", "/opt", "/srv")
                                                                   if os.path.isdir(d)))
    os.chmod(visible, 0o755)
    open_path, closed_path = os.path.join(visible, "open.sock"), os.path.join(visible, "closed.sock")
    try:
        with unix_listener(open_path, 0o777) as open_seen, unix_listener(closed_path, 0o755) as closed_seen:
            sb = sandbox(mode)
            listed = sb.reachable_sockets()
            r = sb.run(SOCKET_PROBE.format(addrs=[("open", open_path), ("closed", closed_path)]))
            reached = {"open": open_seen(), "closed": closed_seen()}
    finally:
        subprocess.run(["rm", "-rf", visible], check=False)
    assert r.returncode == 0, r
    sees = mode == "process"
    assert reached == {"open": sees, "closed": False}, r
    assert (open_path in listed, closed_path in listed) == (sees, False)
    assert r.own_network == (sb.netns and not listed), r


def test_without_root_a_user_namespace_gives_the_fallback_its_own_mounts_and_network(monkeypatch):
    """Not root (simulated as root: os.geteuid says 1000, so no uid is leased and the fallback takes the user
    namespace way): the program runs as that namespace's root without capabilities, in private mounts and IPC and
    its own network, and leaves nothing behind."""
    if ROOT:
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ns = namespaces.probe()
    if not ns.mounts:
        pytest.skip(f"no user namespace with mounts here: {ns.why}")
    sb = sandbox("process")
    assert ns.user and sb.own_mounts and sb.netns
    tag, key, code = leave_behind()
    try:
        r = sb.run(code + "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])\n")
        assert r.returncode == 0, r
        assert leftovers(tag, key) == []
    finally:
        remove_leftovers(tag, key)
    shm_mb, segment, caps = r.stdout.split()
    assert (r.own_uid, r.own_mounts, r.own_network) == (False, True, not sb.reachable_sockets()), r
    assert segment == "True" and 0 < int(shm_mb) <= sb.max_disk_mb and int(caps, 16) == 0, r


@pytest.mark.parametrize("mode", MODES)
def test_environment_secrets_are_absent(mode, monkeypatch):
    if not ROOT and mode == "process":
        pytest.skip("without root the program can read this user's /proc/*/environ")
    monkeypatch.setenv("ASTRATK_TEST_SECRET", "hunter2-" + uuid.uuid4().hex)
    code = ("import os, glob\nprint(os.environ.get('ASTRATK_TEST_SECRET'), sorted(os.environ))\nfound = 0\n"
            "for p in glob.glob('/proc/*/environ'):\n    try:\n        found += b'hunter2' in open(p, 'rb').read()\n"
            "    except OSError:\n        pass\nprint(found)\n")
    r = sandbox(mode).run(code)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first.startswith("None ") and "ASTRATK" not in first and second == "0"


@pytest.mark.parametrize("mode", MODES)
def test_huge_output_is_truncated_and_stopped(mode):
    r = sandbox(mode, max_output_bytes=1000, wall_s=10).run("import sys\nwhile True:\n    print('x' * 100)\n"
                                                            "    sys.stderr.write('e')\n")
    assert len(r.stdout) == 1000 and r.stdout_truncated and r.killed_by == "output_limit"
    assert r.wall_s < 5  # stopped at the limit, not at the wall clock
    host_is_fine()


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_runs_from_many_threads(mode):
    sb = sandbox(mode)
    barrier = threading.Barrier(6)

    def one(i: int) -> tuple[str, str]:
        barrier.wait()
        r = sb.run("import os\nprint(input(), os.getuid())", stdin=str(i))
        return r.stdout.split()[0], r.stdout.split()[1]

    with ThreadPoolExecutor(6) as pool:
        out = list(pool.map(one, range(6)))
    assert [o[0] for o in out] == [str(i) for i in range(6)]
    if ROOT:
        assert len({o[1] for o in out}) == 6  # each concurrent run had a uid (and a process count) of its own
    host_is_fine()


def test_rejects_bad_settings_and_names():
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="docker")
    with pytest.raises(ValueError, match="wall_s"):
        Sandbox(wall_s=0)
    sb = Sandbox(isolation="process", max_procs=16)
    for bad in ["../x", "/etc/passwd", "a//b", "main.py"]:
        with pytest.raises(ValueError):
            sb.run("pass", files={bad: "x"})
    assert "process" in repr(sb)


@pytest.mark.parametrize("mode", MODES)
def test_a_uids_leftover_processes_are_swept_before_its_next_run(mode):
    if not ROOT:
        pytest.skip("uids are only leased as root")
    uid = UID_BASE + UID_SLOTS - 1  # a one-slot sandbox leases exactly this uid
    leftovers = [subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[]) for _ in range(16)]
    reaper = ThreadPoolExecutor(len(leftovers))  # their parent reaps them once killed, as a namespace's reaper would
    codes = [reaper.submit(p.wait) for p in leftovers]
    try:
        box = Sandbox(isolation=mode, uid_base=uid, uid_slots=1, max_procs=16, wall_s=10.0)
        r = box.run("import os\nif os.fork() == 0:\n    os._exit(0)\nos.wait()\nprint('forked')\n")
        assert r.stdout == "forked\n", r  # the 16 leftovers would have used up the process limit
        assert [c.result(timeout=5) for c in codes] == [-9] * len(leftovers)
    finally:
        for p in leftovers:
            p.kill()
        reaper.shutdown()
    host_is_fine()


# ------------------------------------------------------------------------------------------- whole-run cgroup
FORKING_MEMORY_BOMB = """import os, time
r, w = os.pipe()
for i in range(8):
    if os.fork() == 0:
        try:
            os.close(r)
            block = b"x" * (64 << 20)  # written, so every page is resident: 8 x 64 MB in all
            os.write(w, b"1")
            time.sleep(60)
        finally:
            os._exit(0)
os.close(w)
ready = 0
while ready < 8:
    chunk = os.read(r, 8)
    if not chunk:
        break
    ready += len(chunk)
print(ready, "ready", flush=True)
"""


@pytest.mark.parametrize("mode", MODES)
def test_memory_bomb_that_forks_first_is_capped_for_the_whole_run(mode):
    """Each child stays under its own 256 MB address-space limit; together they need 512 MB, far from what this
    machine has, but over the run's 256 MB: the run is killed whole. With room for all 8 they all allocate, which
    shows the program works and that the cap, not something else, stopped it."""
    need_cgroup()
    r = sandbox(mode, memory_mb=256, max_procs=16).run(FORKING_MEMORY_BOMB)
    assert r.cgroup and r.killed_by == "memory_limit" and not r.ok, r
    assert "8 ready" not in r.stdout
    host_is_fine()
    roomy = sandbox(mode, memory_mb=256, run_memory_mb=1536, max_procs=16).run(FORKING_MEMORY_BOMB)
    assert roomy.stdout == "8 ready\n" and roomy.ok, roomy
    host_is_fine()  # the 8 sleeping children died with the run


def observe(sb: Sandbox, code: str) -> tuple[SandboxResult, dict[str, str]]:
    """Run `code` in a thread and read the limits of the run's cgroup(s) while it runs: the last reading that found
    both hierarchies' files (v1 makes the memory and the pids directory one after the other, and writes each limit
    after its mkdir, so an early reading can see one directory, or a default value)."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sb.run, code)
        limits: dict[str, str] = {}
        end = time.perf_counter() + 5
        while time.perf_counter() < end and not fut.done():
            reading: dict[str, str] = {}
            for d in sandbox_cgroups():
                for f in ("memory.max", "memory.limit_in_bytes", "pids.max"):
                    with contextlib.suppress(OSError), open(os.path.join(d, f)) as fh:
                        reading[f] = fh.read().strip()
            if "pids.max" in reading and ("memory.max" in reading or "memory.limit_in_bytes" in reading):
                limits = reading
            time.sleep(0.01)
        return fut.result(), limits


@pytest.mark.parametrize("mode", MODES)
def test_each_run_has_a_capped_cgroup_removed_after_exit_and_timeout(mode):
    need_cgroup()
    sb = sandbox(mode, memory_mb=200, run_memory_mb=300, max_procs=12, wall_s=1.5)
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(0.5)\nprint('done')\n"
    r, limits = observe(sb, code)
    assert r.stdout == "done\n" and r.ok and r.cgroup, r
    assert limits.get("memory.max", limits.get("memory.limit_in_bytes")) == str(300 << 20)
    assert limits["pids.max"] == str(12 + 2)  # the program's 12 and bwrap's own two
    host_is_fine()  # removed after a normal exit, with the daemon it left killed
    r, limits = observe(sb, code.replace("time.sleep(0.5)", "time.sleep(60)"))
    assert r.timed_out and limits, r
    host_is_fine()  # ... and after a timeout


def test_without_a_cgroup_a_ram_guard_refuses_what_could_exhaust_the_machine(monkeypatch):
    monkeypatch.setitem(cgroups._PROBE, "layout", (None, "simulated: no writable cgroup"))
    ram_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    many = int(RAM_SHARE * ram_mb) // 512 + 1  # max_procs x 512 MB just over the share
    with pytest.raises(ValueError, match="cgroup=True but no cgroup can be made here: simulated"):
        Sandbox(isolation="process", cgroup=True)
    if ROOT:
        with pytest.raises(ValueError, match=r"no cgroup can cap .*simulated.* lower them so the product stays"):
            Sandbox(isolation="process", memory_mb=512, max_procs=many)
    fits = sandbox("process", memory_mb=512, max_procs=many - 2)
    r = fits.run("print('ok')")
    assert (r.stdout, r.cgroup, fits.cgroup) == ("ok\n", False, False)  # the guard, not a cgroup, bounded it
    with pytest.raises(ValueError, match="run_memory_mb"):
        Sandbox(isolation="process", run_memory_mb=0)


def test_without_a_cgroup_the_default_process_count_fits_a_container_memory_limit(monkeypatch):
    """In a container capped at 4 GB (our own cgroup's limit, below the machine's RAM) without a writable cgroup, the
    default max_procs is lowered to fit half of it; an explicit one over it is refused, not lowered. The run's private
    tmpfs (/tmp, /var/tmp, /dev/shm: 64 MB), where it has one, counts too."""
    if not ROOT:
        pytest.skip("the guard applies as root only (without root no uid of its own bounds the process count)")
    monkeypatch.setitem(cgroups._PROBE, "layout", (None, "simulated: no writable cgroup"))
    monkeypatch.setattr(cgroups, "own_memory_limit_mb", lambda: 4096)
    default = Sandbox(isolation="process", memory_mb=512, max_disk_mb=64)
    tmpfs = 64 if default.own_mounts else 0
    assert default.max_procs == (2048 - tmpfs) // 512  # 3 (4 without the tmpfs)
    assert Sandbox(isolation="process", memory_mb=64, max_disk_mb=64).max_procs == 16  # the default fits: kept
    with pytest.raises(ValueError, match=rf"4096 MB; lower them .* max_procs={(2048 - tmpfs) // 512}"):
        Sandbox(isolation="process", memory_mb=512, max_procs=8, max_disk_mb=64)


def test_own_memory_limit_is_read_from_our_cgroup_and_its_ancestors(tmp_path, monkeypatch):
    import builtins

    real_open = builtins.open
    files = {"/proc/self/cgroup": "4:memory:/pod/ctr\n8:pids:/\n",
             "/sys/fs/cgroup/memory/pod/ctr/memory.limit_in_bytes": str(2**63 - 4096),  # v1's "no limit"
             "/sys/fs/cgroup/memory/pod/memory.limit_in_bytes": str(6 << 30),
             "/sys/fs/cgroup/memory/memory.limit_in_bytes": str(2**63 - 4096)}

    def fake_open(path, *args, **kwargs):
        if str(path) in files:
            import io
            return io.StringIO(files[str(path)])
        if str(path).startswith(("/proc/self/cgroup", "/sys/fs/cgroup")):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert cgroups.own_memory_limit_mb() == 6 << 10
    files["/proc/self/cgroup"] = "0::/user.slice\n"
    files["/sys/fs/cgroup/user.slice/memory.max"] = "max"
    assert cgroups.own_memory_limit_mb() is None
    files["/sys/fs/cgroup/memory.max"] = str(3 << 30)
    assert cgroups.own_memory_limit_mb() == 3 << 10


def test_cgroup_layout_is_read_from_proc(tmp_path):
    v1 = "4:memory:/jobs/a\n8:pids:/\n0::/\n"
    mounts_v1 = ("35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                 "39 31 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
                 "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    layout, _ = cgroups._layout(v1, mounts_v1)  # the hybrid v2 tree has no controllers: v1 it is
    assert layout == cgroups.Layout(1, ("/sys/fs/cgroup/memory/jobs/a", "/sys/fs/cgroup/pids"), ("/jobs/a", "/"))
    container = "4:memory,pids:/docker/x\n"  # a container's mount shows only its own subtree
    mounts = "35 31 0:32 /docker/x /sys/fs/cgroup/mp rw - cgroup cgroup rw,memory,pids\n"
    layout, _ = cgroups._layout(container, mounts)
    assert layout == cgroups.Layout(1, ("/sys/fs/cgroup/mp",), ("/docker/x",))
    (tmp_path / "svc").mkdir()
    (tmp_path / "svc" / "cgroup.subtree_control").write_text("cpu memory pids\n")  # delegated v2
    layout, _ = cgroups._layout("0::/svc\n", f"30 23 0:26 / {tmp_path} rw - cgroup2 cgroup2 rw\n")
    assert layout == cgroups.Layout(2, (str(tmp_path / "svc"),), ("/svc",))
    layout, why = cgroups._layout("0::/other\n", f"30 23 0:26 /svc {tmp_path} rw - cgroup2 cgroup2 rw\n")
    assert layout is None and "outside the mounted tree" in why


@pytest.mark.parametrize("mode", MODES)
def test_a_run_that_cannot_join_its_cgroup_does_not_run(mode, monkeypatch):
    need_cgroup()
    real = cgroups.RunCgroup.launcher
    monkeypatch.setattr(cgroups.RunCgroup, "launcher", lambda self: [*real(self)[:4], "/nonexistent/cgroup.procs", "--"])
    r = sandbox(mode).run("print('ran outside')")
    assert (r.returncode, r.stdout) == (125, "") and "cannot join cgroup" in r.stderr, r
    host_is_fine()


def test_cgroups_left_by_a_dead_host_process_are_removed():
    need_cgroup()
    layout, _ = cgroups.probe()
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now (and not reused within this test, pids only grow until they wrap)
    stale = [os.path.join(p, f"{cgroups.PREFIX}{dead.pid}-0") for p in layout.parents]
    for d in stale:
        os.mkdir(d)
    try:
        cgroups._reap_stale(layout)
        assert not any(os.path.exists(d) for d in stale)
    finally:
        for d in stale:
            if os.path.exists(d):
                os.rmdir(d)

"""docs/cluster.md recipe (a), run for real: `dask scheduler` and `dask worker --resources ...` processes on localhost,
TLS between all of them, and an astratk run attached to the scheduler.

Throwaway certificates (one CA, one certificate/key shared by the scheduler, the workers and the client) are made with
the `openssl` CLI (the `cryptography` package is not a dependency of astratk; `Security.temporary()` keeps its
certificates in memory, where CLI processes cannot read them). Workers: one `control` (the data-layer actor) and two
rollout workers of different simulated hardware classes (`ASTRATK_WORKER_CLASS`, `astratk.runtime.pools`). Checks:
a client without TLS, a plain `tcp://` client and a client whose certificate another CA signed are refused at once;
Dask's own config route (DASK_DISTRIBUTED__COMM__TLS__* with `cluster.tls` null) connects; the run trains every step
and its per-service metrics show both hardware classes. Every process runs in its own session and is killed, with its
children, in `finally`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from astratk.runtime.run import Run
from astratk.spec import ClusterSpec, TLSSpec
from tests.integration.test_local_run import small_spec

pytestmark = pytest.mark.integration

STEPS = 6
START_TIMEOUT_S = 60.0  # a worker imports distributed and joins in a few seconds; torch loads later, in its first task
CONNECT_TIMEOUT_S = 20  # the refused clients' connect timeout...
REFUSAL_TIMEOUT_S = 5.0  # ...which they must not wait for: a refusal is immediate (~0.1 s here)
DASK = str(Path(sys.executable).parent / "dask")
# (name, --resources, environment): the hardware class is what the worker reports in the run's per-service metrics
WORKERS = [("control", "control=1", {}),
           ("gpu_fast-0", "rollout_main=1,score=1", {"ASTRATK_WORKER_CLASS": "gpu_fast"}),
           ("gpu_slow-0", "rollout_main=1,score=1", {"ASTRATK_WORKER_CLASS": "gpu_slow", "ASTRATK_SIM_SLOWDOWN": "2"})]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_certificates(directory: Path, name: str = "astratk-test") -> dict[str, Path]:
    """A CA and one node certificate signed by it (for server and client use, valid for 127.0.0.1), valid one day."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", f"/CN={name}-ca",
             cwd=directory)
    _openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", f"/CN={name}-node", cwd=directory)
    (directory / "node.ext").write_text("basicConstraints=critical,CA:FALSE\n"
                                        "keyUsage=critical,digitalSignature,keyEncipherment\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n"
                                        "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "1", "-extfile", "node.ext", cwd=directory)
    return {"ca": directory / "ca.pem", "cert": directory / "node.pem", "key": directory / "node.key"}


def _tls_flags(certs: dict[str, Path]) -> list[str]:
    return ["--tls-ca-file", str(certs["ca"]), "--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])]


# docs/cluster.md's recipe: Dask's HTTP server of each process (/health, /metrics, /json, /info pages, /sitemap.json:
# they answer anyone, certificate or not) is stopped as the process starts (the preload), has no routes before that,
# and is bound to localhost on a free port
NO_HTTP = ["--no-dashboard", "--dashboard-address", "127.0.0.1:0", "--preload", "astratk.runtime.no_http"]
NO_HTTP_ROUTES = {"DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES": "[]", "DASK_DISTRIBUTED__WORKER__HTTP__ROUTES": "[]"}
UNAUTHENTICATED = ("/json/identity.json", "/info/main/workers.html", "/health", "/metrics", "/sitemap.json",
                   "/statics/css/base.css", "/")


def _popen(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Output to a log file (a pipe nobody reads would block the process); Dask's scratch space beside it; a session
    of its own, so the cleanup can kill the nanny's worker process too."""
    scratch = {"DASK_TEMPORARY_DIRECTORY": str(log.parent / "dask-scratch"), **NO_HTTP_ROUTES}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **scratch, **(env or {})},
                                start_new_session=True)


def start_scheduler(tmp_path: Path, certs: dict[str, Path], procs: list[subprocess.Popen]) -> str:
    """`dask scheduler --protocol tls` on a free port; returns the address from its scheduler file."""
    file = tmp_path / "scheduler.json"
    procs.append(_popen([DASK, "scheduler", "--protocol", "tls", "--host", "127.0.0.1", "--port", "0",
                         *NO_HTTP, "--scheduler-file", str(file),
                         *_tls_flags(certs)],
                        tmp_path / "scheduler.log"))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if procs[-1].poll() is not None:
            raise RuntimeError(f"dask scheduler exited: {(tmp_path / 'scheduler.log').read_text()[-2000:]}")
        try:
            return json.loads(file.read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):  # not written yet, or half-written
            time.sleep(0.2)
    raise TimeoutError(f"waited {START_TIMEOUT_S:.0f}s for dask scheduler to write {file}")


def start_worker(address: str, name: str, resources: str, env: dict[str, str], certs: dict[str, Path],
                 tmp_path: Path) -> subprocess.Popen:
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return _popen([DASK, "worker", address, "--name", name, "--nthreads", "1", "--host", "127.0.0.1",
                   *NO_HTTP, "--resources", resources,
                   *_tls_flags(certs)],
                  tmp_path / f"worker-{name}.log", {**threads, **env})


def http_served(procs: list[subprocess.Popen]) -> dict[str, Any]:
    """Every TCP port the scheduler and workers (nannies and their worker processes) listen on, asked over plain
    HTTP, without a certificate, for Dask's routes: what answered anything but 404 (a TLS comm port does not speak
    HTTP: its connection fails, which counts as nothing served)."""
    import psutil

    ports = set()
    for p in procs:
        parent = psutil.Process(p.pid)
        for proc in [parent, *parent.children(recursive=True)]:
            ports |= {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    answered = {}
    for port in sorted(ports):
        for path in UNAUTHENTICATED:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                    answered[f"{port}{path}"] = r.status
            except urllib.error.HTTPError as e:
                if e.code != 404:
                    answered[f"{port}{path}"] = e.code
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not HTTP (a TLS comm port)
    return {"ports": len(ports), "answered": answered}


def stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM (a nanny closes its worker), a grace period, then SIGKILL to each process's whole session."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the session's leftovers (the nanny's worker process)
        except ProcessLookupError:
            pass
        p.wait(timeout=15)


# Other clients, in a process of their own started with Dask's TLS env vars (its config route). First, with that config
# blanked, five that must be refused at once. A raw `Client("tls://...")` without TLS fails with a TypeError but leaves
# dask's "scheduler" config at "dask.distributed" and itself the default client until garbage-collected (seen here, in
# this test's own process: the run's metrics save then raised "Requested dask.distributed scheduler but no Client
# active"); `connect` never builds that client (it checks for certificates first). Then `connect` with `cluster.tls`
# null attaches through the env vars and lists the workers.
CLIENTS = textwrap.dedent("""
    import json, sys, time
    import dask
    from distributed import Client, Security  # imported before dask.config.set of distributed.* (test_cluster_config)
    from astratk.runtime.cluster import connect, wait_for_workers
    from astratk.spec import ClusterSpec, RunSpec, TLSSpec
    address, other, T = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    foreign = TLSSpec(ca_file=other["ca"], cert=other["cert"], key=other["key"])
    attempts = {
        "dask, no TLS": lambda: Client(address, timeout=T),
        "dask, plain tcp": lambda: Client(address.replace("tls://", "tcp://"), timeout=T),
        "dask, foreign CA": lambda: Client(address, timeout=T, security=Security(
            tls_ca_file=other["ca"], tls_client_cert=other["cert"], tls_client_key=other["key"])),
        "astratk, no cluster.tls": lambda: connect(RunSpec(cluster=ClusterSpec(scheduler_address=address,
                                                                               startup_timeout_s=T))),
        "astratk, foreign CA": lambda: connect(RunSpec(cluster=ClusterSpec(scheduler_address=address, tls=foreign,
                                                                           startup_timeout_s=T))),
    }
    refused = {}
    no_tls = {"distributed.comm.tls.ca-file": None, "distributed.comm.tls.client.cert": None,
              "distributed.comm.tls.client.key": None}
    with dask.config.set(no_tls):
        for what, attempt in attempts.items():
            t = time.monotonic()
            try:
                attempt().close()
                refused[what] = ["connected", "", time.monotonic() - t]
            except Exception as e:
                refused[what] = [type(e).__name__, str(e), time.monotonic() - t]
    spec = RunSpec(cluster=ClusterSpec(scheduler_address=address, startup_timeout_s=T)).validate()
    with connect(spec) as client:
        wait_for_workers(client, ["control"], 1, 60)
        wait_for_workers(client, ["rollout_main", "score"], 2, 60)
        workers = {str(w["name"]): a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
    print(json.dumps({"refused": refused, "workers": workers}))
""")


def test_tls_cluster_of_dask_cli_processes_trains_and_refuses_plain_clients(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI makes the test's throwaway certificates")
    certs = make_certificates(tmp_path / "certs")
    procs: list[subprocess.Popen] = []
    try:
        address = start_scheduler(tmp_path, certs, procs)
        assert address.startswith("tls://127.0.0.1:")
        for name, resources, env in WORKERS:  # they join while the checks below and the model build run
            procs.append(start_worker(address, name, resources, env, certs, tmp_path))

        # other clients (CLIENTS): refused at once without TLS, over plain tcp, with another CA's certificate;
        # attached through DASK_DISTRIBUTED__COMM__TLS__* with cluster.tls null
        other = {k: str(v) for k, v in make_certificates(tmp_path / "other-ca", name="other").items()}
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("DASK_")},
               "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": str(certs["ca"]),
               "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": str(certs["cert"]),
               "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": str(certs["key"])}
        out = subprocess.run([sys.executable, "-c", CLIENTS, address, json.dumps(other), str(CONNECT_TIMEOUT_S)],
                             check=False, env=env, capture_output=True, text=True, timeout=180,
                             cwd=Path(__file__).parents[2])
        assert out.returncode == 0, out.stderr[-3000:]
        clients = json.loads(out.stdout.strip().splitlines()[-1])
        refused = clients["refused"]
        assert len(refused) == 5 and all(kind != "connected" and seconds < REFUSAL_TIMEOUT_S
                                         for kind, _, seconds in refused.values()), refused
        kind, message, _ = refused["astratk, no cluster.tls"]
        assert kind == "ValueError" and "set cluster.tls" in message, refused
        kind, message, _ = refused["astratk, foreign CA"]
        assert kind == "ConnectionError" and address in message and "signed by one CA" in message, refused
        workers = clients["workers"]
        assert sorted(workers) == sorted(name for name, _, _ in WORKERS)
        assert all(a.startswith("tls://127.0.0.1:") for a in workers.values()), workers  # workers listen on TLS too
        served = http_served(procs)
        assert not served["answered"], served  # every port asked, nothing served
        # and no HTTP port at all: the scheduler's comm port, and each worker's nanny and worker comm ports
        assert served["ports"] == 1 + 2 * len(WORKERS), served

        # the run, attached with cluster.tls
        spec = small_spec(tmp_path, max_steps=STEPS)
        spec.cluster = ClusterSpec(scheduler_address=address, startup_timeout_s=START_TIMEOUT_S,
                                   tls=TLSSpec(ca_file=str(certs["ca"]), cert=str(certs["cert"]),
                                               key=str(certs["key"])))
        spec.eval.interval_s = 60.0  # the held-out evaluations before and after are enough here
        spec.eval.max_tasks = 8
        lines: list[str] = []
        result = Run(spec, printer=lines.append).start()
    finally:
        stop(procs)
    assert all(p.returncode is not None for p in procs)

    s = result.summary
    assert s["steps"] == STEPS and s["final_version"] == STEPS, (s, lines[-20:])
    assert any("cluster up with 3 workers" in line for line in lines), lines
    ds = result.metrics()
    services = dict(zip(ds["service"].values.tolist(), ds["service_hardware"].values.tolist(), strict=True))
    assert services == {"gpu_fast-0": "gpu_fast", "gpu_slow-0": "gpu_slow"}, services  # control rolls nothing out
    assert sorted(ds["hardware"].values.tolist()) == ["gpu_fast", "gpu_slow"]
    assert (ds["hardware_tasks"] > 0).all() and (ds["hardware_tasks_per_s"] > 0).all()

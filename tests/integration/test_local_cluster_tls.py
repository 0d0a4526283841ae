"""A local run's cluster refuses anyone without the run's credentials (`cluster.local_tls`, on by default).

Before, a second process under another uid (nobody) connected to a run's local scheduler over TCP with no credentials
and ran code on its workers as the run's user. Now the local cluster speaks TLS with throw-away credentials made for
it in memory (`Security.temporary()`): the run's own client (from the cluster) and its workers connect; a process
without them, under another uid where the suite runs as root, is refused, whether it tries TLS or plain TCP.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from astratk.runtime.pools import start_pool_cluster, tls_environ
from astratk.spec import ClusterSpec, RunSpec

pytestmark = pytest.mark.integration

INTRUDER = textwrap.dedent("""
    import sys
    from distributed import Client
    try:
        client = Client(sys.argv[1], timeout=10)
        print("connected:", client.run(lambda: __import__("os").getuid()))
    except Exception as e:  # noqa: BLE001
        print("refused:", type(e).__name__)
""")


def test_a_second_process_without_the_credentials_is_refused():
    spec = RunSpec(cluster=ClusterSpec(rollout_workers=1))
    assert spec.cluster.local_tls  # the default
    from distributed import Client

    with start_pool_cluster(spec, processes=True) as cluster:
        cluster.wait_for_workers(2, timeout=90)
        address = cluster.scheduler_address
        assert address.startswith("tls://127.0.0.1:")
        with Client(cluster, set_as_default=False) as own:  # the run's own client: credentials from the cluster
            assert sorted(own.run(os.getpid)) == sorted(w for w in cluster.scheduler_info["workers"])
            assert len(own.scheduler_info()["workers"]) == 2  # and the workers joined with theirs
        env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
        for attempt in (address, address.replace("tls://", "tcp://")):  # TLS without credentials; plain TCP
            intrude = [sys.executable, "-c", INTRUDER, attempt]
            try:  # as another user where the suite runs as root and that user may run this Python; else as this one
                if os.geteuid() != 0:
                    raise PermissionError
                child = subprocess.run(intrude, capture_output=True, text=True, env=env, timeout=120, check=False,
                                       cwd="/", user=65534, group=65534)
            except PermissionError:
                child = subprocess.run(intrude, capture_output=True, text=True, env=env, timeout=120, check=False)
            assert child.returncode == 0, child.stderr[-2000:]
            assert child.stdout.strip().splitlines()[-1].startswith("refused:"), (attempt, child.stdout)
        # a run's trainer processes get the credentials through their environment: with them, a process connects
        creds = {**env, **tls_environ(cluster.tls)}
        member = ("import sys\nfrom distributed import Client\n"
                  "with Client(sys.argv[1], timeout=30) as c: print(len(c.scheduler_info()['workers']))")
        ok = subprocess.run([sys.executable, "-c", member, address], capture_output=True, text=True, env=creds,
                            timeout=120, check=False)
        assert ok.returncode == 0 and ok.stdout.strip() == "2", ok.stderr[-2000:]


def test_plain_tcp_when_turned_off():
    spec = RunSpec(cluster=ClusterSpec(rollout_workers=1, local_tls=False))
    with start_pool_cluster(spec, processes=False) as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:") and cluster.tls is None

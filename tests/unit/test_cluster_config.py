"""`cluster.tls` and attaching to an existing scheduler (`astratk.runtime.cluster`): validation names the key and the
fix; `security(spec)` builds the client's `distributed.Security`, or leaves it to Dask's own TLS config. The real
TLS handshake with `dask scheduler` / `dask worker` processes is tests/integration/test_cluster_tls.py."""

from __future__ import annotations

import time

import dask
import distributed  # noqa: F401 - before any dask.config.set of distributed.* keys (see NO_DASK_TLS)
import pytest
import yaml

from astratk.config import dump_spec, parse
from astratk.runtime.cluster import connect, security
from astratk.spec import ClusterSpec, RunSpec, TLSSpec

ADDRESS = "tls://10.0.0.5:8786"
# Entered before `import distributed`, dask.config.set of these keys would delete all of distributed's config
# on exit (it undoes the insert of the top-level key), and the next Security() raises KeyError: 'distributed'.
NO_DASK_TLS = {"distributed.comm.tls.ca-file": None, "distributed.comm.tls.client.cert": None,
               "distributed.comm.tls.client.key": None, "distributed.client.security-loader": None}


@pytest.fixture
def pem(tmp_path):
    """Three files that exist (validation checks paths; a TLS context is only built when a connection is made)."""
    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n")
    return tmp_path


def tls_spec(pem, address: str | None = ADDRESS, **tls) -> RunSpec:
    files = {"ca_file": str(pem / "ca.pem"), "cert": str(pem / "client.pem"), "key": str(pem / "client.key"), **tls}
    return RunSpec(cluster=ClusterSpec(scheduler_address=address, tls=TLSSpec(**files)))


def test_tls_parses_from_yaml_and_round_trips(pem, tmp_path):
    cfg = {"cluster": {"scheduler_address": ADDRESS, "tls": {"ca_file": str(pem / "ca.pem"),
                                                             "cert": str(pem / "client.pem"),
                                                             "key": str(pem / "client.key")}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    spec = parse(["--config", str(path)])
    assert spec.cluster.tls == TLSSpec(str(pem / "ca.pem"), str(pem / "client.pem"), str(pem / "client.key"))
    path.write_text(dump_spec(spec))
    assert parse(["--config", str(path)]).cluster.tls == spec.cluster.tls
    assert parse([]).cluster.tls is None  # the default: no TLS of astratk's own


def test_security_is_the_client_role_with_encryption_required(pem):
    sec = security(tls_spec(pem))
    assert sec.require_encryption is True
    assert (sec.tls_ca_file, sec.tls_client_cert, sec.tls_client_key) == (
        str(pem / "ca.pem"), str(pem / "client.pem"), str(pem / "client.key"))
    assert security(RunSpec()) is None  # no scheduler address: a local cluster, no TLS


def test_security_expands_home_and_allows_a_key_appended_to_the_cert(pem, monkeypatch):
    monkeypatch.setenv("HOME", str(pem))
    sec = security(tls_spec(pem, ca_file="~/ca.pem", key=None).validate())
    assert sec.tls_ca_file == str(pem / "ca.pem") and sec.tls_client_key is None


@pytest.mark.parametrize("name", ["ca_file", "cert", "key"])
def test_a_missing_file_names_its_key(pem, name):
    with pytest.raises(ValueError, match=rf"cluster\.tls\.{name}: no file '.*nope\.pem'; give the PEM file"):
        tls_spec(pem, **{name: str(pem / "nope.pem")}).validate()


@pytest.mark.parametrize(("address", "says"), [(None, "null \\(a local cluster"),
                                               ("tcp://10.0.0.5:8786", "'tcp://10.0.0.5:8786'"),
                                               ("10.0.0.5:8786", "'10.0.0.5:8786'")])
def test_tls_needs_a_tls_address(pem, address, says):
    with pytest.raises(ValueError, match=rf"cluster\.tls is set but cluster\.scheduler_address is {says}.*tls://"):
        tls_spec(pem, address=address).validate()


def test_a_tls_address_without_certificates_fails_with_both_fixes():
    spec = RunSpec(cluster=ClusterSpec(scheduler_address=ADDRESS))
    with dask.config.set(NO_DASK_TLS):
        with pytest.raises(ValueError, match=r"is a TLS scheduler but this client has no certificates: set "
                                             r"cluster\.tls: .*DASK_DISTRIBUTED__COMM__TLS__CA_FILE"):
            spec.validate()
        with pytest.raises(ValueError, match="no certificates"):  # also when a Session is given an unvalidated spec
            connect(spec)


def test_dask_config_tls_keeps_working_when_cluster_tls_is_null(pem):
    """What DASK_DISTRIBUTED__COMM__TLS__CA_FILE / __CLIENT__CERT / __CLIENT__KEY set (dask reads them at import):
    validation accepts the tls:// address and `security` defers to `Client`, which builds `Security()` from them."""
    spec = RunSpec(cluster=ClusterSpec(scheduler_address=ADDRESS))
    conf = {**NO_DASK_TLS, "distributed.comm.tls.ca-file": str(pem / "ca.pem"),
            "distributed.comm.tls.client.cert": str(pem / "client.pem"),
            "distributed.comm.tls.client.key": str(pem / "client.key")}
    with dask.config.set(conf):
        assert security(spec.validate()) is None
        from distributed import Security

        assert Security().tls_client_cert == str(pem / "client.pem")  # what Client(security=None) falls back to
    with dask.config.set({**NO_DASK_TLS, "distributed.client.security-loader": "mymodule.load_security"}):
        assert security(spec.validate()) is None


def test_connect_needs_an_address():
    with pytest.raises(ValueError, match="cluster.scheduler_address is null"):
        connect(RunSpec())


def test_connect_timeout_names_the_address_and_the_key():
    """An address that accepts connections but never speaks Dask: the client waits startup_timeout_s, then one
    error naming the address and the key."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        spec = RunSpec(cluster=ClusterSpec(scheduler_address=address, startup_timeout_s=1.0))
        t = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"could not connect to the Dask scheduler at {address} "
                                                  r"within 1s \(cluster\.startup_timeout_s\)"):
            connect(spec)
        assert time.monotonic() - t < 30  # liveness: the timeout is honoured, not a hang


def test_connect_to_a_refused_address_says_so_after_the_grace():
    spec = RunSpec(cluster=ClusterSpec(scheduler_address="tcp://127.0.0.1:1", startup_timeout_s=120.0))
    t = time.monotonic()
    with pytest.raises(ConnectionError, match=r"nothing accepts connections at tcp://127\.0\.0\.1:1 .*retried for 5s"):
        connect(spec)
    assert time.monotonic() - t < 30  # not the 120 s startup timeout


def test_concurrent_chunks_give_rollout_workers_the_labels_and_threads_to_run_them_at_once():
    from astratk.runtime.pools import worker_specs
    from astratk.runtime.warm import layout_key
    from astratk.spec import RolloutSpec

    one = worker_specs(RunSpec(), processes=False)
    two = worker_specs(RunSpec(rollout=RolloutSpec(concurrent_chunks=2)).validate(), processes=False)
    assert one["rollout-0"]["options"]["resources"] == {"rollout_main": 1, "score": 1}
    assert two["rollout-0"]["options"]["resources"] == {"rollout_main": 2, "score": 2}  # each chunk takes 1
    assert (one["rollout-0"]["options"]["nthreads"], two["rollout-0"]["options"]["nthreads"]) == (1, 2)
    assert two["control"]["options"]["resources"] == {"control": 1} and two["control"]["options"]["nthreads"] == 1
    # a kept cluster is not reused by a run that needs other labels
    assert layout_key(RunSpec()) != layout_key(RunSpec(rollout=RolloutSpec(concurrent_chunks=2)))
    with pytest.raises(ValueError, match="concurrent_chunks"):
        RunSpec(rollout=RolloutSpec(concurrent_chunks=0)).validate()

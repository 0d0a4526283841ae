"""The run's default local cluster (worker processes started by nannies) with `cluster.dashboard: false` opens no
HTTP port: only the scheduler's, the nannies' and the workers' comm ports, on 127.0.0.1. The in-process version and
the dashboard-on case are tests/unit/test_cluster_http.py."""

from __future__ import annotations

from tests.unit.test_cluster_http import test_local_cluster_without_dashboard_opens_no_http_port as check_ports


def test_local_cluster_with_worker_processes_opens_no_http_port():
    check_ports(processes=True)

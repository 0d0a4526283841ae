"""`TrainerProcesses`: a multi-policy run's trainers, one `astratk train fit` process per policy.

Each process attaches to the run's deployment by name through the Dask scheduler (`astratk.runtime.registry`),
trains its policy with the run config's `trainer:` section and writes its step rows to
`<run dir>/trainers/<policy>/steps.json`. Output lines are relayed prefixed with the policy. If one trainer ends early
(a non-zero exit: it starved, diverged or failed), the others are asked to stop after their current step, and the
run goes on to write what every trainer gathered, with the early one's `stop_reason` (its own, or its exit code and
last output line).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def trainer_dir(run_dir: str | Path, policy_id: str) -> Path:
    """A policy's trainer directory in a run: its STOP file (in-process trainers too), and a
    trainer process's logs, checkpoints and steps.json (its `--trainer.default_root_dir`)."""
    return Path(run_dir) / "trainers" / policy_id


TRAINER_THREADS_ENV = "ASTRATK_TRAINER_THREADS"  # a run's trainer processes take its planned torch threads
TRAINER_LEND_ENV = "ASTRATK_TRAINER_LEND"  # ... and lend that many to each rollout worker on their host while waiting


class TrainerProcesses:
    def __init__(self, spec: Any, run_dir: Path, deployment: str, scheduler: str,
                 printer: Callable[[str], None] = print, startup_timeout_s: float | None = None,
                 threads: int | None = None, environ: dict[str, str] | None = None, lend: int = 0) -> None:
        self.spec, self.run_dir, self.deployment, self.scheduler = spec, Path(run_dir), deployment, scheduler
        self.threads = threads  # each trainer process's torch threads (the run's plan); None: `cpu.run_threads`
        self.lend = lend  # threads each lends to every rollout worker on this host while it waits for a batch
        self.environ = dict(environ or {})  # added to their environment (a local cluster's TLS credentials)
        self.print = printer
        self.startup_timeout_s = startup_timeout_s or spec.cluster.startup_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.tails: dict[str, collections.deque[str]] = {}
        self._relays: list[threading.Thread] = []

    def command(self, policy_id: str) -> list[str]:
        root = trainer_dir(self.run_dir, policy_id)
        return [sys.executable, "-m", "astratk", "train", "fit", "--run_config", str(self.run_dir / "config.yaml"),
                "--policy_id", policy_id, "--deployment", self.deployment, "--scheduler", self.scheduler,
                "--trainer.default_root_dir", str(root)]  # placement: the policy's trainer section

    def start(self) -> None:
        from astratk.cpu import run_threads

        threads = str(self.threads or run_threads(self.spec).trainer)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1",
               TRAINER_THREADS_ENV: threads, TRAINER_LEND_ENV: str(self.lend), **self.environ}
        for p in self.spec.policies:
            pid = p.policy_id
            trainer_dir(self.run_dir, pid).mkdir(parents=True, exist_ok=True)
            proc = subprocess.Popen(self.command(pid), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env, bufsize=1)
            self.procs[pid] = proc
            self.tails[pid] = collections.deque(maxlen=40)
            relay = threading.Thread(target=self._relay, args=(pid, proc), name=f"astratk-relay-{pid}", daemon=True)
            relay.start()
            self._relays.append(relay)

    def _relay(self, pid: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.tails[pid].append(line)
            if line.startswith("[") and " step " in line:  # the trainer's progress lines
                self.print(f"{pid:>10} | {line}")

    def wait(self, grace_s: float = 30.0) -> dict[str, dict[str, Any]]:
        """Block until every trainer exits; their results (`build.fit_result`). One that ends early
        (module docstring) stops the others: a STOP file each, then `stop()` after `grace_s`."""
        early, stopped = None, []
        try:
            while True:
                codes = {pid: proc.poll() for pid, proc in self.procs.items()}
                early = next((pid for pid, code in codes.items() if code not in (None, 0)), None)
                if early is not None:
                    stopped = [pid for pid, code in codes.items() if code is None]
                    self._ask_to_stop(stopped, grace_s)
                    break
                if all(code == 0 for code in codes.values()):
                    break
                time.sleep(0.5)
        finally:
            self.stop()
        for relay in self._relays:
            relay.join(5)
        results = {pid: self._result(pid) for pid in self.procs}
        for pid in stopped:  # stopped by us: the reason is the early one's
            results[pid]["stop_reason"] = None
        if early is not None and not results[early].get("stop_reason"):
            last = next((line for line in reversed(self.tails[early]) if line.strip()), "(no output)")
            results[early]["stop_reason"] = (f"the trainer of policy {early!r} exited with code "
                                             f"{self.procs[early].returncode}; its last output: {last.strip()}")
        return results

    def _ask_to_stop(self, pids: list[str], grace_s: float) -> None:
        """Trainers `pids` finish their current step and exit (STOP files), for up to `grace_s` seconds."""
        for pid in pids:
            (trainer_dir(self.run_dir, pid) / "STOP").touch()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self.procs[pid].poll() is None for pid in pids):
            time.sleep(0.5)

    def _result(self, pid: str) -> dict[str, Any]:
        """What the trainer of `pid` wrote to steps.json; without one (it died before), no steps."""
        path = trainer_dir(self.run_dir, pid) / "steps.json"
        if not path.exists():
            last = next((line for line in reversed(self.tails[pid]) if line.strip()), "(no output)")
            return {"rows": [], "data_wait_s": 0.0, "group_ids": [],
                    "stop_reason": f"the trainer of policy {pid!r} exited without writing {path}; its last "
                                   f"output: {last.strip()}"}
        return json.loads(path.read_text())

    def run(self) -> dict[str, dict[str, Any]]:
        self.start()
        return self.wait()

    def stop(self, timeout_s: float = 20.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

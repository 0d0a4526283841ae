"""`Run`: one whole local run, the same code path for the notebook and `astratk run`.

    build or reuse the models -> start the cluster -> deploy the data layer -> evaluate v0
    -> acquire rollouts while the trainer trains (publishing weights, evaluating on a wall-clock interval)
    -> evaluate the last version -> write metrics (xarray), dashboard (hvplot) and summary

Example:
    >>> import astratk
    >>> run = astratk.Run.from_config("tutorials/quickstart.yaml")  # doctest: +SKIP
    >>> result = run.start()  # doctest: +SKIP
    >>> result.summary["accuracy_gain"]  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import html
import json
import math
import os
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astratk.config import dump_spec, load_spec
from astratk.models.gguf import file_sha256, gguf_directory, resolve_gguf_file
from astratk.models.hub import is_hub_id, resolve
from astratk.models.pypi import is_pypi_path, resolve_pypi
from astratk.runtime.drive import DETACHED_TIMEOUT_S
from astratk.runtime.main_guard import check_main_guard
from astratk.runtime.view import LiveView, render
from astratk.spec import NothingToTrain, RunSpec


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)

    def metrics(self) -> Any:
        from astratk.metrics import load

        return load(self.files["metrics"])

    def __repr__(self) -> str:
        s = self.summary
        return (f"RunResult({self.run_dir}, accuracy {s.get('accuracy_before', float('nan')):.3f} -> "
                f"{s.get('accuracy_after', float('nan')):.3f})")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}"
                       "</td></tr>" for k, v in self.summary.items())
        files = "".join(f"<li>{html.escape(k)}: <code>{html.escape(str(v))}</code></li>" for k, v in self.files.items())
        return f"<b>astratk run</b> <code>{html.escape(str(self.run_dir))}</code><table>{rows}</table><ul>{files}</ul>"


class Run:
    """A run handle: `start()` runs to completion; `start(block=False)` returns at once and the run goes on in a
    background thread, with `pause()`, `resume()`, `stop()` (finish the current step, then wrap up as usual),
    `wait()`, `status()` and a live `_repr_html_` for notebooks."""

    def __init__(self, spec: RunSpec, printer: Callable[[str], None] = print) -> None:
        self.spec = spec.validate()
        from astratk.runtime.checks import check_lora, check_resume  # loads torch: after the spec's own checks

        check_lora(self.spec)
        if self.spec.resume_from:
            check_resume(self.spec)
        self.printer = printer
        self.log_lines: deque[str] = deque(maxlen=500)  # every line the run printed, newest last
        self.quiet = False  # set while a live view shows the lines instead (astratk.runtime.view)
        self.result: RunResult | None = None
        self.session: Any = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def print(self, line: str) -> None:
        """The run's log: kept in `log_lines`, and printed unless a live view shows it."""
        self.log_lines.append(line)
        if not self.quiet:
            self.printer(line)

    def view(self, every_s: float = 2.0) -> Any:
        """Show the run in the notebook, updated in place every `every_s` seconds until it ends
        (`astratk.runtime.view`); its log lines go there too. Returns the view (`stop()` ends the updates)."""

        return LiveView(self, every_s).show()

    def _ipython_display_(self) -> None:
        """A run shown as a cell's last value: live while it trains in the background, a snapshot otherwise."""
        if self._thread is not None and self.result is None and self.error is None:
            self.view()
            return
        from IPython.display import HTML, display

        display(HTML(self._repr_html_()))

    @classmethod
    def from_config(cls, path: str | Path, *overrides: str, printer: Callable[[str], None] = print) -> Run:
        return cls(load_spec(path, list(overrides)), printer=printer)

    def __repr__(self) -> str:
        return f"Run({self.spec.name!r}, policies={[p.policy_id for p in self.spec.policies]}, {self.state})"

    @property
    def state(self) -> str:
        if self.result is not None:
            return "finished"
        if self.error is not None:
            return "failed"
        return self.session.state if self.session is not None else "not started"

    def start(self, block: bool = True) -> RunResult | Run:
        """Run to completion and return where the metrics and plots are; with `block=False`, start in the
        background and return this handle (`wait()` gives the result)."""
        if self._thread is not None or self.result is not None:
            raise RuntimeError(f"run {self.spec.name!r} was already started; make a new Run to train again")
        if self.spec.cluster.processes and self.spec.cluster.scheduler_address is None:
            check_main_guard(f"run {self.spec.name!r}")  # before a background thread hides the caller's frames
        if block:
            return self._run()
        self._thread = threading.Thread(target=self._background, name="astratk-run", daemon=True)
        self._thread.start()
        return self

    def _background(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - kept for wait() and the status display
            self.error = e
            self._ready.set()

    _detached_timeout_s = DETACHED_TIMEOUT_S

    def _run(self, serve_as: str | None = None) -> RunResult:
        from astratk.runtime.checks import check_gpu_memory, check_output_dir

        spec = self.spec
        started = time.time()
        check_output_dir(spec)  # before anything is written: an output_dir that is a file or read-only
        models = self._resolve_models()  # a bad Hub id or model directory leaves nothing behind, likewise
        check_gpu_memory(spec, trainers_here=serve_as is None)  # shares of a GPU that cannot fit, likewise
        # the session loads Lightning, the engines and Dask's cluster (~3 s): after the checks, so that a bad Hub id
        # or output_dir answers at once
        from astratk.runtime.session import Session

        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(spec.output_dir).expanduser().resolve() / f"{spec.name}-{stamp}-{uuid.uuid4().hex[:4]}"
        made = _make_dirs(run_dir)

        header = "".join(f"# {pid}: Hub {m['repo_id']}@{m['revision']} resolved to {m['directory']}\n"
                         for pid, m in models.items() if m["repo_id"])
        wall0 = time.time()
        entered = False  # set-up (the Session's __enter__) done: from then on the run keeps what it wrote
        try:
            (run_dir / "config.yaml").write_text(header + dump_spec(spec))
            with Session(spec, run_dir, self.print, deployment_name=serve_as) as session:
                entered = True
                self.session = session
                self._ready.set()
                summary = (session.serve(detached_timeout_s=self._detached_timeout_s) if serve_as
                           else session.train())
        except BaseException as e:
            # a run whose set-up failed leaves nothing behind, nor does one that found it had nothing to train
            if not entered or isinstance(e, NothingToTrain):
                _remove_dirs(made)
            raise
        finally:
            self._ready.set()
        summary["wall_time_s"] = time.time() - wall0
        summary["first_step_started_s"], summary["first_step_s"] = _first_step_s(session, started)
        summary["models"] = {pid: {**m, "directory": session.model_paths.get(pid, m["directory"])}
                             for pid, m in models.items()}
        self.result = self._finish(run_dir, session, summary)
        if session.trainer_error is not None:  # not a known cause: its traceback, once the outputs are written
            raise session.trainer_error
        return self.result

    def _resolve_models(self) -> dict[str, dict[str, Any]]:
        """Each policy's model source. Hub ids are resolved (downloaded unless cached) and their revision pinned
        to the commit found, so the run's config.yaml names exactly what it trained; the tiny model is built
        later, by the session."""

        out: dict[str, dict[str, Any]] = {}
        for i, p in enumerate(self.spec.policies):
            m = p.model
            if m.path is None:
                out[p.policy_id] = {"path": None, "directory": None, "repo_id": None, "revision": None}
                continue
            if m.is_gguf:  # dequantized (once per file content) before the run writes anything
                out[p.policy_id] = self._resolve_gguf(m, f"policies[{i}].model")
                continue

            local = (str(resolve_pypi(m.path, key=f"policies[{i}].model.path", cache_dir=m.cache_dir))
                     if is_pypi_path(m.path) else m.path)
            resolved = resolve(local, m.revision, key=f"policies[{i}].model.path")
            if is_hub_id(m.path):
                self.print(f"model for {p.policy_id!r}: Hub {m.path}@{resolved.revision} -> {resolved.directory}")
                m.revision = resolved.revision
            if is_hub_id(m.path) or is_pypi_path(m.path):
                from astratk.runtime.checks import check_lora_at  # loads torch

                check_lora_at(m, f"policies[{i}].model", resolved.directory)
            out[p.policy_id] = resolved.as_record()
        return out

    def _resolve_gguf(self, m: Any, key: str) -> dict[str, Any]:
        file = resolve_gguf_file(m.path, m.gguf_file, m.revision, key=key, cache_dir=m.cache_dir)
        directory = gguf_directory(file, key=f"{key}.path", cache_dir=m.cache_dir, log=self.print)
        from astratk.runtime.checks import check_lora_at  # loads torch

        check_lora_at(m, key, directory)
        return {"path": m.path, "directory": str(directory), "repo_id": None, "revision": m.revision,
                "gguf_file": str(file), "sha256": file_sha256(file)}

    def probe(self, n_tasks: int = 32, eval_tasks: int | None = None) -> Any:
        """Before starting: will this run's rollouts carry learning signal? `n_tasks` train tasks rolled out as the
        run would (group size, temperature, token budget, engine) in this process, and greedy held-out accuracy;
        returns a `ProbeReport` (printable; shown in a notebook) with what to change (`astratk.runtime.probe`)."""
        from astratk.runtime.probe import probe  # loads torch and transformers

        return probe(self.spec, n_tasks, printer=self.print, eval_tasks=eval_tasks)

    def serve(self, name: str, detached_timeout_s: float = DETACHED_TIMEOUT_S) -> RunResult:
        """`astratk deploy`: serve the run's deployment under `name` for trainer jobs that attach to it (blocking;
        see `Session.serve`). Once every policy's trainer has ended, it serves `detached_timeout_s` seconds more for
        another to attach, then ends."""
        self._detached_timeout_s = detached_timeout_s
        return self._run(serve_as=name)

    def _live(self, what: str) -> Any:
        if not self._ready.wait(timeout=600) or self.session is None or not hasattr(self.session, "deployment"):
            raise RuntimeError(f"cannot {what}: the run is {self.state}"
                               + (f" ({self.error!r})" if self.error else ""))
        return self.session

    def pause(self) -> None:
        """Stop leasing tasks and serving batches; rollouts in flight are admitted, nothing is lost."""
        self._live("pause").pause()

    def resume(self) -> None:
        self._live("resume").resume()

    def stop(self) -> None:
        """Ask every trainer to finish its current step and stop; the run then evaluates and writes its outputs."""
        session = self._live("stop")
        if session.state == "paused":
            session.resume()
        session.request_stop()

    def wait(self, timeout: float | None = None) -> RunResult:
        if self._thread is None:
            raise RuntimeError("wait(): the run was not started with start(block=False)")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"run {self.spec.name!r} still {self.state} after {timeout:.0f}s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def metrics(self) -> Any:
        """The finished run's metrics (xarray.Dataset with the `.astra` dashboards)."""
        if self.result is None:
            raise RuntimeError(f"metrics(): the run is {self.state}; they are written when it finishes "
                               "(`wait()`), or use status() meanwhile")
        return self.result.metrics()

    def status(self) -> dict[str, Any]:
        """Live numbers: state, per-policy version/steps/last reward, last held-out accuracy, buffer."""
        out: dict[str, Any] = {"state": self.state}
        session = self.session
        if session is None or not hasattr(session, "deployment") or self.result is not None:
            if self.result is not None:
                out.update({k: v for k, v in self.result.summary.items() if isinstance(v, (int, float, str))})
            return out
        try:
            m = session.deployment.datalayer.metrics(timeout=10)
        except Exception as e:  # noqa: BLE001 - a status display must not raise
            return {**out, "error": repr(e)}
        for p in self.spec.policies:
            k = f"data/{p.policy_id}/"
            out[p.policy_id] = {"version": int(m.get(k + "version", 0)), "max_steps": p.trainer.max_steps,
                                "buffer": int(m.get(k + "buffer_groups", 0)),
                                "groups_served": int(m.get(k + "groups_served", 0)),
                                "reward_received": m.get(k + "reward_mean_received", float("nan"))}
            if m.get(k + "agent/episodes"):  # agent and multi-turn envs: tool calls so far, per episode
                n = m[k + "agent/episodes"]
                out[p.policy_id]["agent"] = {"episodes": int(n), "tool_calls": m.get(k + "agent/tool_calls", 0.0) / n,
                                             "unparsed_calls": m.get(k + "agent/unparsed_calls", 0.0) / n,
                                             "turns": m.get(k + "agent/turns", 0.0) / n}
        for p in self.spec.policies:
            if isinstance(out.get(p.policy_id), dict):
                out[p.policy_id]["max_time_s"] = p.trainer.max_time_s
        t0 = getattr(session.evaluator, "train_t0", None)
        if t0:
            out["train_time_s"] = time.time() - t0
        monitor = getattr(session, "starvation", None)
        if monitor is not None and monitor.warnings:  # the newest, while it is fresh (one wait's warning)
            newest = monitor.warnings[-1]
            if time.time() - newest["time"] < 2 * monitor.repeat_s:
                out["starving"] = newest["line"]
        evals = [r for r in session.evaluator.records if r.get("accuracy") == r.get("accuracy")]
        if evals:
            out["accuracy"] = evals[-1]["accuracy"]
            out["accuracy_version"] = int(evals[-1]["version"])
            out["accuracy_curve"] = [(0.0 if r["train_time_s"] != r["train_time_s"] else float(r["train_time_s"]),
                                      float(r["accuracy"])) for r in evals]
        return out

    def _repr_html_(self) -> str:
        return render(self)

    def _finish(self, run_dir: Path, session: Any, summary: dict[str, Any]) -> RunResult:
        import astratk.viz  # noqa: F401  (registers the .astra accessor)
        from astratk.metrics import build_dataset, save

        ds = build_dataset([p.policy_id for p in self.spec.policies], session.step_rows, session.eval_rows,
                           session.counters, attrs={"name": self.spec.name, "partial": 0, **_flat(summary)},
                           services=session.service_rows, drops=session.drops)
        files = {"metrics": save(ds, run_dir / "metrics.nc")}
        files["summary"] = run_dir / "summary.json"
        files["summary"].write_text(json.dumps(summary, indent=2, default=float))
        if os.environ.get("ASTRATK_DASHBOARD", "1") == "0":  # sweeps, test suites: ~2-7 s of drawing saved per run
            self.print("dashboard not written (ASTRATK_DASHBOARD=0): RunResult.metrics().astra.save(STEM) draws it")
        else:
            try:  # a run that ended early may have too little to plot; its metrics and summary are written already
                files.update(ds.astra.save(run_dir / "dashboard"))
            except Exception as e:  # noqa: BLE001 - reported
                self.print(f"dashboard not written: {type(e).__name__}: {e}")
        self._report(summary, files)
        return RunResult(run_dir, summary, files)

    def _report(self, s: dict[str, Any], files: dict[str, Path]) -> None:
        p = self.print
        p("")
        tiny = all(p.model.path is None for p in self.spec.policies)
        start = (f"resumed, v{s.get('start_version', 0)}" if s.get("resumed_from") else
                 "warm start, v0" if tiny else "start, v0")
        gain = s["accuracy_gain"]
        failed = [w for w, a in (("first", s["accuracy_before"]), ("last", s["accuracy_after"])) if math.isnan(a)]
        said = (f"gain {100 * gain:+.1f} points" if not math.isnan(gain) else
                f"gain unknown (the {' and '.join(failed)} version's evaluation failed: see above)")
        p(f"held-out accuracy: {s['accuracy_before']:.3f} ({start}) -> {s['accuracy_after']:.3f} "
          f"(v{s['final_version']}), {said}; best {s['accuracy_best']:.3f}")
        t = s.get("time_to_target_s")
        target = 100 * s["target_gain"]
        p(f"+{target:.0f} points first reached after {t:.0f}s of training" if t is not None else
          f"+{target:.0f} points not reached in {s['train_time_s']:.0f}s of training")
        if s.get("first_step_s") is not None:
            p(f"start-up: the first optimizer step began {s['first_step_started_s']:.0f}s after the start (its batch "
              f"in hand) and ended at {s['first_step_s']:.0f}s")
        p(f"training: {s['steps']} steps in {s['train_time_s']:.0f}s, trainer waited for data "
          f"{100 * s['data_wait_fraction']:.0f}% of it; whole run {s['wall_time_s']:.0f}s")
        for pid, a in (s.get("agent") or {}).items():  # agent and multi-turn envs: how the tools were used
            p(f"{a['line']} (policy {pid!r})")
        for f in (s.get("frozen") or {}).values():  # models served beside the policies: their calls and latency
            p(f["line"])
        for name, path in files.items():
            p(f"{name:>8}: {path}")
        if s.get("stopped_early"):
            p(f"stopped early: {s['stop_reason']}")


def _make_dirs(run_dir: Path) -> list[Path]:
    """Make the run directory and its missing parents; the directories made, innermost first."""
    made, d = [], run_dir
    while not d.exists():
        made.append(d)
        d = d.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    return made


def _remove_dirs(made: list[Path]) -> None:
    """Undo `_make_dirs` after a failed set-up: the run directory and what set-up wrote in it, then each parent made
    for it that is still empty (another run may have put its own directory there meanwhile)."""

    if made:
        shutil.rmtree(made[0], ignore_errors=True)
    for d in made[1:]:
        try:
            d.rmdir()
        except OSError:
            break


def _flat(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str)) and v is not None}


def _first_step_s(session: Any, started: float) -> tuple[float | None, float | None]:
    """Seconds from `Run.start` (model resolution, a GGUF's dequantization, cluster start-up included) to the start
    of the in-process trainer's first optimizer step (its first batch in hand) and to its end; None when no step ran
    here (trainer jobs elsewhere)."""
    for recorder in session.recorders.values():
        if recorder.rows and recorder.t0 is not None:
            row = recorder.rows[0]
            end = next((v for k, v in row.items() if k.startswith("train/") and k.endswith("/time_s")), None)
            compute = next((v for k, v in row.items() if k.endswith("/step_compute_s")), 0.0)
            if end is not None:
                return recorder.t0 + end - compute - started, recorder.t0 + end - started
    return None, None

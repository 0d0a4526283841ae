"""`Run`: one whole local run, the same code path for the notebook and `astratk run` (DESIGN §5).

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
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astratk.spec import RunSpec


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
        import html

        rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(f'{v:.4g}' if isinstance(v, float) else str(v))}"
                       "</td></tr>" for k, v in self.summary.items())
        files = "".join(f"<li>{html.escape(k)}: <code>{html.escape(str(v))}</code></li>" for k, v in self.files.items())
        return f"<b>astratk run</b> <code>{html.escape(str(self.run_dir))}</code><table>{rows}</table><ul>{files}</ul>"


class Run:
    def __init__(self, spec: RunSpec, printer: Callable[[str], None] = print) -> None:
        self.spec = spec.validate()
        self.print = printer
        self.result: RunResult | None = None

    @classmethod
    def from_config(cls, path: str | Path, *overrides: str, printer: Callable[[str], None] = print) -> Run:
        from astratk.config import load_spec

        return cls(load_spec(path, list(overrides)), printer=printer)

    def __repr__(self) -> str:
        state = "finished" if self.result else "not started"
        return f"Run({self.spec.name!r}, policies={[p.policy_id for p in self.spec.policies]}, {state})"

    def start(self) -> RunResult:
        """Run to completion (blocking) and return where the metrics and plots are."""
        from astratk.runtime.session import Session

        spec = self.spec
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(spec.output_dir).expanduser().resolve() / f"{spec.name}-{stamp}-{uuid.uuid4().hex[:4]}"
        run_dir.mkdir(parents=True, exist_ok=True)
        from astratk.config import dump_spec

        (run_dir / "config.yaml").write_text(dump_spec(spec))
        wall0 = time.time()
        with Session(spec, run_dir, self.print) as session:
            summary = session.train()
        summary["wall_time_s"] = time.time() - wall0
        self.result = self._finish(run_dir, session, summary)
        return self.result

    def _finish(self, run_dir: Path, session: Any, summary: dict[str, Any]) -> RunResult:
        import astratk.viz  # noqa: F401  (registers the .astra accessor)
        from astratk.metrics import build_dataset, save

        ds = build_dataset([p.policy_id for p in self.spec.policies], session.step_rows, session.eval_rows,
                           session.counters, attrs={"name": self.spec.name, **_flat(summary)},
                           services=session.service_rows)
        files = {"metrics": save(ds, run_dir / "metrics.nc")}
        files.update(ds.astra.save(run_dir / "dashboard"))
        files["summary"] = run_dir / "summary.json"
        files["summary"].write_text(json.dumps(summary, indent=2, default=float))
        self._report(summary, files)
        return RunResult(run_dir, summary, files)

    def _report(self, s: dict[str, Any], files: dict[str, Path]) -> None:
        p = self.print
        p("")
        p(f"held-out accuracy: {s['accuracy_before']:.3f} (warm start, v0) -> {s['accuracy_after']:.3f} "
          f"(v{s['final_version']}), gain {100 * s['accuracy_gain']:+.1f} points; best {s['accuracy_best']:.3f}")
        t = s.get("time_to_target_s")
        target = 100 * s["target_gain"]
        p(f"+{target:.0f} points first reached after {t:.0f}s of training" if t is not None else
          f"+{target:.0f} points not reached in {s['train_time_s']:.0f}s of training")
        p(f"training: {s['steps']} steps in {s['train_time_s']:.0f}s, trainer waited for data "
          f"{100 * s['data_wait_fraction']:.0f}% of it; whole run {s['wall_time_s']:.0f}s")
        for name, path in files.items():
            p(f"{name:>8}: {path}")


def _flat(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str)) and v is not None}

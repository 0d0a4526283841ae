"""The live view of a run in a notebook: one output that updates in place while the run trains in the background.

`run = astratk.Run(spec).start(block=False)` then `run` (or `run.view()`) as a cell's last expression shows, every
`every_s` seconds: each policy's progress against its budget (steps or training time, whichever is nearer its end),
the held-out accuracy so far with a small curve, the data layer's buffer and reward, and the run's own log lines
(which then stay in this output instead of landing in whichever cell is running). `render(run)` is the HTML of one
moment, also what `repr` of a run shows outside the live view.
"""

from __future__ import annotations

import html
import math
import threading
from typing import Any

LOG_LINES = 12  # the newest log lines the view shows


def _bar(fraction: float, width: int = 180) -> str:
    done = max(0.0, min(1.0, fraction))
    return (f"<div style='display:inline-block;vertical-align:middle;background:#e8e8e8;width:{width}px;height:9px'>"
            f"<div style='background:#4a90d9;height:9px;width:{width * done:.0f}px'></div></div>")


def sparkline(points: list[tuple[float, float]], width: int = 220, height: int = 48) -> str:
    """An inline SVG line of (x, y) points, y in [0, 1] (accuracy), with the last point marked."""
    pts = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
    if len(pts) < 2:
        return ""
    x0, x1 = min(x for x, _ in pts), max(x for x, _ in pts)
    lo, hi = min(y for _, y in pts), max(y for _, y in pts)
    lo, hi = (lo - 0.05, hi + 0.05) if hi - lo < 0.1 else (lo, hi)
    sx = (width - 8) / ((x1 - x0) or 1.0)
    sy = (height - 8) / ((hi - lo) or 1.0)
    coords = [(4 + (x - x0) * sx, height - 4 - (y - lo) * sy) for x, y in pts]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
    lx, ly = coords[-1]
    return (f"<svg width='{width}' height='{height}' style='vertical-align:middle'>"
            f"<polyline points='{path}' fill='none' stroke='#4a90d9' stroke-width='1.5'/>"
            f"<circle cx='{lx:.1f}' cy='{ly:.1f}' r='2.5' fill='#d9534f'/></svg>")


def progress(version: int, max_steps: int, train_time_s: float | None, max_time_s: float | None
             ) -> tuple[float, str]:
    """(fraction done, label): steps against max_steps and training time against max_time_s, the larger fraction
    (a run ends at whichever budget it reaches first)."""
    by_steps = version / max(1, max_steps)
    label = f"v{version}/{max_steps}"
    fraction = by_steps
    if max_time_s and train_time_s is not None:
        by_time = train_time_s / max_time_s
        label += f" · {train_time_s:.0f}/{max_time_s:.0f} s"
        fraction = max(by_steps, by_time)
    return min(1.0, fraction), label


def render(run: Any) -> str:
    """The run's state as HTML (see the module docstring)."""
    st = run.status()
    state = str(st.get("state", "?"))
    rows = []
    for p in run.spec.policies:
        d = st.get(p.policy_id)
        if not isinstance(d, dict):
            continue
        fraction, label = progress(d["version"], d["max_steps"], st.get("train_time_s"), d.get("max_time_s"))
        reward = d.get("reward_received", math.nan)
        rows.append(f"<tr><td><b>{html.escape(p.policy_id)}</b></td><td>{_bar(fraction)}</td>"
                    f"<td>{100 * fraction:.0f}%</td><td>{html.escape(label)}</td><td>buffer {d['buffer']}</td>"
                    f"<td>reward {reward:.3f}</td></tr>")
        if d.get("agent"):  # agent envs: how the model uses its tools, while it trains
            a = d["agent"]
            rows.append(f"<tr><td></td><td colspan='5'>{a['episodes']} episodes: {a['tool_calls']:.2f} tool calls, "
                        f"{a['unparsed_calls']:.2f} unparseable, {a['turns']:.1f} turns per episode</td></tr>")
    curve = st.get("accuracy_curve") or []
    acc = ""
    if "accuracy" in st:
        best = max((a for _, a in curve if math.isfinite(a)), default=st["accuracy"])
        acc = (f"<div>held-out accuracy <b>{st['accuracy']:.3f}</b> at v{st['accuracy_version']} (best {best:.3f}, "
               f"{len(curve)} evaluations) {sparkline(curve)}</div>")
    if st.get("starving"):  # a trainer waits while groups are dropped: said where it cannot be missed
        acc += (f"<div style='background:#fff3cd;border:1px solid #e0c36c;padding:4px;margin:4px 0'>"
                f"{html.escape(str(st['starving']))}</div>")
    lines = list(getattr(run, "log_lines", []))[-LOG_LINES:]
    log = (f"<pre style='font-size:11px;max-height:14em;overflow:auto;margin:4px 0'>"
           f"{html.escape(chr(10).join(lines))}</pre>") if lines else ""
    extra = run.result._repr_html_() if run.result is not None else ""
    error = (f"<div style='color:#b00'>failed: {html.escape(repr(run.error))}</div>"
             if getattr(run, "error", None) is not None else "")
    return (f"<div><b>astratk run</b> <code>{html.escape(run.spec.name)}</code>: <i>{html.escape(state)}</i>"
            f"<table>{''.join(rows)}</table>{acc}{log}{error}{extra}</div>")


class LiveView:
    """Updates one notebook output with `render(run)` every `every_s` seconds until the run ends (a last update
    then). While it shows, the run's log lines go to it rather than to the running cell."""

    def __init__(self, run: Any, every_s: float = 2.0) -> None:
        self.run = run
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.handle: Any = None

    def show(self) -> LiveView:
        from IPython.display import HTML, display

        self.handle = display(HTML(render(self.run)), display_id=True)
        self.run.quiet = True
        self._thread = threading.Thread(target=self._loop, name="astratk-run-view", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        from IPython.display import HTML

        try:
            while not self._stop.wait(self.every_s):
                self.handle.update(HTML(render(self.run)))
                if self.run.state in ("finished", "failed"):
                    break
            self.handle.update(HTML(render(self.run)))
        finally:
            self.run.quiet = False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

"""The saved dashboard really renders: open `<stem>.html` offline in headless Chromium (Debian's) and look inside.

Bokeh draws every figure into canvases inside shadow roots, which `chromium --dump-dom` cannot see (it prints only the
root `<div>`s), so this drives Chromium over the DevTools protocol on a pipe (`--remote-debugging-pipe`: NUL-terminated
JSON on fds 3 and 4; the standard library is enough: no port, no websocket package). With the network off it checks
that BokehJS finished rendering (an idle document), one `.bk-Figure` per plot of the layout with the layout's titles,
ink on every figure's canvas, the page title, no uncaught exception or console error, no failed load but cosmetic
ones (Panel's CSS, favicon), and a screenshot with many colours; `test_checks_catch_*` runs them on broken pages.

Traps seen here (Chromium 156, Debian 12, root in a container, no GPU, no D-Bus):
- as root Chromium needs --no-sandbox;
- a small /dev/shm (Docker's 64 MB) crashes renderers: --disable-dev-shm-usage. Debian's launcher means to add it
  (/etc/chromium.d/dev-shm) but its test breaks when `findmnt` prints two lines ("[: ...: unexpected operator");
- stderr fills with D-Bus and SwiftShader/WebGL messages: harmless, so the checks read the page's own events instead;
- Panel 1.9 links four theme stylesheets and the favicon from cdn.holoviz.org even with inline resources; offline they
  fail to load and the plots do not need them (tolerated below, by resource type);
- the pipe must be fds 3 and 4: subprocess maps only 0-2 without a preexec_fn (unsafe with threads), so bash does it
  (dash rejects fds above 9: "Bad fd number"). Crashpad and fontconfig gave no trouble here.
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_dashboards import ALL_TITLES, synthetic_metrics  # also registers ds.astra

pytestmark = pytest.mark.integration

INSTALL = "apt-get install -y chromium"
TOLERATED_FAILED_LOADS = {"Stylesheet", "Font", "Image"}  # cosmetic: Panel's theme CSS on its CDN (module docstring)
MIN_INK = 1000  # non-white canvas pixels per figure: axes, ticks and lines draw ~6000 here; an unrendered canvas has 0
MIN_COLOURS = 64  # distinct screenshot colours: ~2000 here; a blank page has 1
RENDER_BUDGET_S = 20.0  # BokehJS goes idle ~1.5 s after navigation here

# Returns null until BokehJS has rendered its document (idle), then what the checks need.
PROBE = r"""
(() => {
  if (typeof Bokeh === "undefined" || Bokeh.documents.length === 0 || !Bokeh.documents[0].is_idle) return null;
  const deep = (root, selector) => {  // querySelectorAll through every shadow root
    const found = [...root.querySelectorAll(selector)];
    for (const el of root.querySelectorAll("*")) if (el.shadowRoot) found.push(...deep(el.shadowRoot, selector));
    return found;
  };
  const ink = (canvas) => {  // pixels drawn in something other than white or transparent
    const ctx = canvas.width && canvas.height ? canvas.getContext("2d") : null;  // null for a WebGL canvas
    if (!ctx) return 0;
    const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    let n = 0;
    for (let i = 0; i < px.length; i += 4) if (px[i + 3] > 0 && Math.min(px[i], px[i + 1], px[i + 2]) < 250) n++;
    return n;
  };
  const figures = deep(document, ".bk-Figure").map((el) => {
    const box = el.getBoundingClientRect();
    return {width: box.width, height: box.height, ink: Math.max(0, ...deep(el.shadowRoot ?? el, "canvas").map(ink))};
  });
  const models = [...Bokeh.documents[0].all_models].filter((m) => m.type === "Figure");
  return {title: document.title, figures, titles: models.map((m) => m.title?.text ?? null)};
})()
"""


@pytest.fixture(scope="module")
def chromium() -> str:
    """The browser's path; skips (before the dashboard is built) when there is none."""
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    pytest.skip(f"no chromium on PATH: install Debian's with `{INSTALL}` (.ci/run does)")


class DevTools:
    """Headless Chromium driven over `--remote-debugging-pipe`; every wait has a deadline that names what it awaited."""

    def __init__(self, exe: str, workdir: Path) -> None:
        to_chrome, self._w = os.pipe()
        self._r, from_chrome = os.pipe()
        # Lift the child's ends above 9 so that `3<&N 4>&M` cannot overwrite one with the other.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome, from_chrome)]
        os.close(to_chrome)
        os.close(from_chrome)
        self.log = workdir / "chromium.log"
        flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--remote-debugging-pipe", f"--user-data-dir={workdir / 'profile'}", "--window-size=1400,900"]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{high[0]} 4>&{high[1]}', "bash", exe, *flags],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=high, start_new_session=True)
        for fd in high:
            os.close(fd)
        self._buf, self._id = b"", 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 10.0) -> dict[str, Any]:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._w, data):]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next(deadline, f"chromium's reply to {method}")
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._next(deadline, f"the {method} event"))
        return next(e for e in self.events if e.get("method") == method)

    def _next(self, deadline: float, what: str) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError(f"timed out waiting for {what}; chromium log tail:\n{self.log_tail()}")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe while we waited for {what}:\n{self.log_tail()}")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (OSError, RuntimeError, TimeoutError):
            pass  # killed below
        try:
            self.proc.wait(timeout=10)  # waits for chromium to exit after Browser.close
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: our chromium and its helpers only
            self.proc.wait(timeout=10)
        os.close(self._w)
        os.close(self._r)

    def __enter__(self) -> DevTools:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Page:
    state: dict[str, Any] | None  # PROBE's answer once BokehJS was idle; None if it never was
    errors: list[str]  # uncaught exceptions, console.error/assert, non-network log errors
    failed_loads: list[tuple[str, str, str]]  # (resource type, url, error text)
    png: bytes  # screenshot


def render(exe: str, html: Path, workdir: Path) -> Page:
    """Open `html` with the network off, wait until BokehJS is idle (or throws), and collect what the page did."""
    workdir.mkdir(parents=True, exist_ok=True)
    with DevTools(exe, workdir) as chrome:
        chrome.call("Browser.getVersion", timeout=30)  # the first reply: chromium started
        target = chrome.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = chrome.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            chrome.call(f"{domain}.enable", session=session)
        chrome.call("Network.emulateNetworkConditions", {"offline": True, "latency": 0, "downloadThroughput": -1,
                                                         "uploadThroughput": -1}, session=session)
        nav = chrome.call("Page.navigate", {"url": html.as_uri()}, session=session, timeout=30)
        assert "errorText" not in nav, f"chromium could not open {html}: {nav['errorText']}"
        chrome.wait_event("Page.loadEventFired", timeout=RENDER_BUDGET_S)
        deadline, state = time.monotonic() + RENDER_BUDGET_S, None
        while state is None and time.monotonic() < deadline and not _errors(chrome.events):
            state = chrome.call("Runtime.evaluate", {"expression": PROBE, "returnByValue": True},
                                session=session)["result"].get("value")
            if state is None:
                time.sleep(0.1)
        shot = chrome.call("Page.captureScreenshot", {"format": "png"}, session=session, timeout=30)
    return Page(state, _errors(chrome.events), _failed_loads(chrome.events), base64.b64decode(shot["data"]))


def _errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            out.append(d.get("exception", {}).get("description") or d["text"])
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            out.append(" ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error" and p["entry"]["source"] != "network":
            out.append(p["entry"]["text"])  # network failures are judged by resource type in _failed_loads
    return out


def _failed_loads(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    urls = {e["params"]["requestId"]: e["params"]["request"]["url"] for e in events
            if e.get("method") == "Network.requestWillBeSent"}
    return [(p["type"], urls.get(p["requestId"], "?"), p["errorText"]) for e in events
            if e.get("method") == "Network.loadingFailed" for p in [e["params"]]]


def problems(page: Page, titles: list[str], page_title: str) -> list[str]:
    """Everything that says the dashboard did not render; [] when it did."""
    from PIL import Image  # a bokeh dependency

    out = [f"JS error: {e}" for e in page.errors]
    out += [f"failed to load {kind} {url}: {err}" for kind, url, err in page.failed_loads
            if kind not in TOLERATED_FAILED_LOADS and not url.endswith("/favicon.ico")]  # the tab icon: type Other
    colours = Image.open(io.BytesIO(page.png)).convert("RGB").getcolors(1 << 24)
    if len(colours) < MIN_COLOURS:
        out.append(f"the screenshot has {len(colours)} colours (< {MIN_COLOURS}): a blank page")
    if page.state is None:
        return [*out, f"BokehJS never finished rendering within {RENDER_BUDGET_S:.0f} s (no idle document)"]
    state = page.state
    if state["title"] != page_title:
        out.append(f"page title {state['title']!r}, expected {page_title!r}")
    if sorted(state["titles"]) != sorted(titles):
        out.append(f"figure titles {state['titles']}, the layout has {titles}")
    if len(state["figures"]) != len(titles):
        out.append(f"{len(state['figures'])} .bk-Figure elements in the DOM, the layout has {len(titles)} plots")
    for i, fig in enumerate(state["figures"]):
        if fig["width"] < 100 or fig["height"] < 100 or fig["ink"] < MIN_INK:
            out.append(f"figure {i} is {fig['width']}x{fig['height']} px with {fig['ink']} inked pixels")
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A two-policy metrics dataset with every plot's variables (no training run: steps, evaluations, drops, two
    hardware classes of rollout services) and its dashboard, saved the way a run saves it."""
    import holoviews as hv

    ds = synthetic_metrics()
    out = tmp_path_factory.mktemp("dashboard")
    # The second save runs with matplotlib as HoloViews' current backend (as in a notebook that uses it; a save
    # once left it so): it must still write Bokeh HTML, built with the plots' bokeh options.
    ds.astra.save(out / "first")
    hv.extension("matplotlib", logo=False)
    files = ds.astra.save(out / "dashboard")
    assert files["html"].is_file() and files["png"].is_file(), files
    titles = [hv.render(plot, backend="bokeh").title.text for plot in ds.astra.dashboard()]
    return ds, files["html"], titles


def test_saved_dashboard_renders_every_plot_offline(chromium, saved, tmp_path):
    _, html, titles = saved
    page = render(chromium, html, tmp_path)
    (tmp_path / "screenshot.png").write_bytes(page.png)  # kept by pytest's tmp_path for a look after a failure
    found = problems(page, titles, page_title=html.stem)
    assert found == [], "\n".join([*found, f"page state: {page.state}", f"screenshot: {tmp_path / 'screenshot.png'}"])
    assert titles == ALL_TITLES and page.state is not None  # the synthetic data gives every plot (lines, bars, bands)


# The script error leaves Bokeh's red error box on the page; the CDN page stays blank.
@pytest.mark.parametrize(("breakage", "blank"), [("script error", False), ("CDN resources offline", True)])
def test_checks_catch_a_dashboard_that_does_not_render(chromium, saved, tmp_path, breakage, blank):
    ds, html, titles = saved
    broken = tmp_path / "dashboard.html"
    if breakage == "script error":
        text = html.read_text()
        call = "root.Bokeh.embed.embed_items(docs_json"
        assert text.count(call) == 1, "Bokeh's embed call changed: update this breakage"
        broken.write_text(text.replace(call, "root.Bokeh.embed.embed_itemz(docs_json"))
    else:
        import holoviews as hv

        hv.save(ds.astra.dashboard(), broken, backend="bokeh", resources="cdn")  # what viz.save wrote before the fix
    found = problems(render(chromium, broken, tmp_path / "browser"), titles, page_title=broken.stem)
    assert any(p.startswith("JS error") for p in found), found
    assert any(p.startswith("BokehJS never finished") for p in found), found
    assert any("blank page" in p for p in found) == blank, found

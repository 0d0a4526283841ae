"""The metrics dataset and its `.astra` dashboards: a realistic two-policy dataset built from synthetic rows (the shapes
the trainer, evaluator, data layer and acquisition produce), saved to netCDF and loaded back, as a notebook would
open a finished run's `metrics.nc`; every plot is checked for the series it draws, and missing variables are named."""

from __future__ import annotations

import json

import numpy as np
import pytest

import astratk.viz  # noqa: F401  (registers ds.astra)
from astratk.metrics import build_dataset, load, save
from astratk.records import Drop
from astratk.viz import PLOTS, MissingMetrics

POLICIES = ("solver", "verifier")
N_STEPS, N_EVALS = 6, 3
SERVICES = {  # ServiceStats.by_service(): two hardware classes, the fast one with two workers
    "gpu_fast-0": {"hardware": "gpu_fast", "tasks": 60.0, "tokens": 900.0, "tasks_per_s": 60.0, "tokens_per_s": 900.0,
                   "version_lag_mean": 0.25, "version_lag_max": 1.0, "first_version": 0.0},
    "gpu_fast-1": {"hardware": "gpu_fast", "tasks": 50.0, "tokens": 850.0, "tasks_per_s": 55.0, "tokens_per_s": 850.0,
                   "version_lag_mean": 0.5, "version_lag_max": 2.0, "first_version": 2.0},
    "gpu_slow-0": {"hardware": "gpu_slow", "tasks": 20.0, "tokens": 300.0, "tasks_per_s": 20.0, "tokens_per_s": 300.0,
                   "version_lag_mean": 1.75, "version_lag_max": 3.0, "first_version": 1.0},
}
COUNTERS = {  # DataLayer.metrics() keys (task-level and per policy) after a run
    "data/leases_issued": 140.0, "data/tasks_completed": 130.0,
    "data/tasks_skipped_greso": 5.0, "data/tasks_dropped_failed": 1.0,
    "data/solver/groups_admitted": 20.0, "data/solver/groups_dropped_zero_variance": 4.0,
    "data/solver/groups_dropped_stale": 2.0, "data/solver/trajectories_unscored_dropped": 3.0,
    "data/verifier/groups_admitted": 18.0, "data/verifier/groups_dropped_too_long": 6.0,
    "data/verifier/groups_dropped_stale": 0.0,
    "data/solver/stage/replay/evicted": 7.0,  # a serving stage's count: not a drop of unseen data
    "data/stage/greso/p_easy": 0.5,  # a curator's state: not a drop
}
DROPS = [  # (stage, reason, unit, policy, count) in data-path order, as build_dataset lays them out
    ("curation", "greso", "tasks", "", 5.0), ("rollout", "failed", "tasks", "", 1.0),
    ("admission", "unscored", "trajectories", "solver", 3.0), ("admission", "zero_variance", "groups", "solver", 4.0),
    ("admission", "too_long", "groups", "verifier", 6.0),
    ("serving", "stale", "groups", "solver", 2.0), ("serving", "stale", "groups", "verifier", 0.0)]
ALL_TITLES = ["training reward", "held-out accuracy", "policy loss", "response length", "version lag per step", "version lag per rollout service",
              "training–inference mismatch |π − μ|", "DRPO gradient weight w", "dropped data by stage",
              "rollout tasks/s per service", "rollout tokens/s per service", "rollout tasks/s per hardware class",
              "rollout tokens/s per hardware class"]


def synthetic_metrics(policies=POLICIES, weights_for=("solver",), services=True, counters=True):
    """Rows as `Session` collects them: StepRecorder rows (`train/<pid>/...`, the loss's `train/<pid>/loss/...`),
    evaluator records, data-layer counters and per-service stats. Only `weights_for` report DRPO's w (a policy with
    another loss has none), and the solver's evaluations carry a per-role accuracy."""
    steps = {}
    for k, p in enumerate(policies):
        rows = []
        for i in range(N_STEPS):
            row = {f"train/{p}/reward_mean": 0.1 * i + k, f"train/{p}/time_s": 2.0 * i, f"train/{p}/loss": -0.01 * i,
                   f"train/{p}/completion_tokens_mean": 5.0 + i,
                   f"train/{p}/staleness_mean": 0.5 + 0.1 * i + k, f"train/{p}/staleness_max": 2.0 + i % 2 + k,
                   f"train/{p}/loss/tv_mean": 0.02 + 0.001 * i + 0.01 * k, f"train/{p}/loss/tv_max": 0.3 + 0.01 * i}
            if p in weights_for:
                row.update({f"train/{p}/loss/w_mean": 1.0 - 0.001 * i, f"train/{p}/loss/w_min": 0.9 - 0.01 * i,
                            f"train/{p}/loss/w_max": 1.1 + 0.01 * i})
            rows.append(row)
        steps[p] = rows
    evals = {p: [{"accuracy": 0.2 + 0.1 * i + 0.05 * k, "train_time_s": 4.0 * i, "version": 2.0 * i, "n": 32.0,
                  **({"accuracy_solver": 0.1 * i} if p == "solver" else {})} for i in range(N_EVALS)]
             for k, p in enumerate(policies)}
    kept = {k: v for k, v in COUNTERS.items() if k.split("/")[1] not in POLICIES or k.split("/")[1] in policies}
    drops = [Drop(*row) for row in DROPS] if counters else []
    return build_dataset(list(policies), steps, evals, kept if counters else {},
                         attrs={"name": "synthetic", "steps": N_STEPS}, services=SERVICES if services else None,
                         drops=drops)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """The dataset as a notebook gets it: saved by a run, loaded from disk."""
    return load(save(synthetic_metrics(), tmp_path_factory.mktemp("metrics") / "metrics.nc"))


def _lines(overlay) -> dict[str, list[float]]:
    """NdOverlay of curves -> {series: y values}."""
    return {str(key): [round(float(y), 6) for y in el.dimension_values(1)] for key, el in overlay.data.items()
            for key in [key[0] if isinstance(key, tuple) else key]}


def _bars(bars) -> dict[tuple[str, ...], float]:
    """Bars -> {(category, group...): value}."""
    df = bars.dframe()
    keys = [d.name for d in bars.kdims]
    return {tuple(str(v) for v in row[keys]): float(row[bars.vdims[0].name]) for _, row in df.iterrows()}


# ------------------------------------------------------------------------------------------------------- dataset
def test_dataset_layout_has_named_dims_and_coordinates(ds):
    assert dict(ds.sizes) == {"policy": 2, "step": N_STEPS, "evaluation": N_EVALS, "service": 3, "hardware": 2,
                              "drop_record": len(DROPS)}
    assert list(ds.policy.values) == list(POLICIES)
    for name in ("train_reward_mean", "train_staleness_max", "loss_tv_mean", "loss_w_min"):
        assert ds[name].dims == ("policy", "step"), name
    assert bool(ds["loss_w_mean"].sel(policy="verifier").isnull().all())  # the verifier's loss reports no w
    assert ds["eval_accuracy"].dims == ("policy", "evaluation")
    assert ds["eval_accuracy_solver"].dims == ("policy", "evaluation")
    assert ds["data_groups_dropped_stale"].dims == ("policy",)
    assert ds.attrs["counter_data_leases_issued"] == 140 and ds.attrs["name"] == "synthetic"
    # services: one row per rollout worker with its hardware label as a coordinate; classes aggregate them
    assert list(ds.service.values) == sorted(SERVICES)
    assert list(ds.service_hardware.values) == ["gpu_fast", "gpu_fast", "gpu_slow"]
    assert ds["service_tokens_per_s"].dims == ("service",)
    fast = ds.sel(hardware="gpu_fast")
    assert float(fast.hardware_services) == 2 and float(fast.hardware_tasks) == 110  # counts add up
    assert float(fast.hardware_tasks_per_s) == 57.5 and float(fast.hardware_version_lag_max) == 2  # speeds average
    assert float(fast.hardware_first_version) == 0


def test_drops_are_every_counted_drop_in_data_path_order(ds):
    drops = ds["dropped"].to_dataframe().reset_index()
    got = list(zip(drops.drop_stage, drops.drop_reason, drops.drop_unit, drops.drop_policy, drops.dropped))
    assert got == DROPS
    assert "dropped" not in build_dataset(["main"], {}, {}, {"data/leases_issued": 3.0})  # nothing counted: no dim
    other = Drop("serving", "stale", "groups", "not_in_this_run", 1.0)
    assert "dropped" not in build_dataset(["main"], {}, {}, {}, drops=[other])  # another run's policy: left out


# --------------------------------------------------------------------------------------------------------- plots
def test_reward_and_accuracy_draw_one_series_per_policy_and_role(ds):
    reward = ds.astra.reward()
    assert reward.kdims[0].name == "policy" and reward.last.kdims[0].name == "step"
    assert _lines(reward) == {"solver": [round(0.1 * i, 6) for i in range(N_STEPS)],
                              "verifier": [round(1 + 0.1 * i, 6) for i in range(N_STEPS)]}
    acc = ds.astra.accuracy()  # lines * markers
    lines = acc.get(0)
    assert lines.last.kdims[0].name == "eval_train_time_s"
    assert _lines(lines) == {"solver": [0.2, 0.3, 0.4], "verifier": [0.25, 0.35, 0.45],
                             "solver / solver": [0.0, 0.1, 0.2]}


def test_version_lag_per_step_and_per_rollout_service(ds):
    per_step, per_service = ds.astra.version_lag()
    lags = _lines(per_step)
    assert set(lags) == {"solver mean", "solver max", "verifier mean", "verifier max"}
    assert lags["verifier max"] == [3.0, 4.0, 3.0, 4.0, 3.0, 4.0]
    assert [d.name for d in per_service.kdims] == ["service", "stat"]
    assert _bars(per_service)[("gpu_slow-0", "mean")] == 1.75 and _bars(per_service)[("gpu_fast-1", "max")] == 2.0
    assert len(_bars(per_service)) == 6
    mean_steps, mean_services = ds.drop_vars(["train_staleness_max", "service_version_lag_max"]).astra.version_lag()
    assert set(_lines(mean_steps)) == {"solver mean", "verifier mean"} and len(_bars(mean_services)) == 3
    only_services = ds.drop_vars(["train_staleness_mean", "train_staleness_max"]).astra.version_lag()
    assert [d.name for d in only_services.kdims] == ["service", "stat"]  # one plot, not a layout


def test_mismatch_draws_the_mean_and_max_of_pi_minus_mu(ds):
    plot = ds.astra.mismatch()
    assert plot.last.vdims[0].name == "|π − μ|"
    lines = _lines(plot)
    assert lines["solver mean"] == [round(0.02 + 0.001 * i, 6) for i in range(N_STEPS)]
    assert lines["verifier max"] == [round(0.3 + 0.01 * i, 6) for i in range(N_STEPS)]
    assert set(_lines(ds.drop_vars(["loss_tv_max"]).astra.mismatch())) == {"solver mean", "verifier mean"}


def test_drpo_weights_band_and_mean_only_where_the_loss_reports_them(ds):
    plot = ds.astra.drpo_weights()
    band, mean = plot.get(0), plot.get(1)
    assert list(band.keys()) == ["solver"] and list(mean.keys()) == ["solver"]  # the verifier's loss has no w
    area = band["solver"]
    assert [d.name for d in area.vdims] == ["loss_w_min", "loss_w_max"]
    assert np.allclose(area.dimension_values("loss_w_max"), [1.1 + 0.01 * i for i in range(N_STEPS)])
    assert np.allclose(mean["solver"].dimension_values(1), [1.0 - 0.001 * i for i in range(N_STEPS)])
    no_band = ds.drop_vars(["loss_w_min"]).astra.drpo_weights()  # the mean alone
    assert list(no_band.keys()) == ["solver"]


def test_drops_bar_per_stage_and_reason_stacked_by_policy(ds):
    bars = ds.astra.drops()
    assert [d.name for d in bars.kdims] == ["what", "policy"]
    assert _bars(bars) == {(f"{stage}: {reason} ({unit})", policy or "all policies"): count
                           for stage, reason, unit, policy, count in DROPS}


def test_throughput_per_service_coloured_by_hardware_and_per_class(ds):
    tasks, tokens, tasks_class, tokens_class = ds.astra.throughput()
    assert [d.name for d in tasks.kdims] == ["service", "hardware"]
    assert _bars(tasks) == {("gpu_fast-0", "gpu_fast"): 60.0, ("gpu_fast-1", "gpu_fast"): 55.0,
                            ("gpu_slow-0", "gpu_slow"): 20.0}
    assert _bars(tokens)[("gpu_slow-0", "gpu_slow")] == 300.0
    assert _bars(tasks_class) == {("gpu_fast",): 57.5, ("gpu_slow",): 20.0}
    assert _bars(tokens_class) == {("gpu_fast",): 875.0, ("gpu_slow",): 300.0}


def test_loss_and_response_length_per_step(ds):
    assert set(_lines(ds.astra.loss())) == {"solver", "verifier"}
    lengths = _lines(ds.astra.response_length())
    assert set(lengths) == {"solver", "verifier"} and len(lengths["solver"]) == N_STEPS


def test_a_one_worker_run_draws_one_throughput_panel_and_no_per_service_lag(ds):
    one = ds.isel(service=[0], hardware=[0])
    panel = one.astra.throughput()  # one Bars, not a layout of four single-bar panels
    assert _bars(panel) == {("gpu_fast-0",): 900.0}
    assert panel.opts.get().kwargs["title"] == "rollout: 60 tasks/s, 900 tokens/s"
    lag = one.astra.version_lag()  # the per-step lines only: one service has nothing to compare
    assert set(_lines(lag)) == {"solver mean", "solver max", "verifier mean", "verifier max"}


# ------------------------------------------------------------------------------------------ missing and skipping
@pytest.mark.parametrize(("plot", "drop", "named"), [
    ("reward", ["train_reward_mean"], "train_reward_mean"),
    ("loss", ["train_loss"], "train_loss"),
    ("response_length", ["train_completion_tokens_mean"], "train_completion_tokens_mean"),
    ("accuracy", ["eval_accuracy"], "eval_accuracy"),
    ("version_lag", ["train_staleness_mean", "service_version_lag_mean"], "service_version_lag_mean"),
    ("mismatch", ["loss_tv_mean"], "loss_tv_mean"),
    ("drpo_weights", ["loss_w_mean"], "loss_w_mean"),
    ("drops", ["dropped"], "dropped"),
    ("throughput", ["service_tasks_per_s", "service_tokens_per_s", "hardware_tasks_per_s", "hardware_tokens_per_s"],
     "service_tasks_per_s"),
])
def test_a_plot_without_its_variables_names_them(ds, plot, drop, named):
    with pytest.raises(MissingMetrics, match=f"{plot}\\(\\): .*{named}"):
        getattr(ds.drop_vars(drop).astra, plot)()
    assert issubclass(MissingMetrics, ValueError)


def test_all_nan_counts_as_missing(ds):
    blank = ds.assign(loss_w_mean=ds["loss_w_mean"] * np.nan)
    with pytest.raises(MissingMetrics, match="loss_w_mean"):
        blank.astra.drpo_weights()


def test_dashboard_composes_what_the_dataset_supports(ds):
    import holoviews as hv

    full = ds.astra.dashboard()
    assert [hv.render(p, backend="bokeh").title.text for p in full] == ALL_TITLES
    # a single-policy PPO run without services or counters: reward, accuracy, loss, length, lag per step, mismatch
    small = synthetic_metrics(policies=("solver",), weights_for=(), services=False, counters=False)
    titles = [hv.render(p, backend="bokeh").title.text for p in small.astra.dashboard()]
    assert titles == ["training reward", "held-out accuracy", "policy loss", "response length",
                      "version lag per step", "training–inference mismatch |π − μ|"]
    assert {"drpo_weights", "drops", "throughput"} < set(PLOTS)
    with pytest.raises(MissingMetrics, match="supports none"):
        build_dataset(["main"], {}, {}, {}).astra.dashboard()


@pytest.mark.slow  # seconds: left out of the fast tier
def test_save_writes_standalone_html_and_png(ds, tmp_path):
    import holoviews as hv
    from PIL import Image

    before = hv.Store.current_backend
    files = ds.astra.save(tmp_path / "dash")
    assert hv.Store.current_backend == before  # the caller's backend is restored
    html = files["html"].read_text()
    assert files["html"].suffix == ".html" and len(html) > 500_000  # BokehJS inline: renders offline
    assert "cdn.bokeh.org" not in html
    assert all(title in html or json.dumps(title)[1:-1] in html for title in ALL_TITLES)  # as text or \uXXXX
    png = Image.open(files["png"])
    assert png.format == "PNG" and png.size[0] > 800 and png.size[1] > 800
    assert len(png.convert("RGB").getcolors(1 << 24)) > 64  # drawn, not blank


def test_agent_panel_shows_an_agent_runs_episode_metrics():
    import holoviews as hv

    counters = {**COUNTERS, "data/solver/traj/policy/calls_mean": 2.0, "data/solver/traj/policy/tool_calls_mean": 1.0,
                "data/solver/traj/policy/endpoint_latency_s_mean": 0.05, "data/solver/traj/policy/turns_mean": 9.0}
    agent_run = build_dataset(["solver"], {}, {}, counters)
    bars = _bars(agent_run.astra.agent())
    assert bars == {("policy_calls", "solver"): 2.0, ("policy_tool_calls", "solver"): 1.0,
                    ("policy_endpoint_latency_s", "solver"): 0.05}  # other envs' metrics (turns) are not the agent's
    assert "agent episodes (means)" in [hv.render(p, backend="bokeh").title.text for p in agent_run.astra.dashboard()]
    with pytest.raises(MissingMetrics, match="AgentEnv"):
        synthetic_metrics().astra.agent()

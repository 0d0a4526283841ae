"""The notebook view of a run: progress against whichever budget ends the run first, the accuracy curve, the log."""

from __future__ import annotations

from types import SimpleNamespace

from astratk.runtime.view import progress, render, sparkline


def test_progress_follows_the_budget_nearer_its_end():
    assert progress(100, 2000, 75.0, 150.0) == (0.5, "v100/2000 · 75/150 s")  # the time budget ends it
    assert progress(1500, 2000, 15.0, 150.0)[0] == 0.75  # the step budget
    assert progress(10, 20, None, None) == (0.5, "v10/20")
    assert progress(30, 20, 500.0, 150.0)[0] == 1.0


def test_sparkline_draws_finite_points_and_marks_the_last():
    svg = sparkline([(0.0, 0.3), (10.0, 0.5), (float("nan"), 0.9), (20.0, 0.6)])
    assert svg.startswith("<svg") and svg.count(",") == 3 and "<circle" in svg  # three finite points
    assert sparkline([(0.0, 0.3)]) == ""  # one point is no curve


def test_render_shows_progress_accuracy_and_the_newest_log_lines():
    spec = SimpleNamespace(name="nb", policies=[SimpleNamespace(policy_id="main")])
    status = {"state": "training", "train_time_s": 60.0, "accuracy": 0.41, "accuracy_version": 12,
              "accuracy_curve": [(0.0, 0.3), (30.0, 0.38), (60.0, 0.41)],
              "main": {"version": 12, "max_steps": 2000, "max_time_s": 120.0, "buffer": 3, "groups_served": 40,
                       "reward_received": 0.52}}
    run = SimpleNamespace(spec=spec, status=lambda: status, result=None, error=None,
                          log_lines=[f"line {i}" for i in range(30)])
    page = render(run)
    assert "<i>training</i>" in page and "50%" in page and "v12/2000 · 60/120 s" in page
    assert "0.410" in page and "best 0.410" in page and "<svg" in page
    assert "line 29" in page and "line 17" not in page  # the newest 12 lines


def test_render_shows_how_an_agent_uses_its_tools():
    spec = SimpleNamespace(name="nb", policies=[SimpleNamespace(policy_id="main")])
    status = {"state": "training", "main": {"version": 2, "max_steps": 10, "buffer": 0, "groups_served": 4,
                                            "reward_received": 0.1, "agent": {"episodes": 64, "tool_calls": 0.75,
                                                                              "unparsed_calls": 0.25, "turns": 1.5}}}
    run = SimpleNamespace(spec=spec, status=lambda: status, result=None, error=None, log_lines=[])
    assert "64 episodes: 0.75 tool calls, 0.25 unparseable, 1.5 turns per episode" in render(run)

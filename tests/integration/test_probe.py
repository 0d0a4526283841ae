"""The pre-flight: `Run(spec).probe()` and `astratk probe --config` roll out train tasks with the run's engine and
sampling in this process and say how much of it would carry learning signal, with the same advice a starving run
prints (`astratk.runtime.probe`)."""

from __future__ import annotations

import pytest

from astratk.runtime.probe import pass_at_k
from astratk.runtime.run import Run

pytestmark = pytest.mark.integration


def test_pass_at_k_estimator():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 1, 1) == pytest.approx(1 / 8)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)


def test_probe_reports_the_signal_a_run_would_get(tmp_path):
    from tests.integration.test_local_run import small_spec

    spec = small_spec(tmp_path)
    lines: list[str] = []
    report = Run(spec, printer=lines.append).probe(n_tasks=6, eval_tasks=4)
    p = report.policies["main"]
    assert report.n_tasks == 6 and p.groups == 6 and p.samples == 6 * spec.rollout.group_size
    assert 0.0 <= p.reward_mean <= 1.0 and 0.0 <= p.pass_at_1 <= p.pass_at_k <= 1.0 and p.k == 4
    assert p.greedy_accuracy is not None and 0.0 <= p.signal_share <= 1.0
    text = str(report)
    assert "probe: 6 train tasks" in text and "of groups carry signal" in text and "pass@4" in text
    assert not (tmp_path / "runs").exists()  # a probe writes no run directory


def test_probe_from_the_command_line(tmp_path, capsys, monkeypatch):
    from astratk.cli import main

    cache = tmp_path / "cache"
    config = tmp_path / "run.yaml"
    config.write_text(f"""
env: {{class_path: arithmetic, init_args: {{levels: [1], n_heldout: 8}}}}
policies:
  - model: {{cache_dir: {cache}, tiny: {{warm_start_steps: 30, warm_start_batch: 32}}}}
rollout: {{group_size: 4, max_new_tokens: 6, temperature: 1.0}}
""")
    assert main(["probe", "--config", str(config), "--tasks", "3", "--eval_tasks=2"]) == 0
    out = capsys.readouterr().out
    assert "probe: 3 train tasks" in out and "policy 'main': mean reward" in out
    assert main(["probe", "--config", str(config), "--tasks", "x"]) == 2
    assert "--tasks needs a whole number" in capsys.readouterr().err

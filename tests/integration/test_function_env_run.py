"""The README's FunctionEnv example, executed as written (at a smoke budget): a real `datasets.Dataset`, a TRL-style
reward, a tiny model warm-started from the dataset's answer column, a real run on a local Dask cluster; and the
same env from YAML by its short name with a reward function given by dotted path."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    [block] = [b for b in blocks if "FunctionEnv(" in b]
    return block


def test_the_readme_example_trains(tmp_path, monkeypatch):
    import astratk
    from astratk.quick import smoke

    code = readme_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 10  # import to training in <= 10 lines
    real_run = astratk.Run
    made = []

    def smoke_run(spec, *args, **kwargs):  # the example's spec at a smoke budget, models cached under tmp
        spec.output_dir = str(tmp_path / "runs")
        run = real_run(smoke(spec, steps=3, cache_dir=str(tmp_path / "cache")), *args, printer=lambda s: None)
        made.append(run)
        return run

    monkeypatch.setattr(astratk, "Run", smoke_run)
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "__readme__"}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the repository's own README
    result = scope["result"]
    assert result.summary["steps"] == 3
    ds = result.metrics()
    [reward] = [v for v in ds.data_vars if "reward_exact_mean" in v]  # FunctionEnv's per-function metric
    values = ds[reward].values
    seen = values[~np.isnan(values)]
    assert seen.size and ((seen >= 0) & (seen <= 1)).all(), values


def test_from_yaml_by_short_name(tmp_path):
    from astratk.config import load_spec

    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(f'{{"prompt": "{a} + {b} =", "answer": "{a + b}"}}' for a in range(20)
                              for b in range(20)))
    config = tmp_path / "run.yaml"
    config.write_text(f"""
env:
  class_path: function
  init_args:
    dataset: {rows}
    reward_funcs: [tests.unit.test_function_env.exact]
    demonstration_column: answer
    heldout: 40
""")
    spec = load_spec(str(config), [])
    env = spec.env
    assert type(env).__name__ == "FunctionEnv" and env.stats["heldout"] == 40 and env.stats["train"] == 360
    task = next(iter(env.tasks("heldout")))
    assert env.grade(task, task.info["columns"]["answer"]) == 1.0


def test_a_reward_model_scores_on_the_rollout_worker_from_yaml(tmp_path):
    """TRL's way of naming a reward model (its directory in `reward_funcs`) through the YAML front door: the run
    ships the env to its Dask rollout worker, which loads the model there and scores every group with it."""
    import astratk
    from astratk.config import load_spec
    from astratk.quick import smoke
    from tests.unit.test_reward_model import _save

    rm = _save(tmp_path / "tiny_rm")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(f'{{"prompt": "{a} + {b} =", "answer": "{a + b}"}}' for a in range(20)
                              for b in range(20)))
    config = tmp_path / "run.yaml"
    config.write_text(f"""
name: rm
output_dir: {tmp_path / "runs"}
env:
  class_path: function
  init_args:
    dataset: {rows}
    reward_funcs: [tests.unit.test_function_env.exact, {rm}]
    reward_weights: [1.0, 0.5]
    demonstration_column: answer
    heldout: 16
""")
    spec = smoke(load_spec(str(config), []), steps=2, cache_dir=str(tmp_path / "cache"))
    result = astratk.Run(spec, printer=lambda s: None).start()
    assert result.summary["steps"] == 2
    ds = result.metrics()
    [score] = [v for v in ds.data_vars if "reward_tiny_rm_mean" in v]
    values = ds[score].values
    assert np.isfinite(values[~np.isnan(values)]).any(), values
    [cost] = [v for v in ds.data_vars if "reward_model_tiny_rm_ms_mean" in v]  # what scoring cost, per completion
    assert (ds[cost].values[~np.isnan(ds[cost].values)] > 0).any()
    assert (tmp_path / "runs").exists()


def test_a_judge_on_an_openai_endpoint_scores_from_the_rollout_worker(tmp_path):
    """A judge served over HTTP (a scripted engine behind astratk's endpoint in this process) asked by the run's
    Dask rollout worker process while it scores each group: its verdicts are the reward, its costs are metrics."""
    pytest.importorskip("aiohttp")
    import astratk
    from astratk.engines.scripted import ScriptedEngine
    from astratk.envs.function import FunctionEnv
    from astratk.envs.judge import Judge
    from astratk.quick import smoke
    from astratk.rollout.openai_api import OpenAIEndpoint
    from astratk.spec import PolicySpec, RunSpec
    from tests.unit.test_judge import END, TOK

    asked = []

    def verdict(prompt, params):  # a strict judge: a reply that ends in the reference is right
        text = TOK.decode(prompt)
        asked.append(text)
        said, reference = text.split("said: ")[-1].split(" | reference: ")
        right = said.strip() and said.split()[-1] == reference.split()[0]
        return TOK("yes" if right else "no", add_special_tokens=False)["input_ids"] + [END]

    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(20) for b in range(20)]
    with OpenAIEndpoint(ScriptedEngine(TOK, verdict), model="judge") as ep:
        judge = Judge(ep.base_url, "judge", parse="verdict", name="strict",
                      template="{prompt} said: {completion} | reference: {answer}")
        env = FunctionEnv(rows, judge, demonstration_column="answer", heldout=16)
        spec = smoke(RunSpec(name="judge", output_dir=str(tmp_path / "runs"), env=env, policies=[PolicySpec()]),
                     steps=2, cache_dir=str(tmp_path / "cache"))
        result = astratk.Run(spec, printer=lambda s: None).start()
    assert result.summary["steps"] == 2 and len(asked) >= 2 * 4 * 4  # 2 steps of 4 groups of 4, at least
    ds = result.metrics()
    [errors] = [v for v in ds.data_vars if "judge_strict_errors_mean" in v]
    assert np.nanmax(ds[errors].values) == 0.0
    [rewards] = [v for v in ds.data_vars if "reward_strict_mean" in v]
    seen = ds[rewards].values[~np.isnan(ds[rewards].values)]
    assert seen.size and ((seen >= 0) & (seen <= 1)).all()

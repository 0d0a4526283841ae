"""`bench/precision.py`: each cell's spec (its loss, the engine's dtype, an fp32 trainer), the collapse rule it shares
with the stability bench, and the table and decision it prints from its cells, on cells whose figures are known."""

from __future__ import annotations

import argparse
import math

import pytest

from tests._bench import bench_module

precision = bench_module("precision")
run_metrics = bench_module("_run_metrics")


def _cell(mode, loss, dtype, seed, t10, t20, *, end=0.6, best=0.6, tps=100.0, collapsed=False, steps=10):
    return {"mode": mode, "loss": loss, "dtype": dtype, "seed": seed, "initial": 0.25, "train_time_s": 180.0,
            "time_to": {"10": t10, "20": t20}, "accuracy_at_end": end, "accuracy_best": best, "steps": steps,
            "collapsed": collapsed, "rollout_tokens_per_s": tps, "pi_mu_abs_mean": 1e-3, "pi_mu_abs_max": 0.5,
            "skipped_steps": 0, "fractions": {"clip_frac": 0.1}}


def test_the_grid_runs_seed_major_with_both_dtypes_of_a_loss_side_by_side():
    args = precision.parse_args(["--modes", "lora", "--losses", "drpo,ppo_clip", "--seeds", "2"])
    assert precision.grid(args) == [
        ("lora", 0, "drpo", "float32"), ("lora", 0, "drpo", "bfloat16"),
        ("lora", 0, "ppo_clip", "float32"), ("lora", 0, "ppo_clip", "bfloat16"),
        ("lora", 1, "drpo", "float32"), ("lora", 1, "drpo", "bfloat16"),
        ("lora", 1, "ppo_clip", "float32"), ("lora", 1, "ppo_clip", "bfloat16")]


@pytest.mark.parametrize("flag", [["--losses", "grpo"], ["--dtypes", "float16"], ["--modes", "qlora"],
                                  ["--seeds", "0"]])
def test_bad_grid_arguments_are_refused_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit):
        precision.parse_args(flag)
    assert flag[0] in capsys.readouterr().err


@pytest.mark.parametrize(("mode", "loss", "dtype"), [("lora", "dppo", "bfloat16"), ("full", "ppo_clip", "float32"),
                                                     ("full", "drpo", "bfloat16")])
def test_a_cell_sets_its_loss_and_engine_dtype_and_keeps_the_trainer_fp32(tmp_path, mode, loss, dtype):
    args = precision.parse_args(["--seconds", "30"])
    spec = precision.cell_spec(args, mode, 1, loss, dtype, tmp_path)
    p = spec.policies[0]
    assert type(p.loss).__name__.lower().replace("_", "").startswith(
        {"drpo": "drpo", "dppo": "dppo", "ppo_clip": "ppoclip"}[loss]), type(p.loss)
    assert p.trainer.precision == "32-true" and spec.rollout.engine_args["dtype"] == dtype
    assert (p.model.lora is not None) == (mode == "lora") and p.trainer.lr == precision.MODES[mode]
    assert spec.seed == 1 and p.trainer.max_time_s == 30.0
    assert spec.weights.publish_dtype == ("bfloat16" if (mode, dtype) == ("full", "bfloat16") else
                                          type(spec).__dataclass_fields__["weights"].default_factory().publish_dtype)


def test_collapse_rule():
    c = run_metrics.collapsed
    assert not c(0.25, [0.4, 0.5, 0.45])  # keeps more than half its gain
    assert c(0.25, [0.6, 0.3])  # lost more than half of +35 points
    assert c(0.25, [0.2, 0.1])  # 15 points below the start
    assert not c(0.25, [0.2])  # 5 below: noise, not a collapse
    assert c(0.25, [0.5], nonfinite=True) and not c(0.25, [])


def test_the_table_medians_per_seed_times_and_the_decision():
    cells = [_cell("lora", "drpo", "float32", s, t10, t20, tps=100.0) for s, (t10, t20) in
             enumerate([(60.0, 120.0), (90.0, None), (30.0, 150.0)])]
    cells += [_cell("lora", "drpo", "bfloat16", s, t10, t20, tps=150.0) for s, (t10, t20) in
              enumerate([(30.0, 90.0), (60.0, 120.0), (60.0, None)])]
    cells += [_cell("lora", "ppo_clip", "bfloat16", 0, None, None, end=0.1, collapsed=True)]
    rows = precision.summarise(cells)
    assert [(r["loss"], r["dtype"], r["n"]) for r in rows] == [
        ("drpo", "float32", 3), ("drpo", "bfloat16", 3), ("ppo_clip", "bfloat16", 1)]
    fp, bf, ppo = rows
    assert fp["time_to"] == {"10": 60.0, "20": 150.0} and fp["time_to_per_seed"]["20"] == [120.0, math.inf, 150.0]
    assert bf["time_to"] == {"10": 60.0, "20": 120.0} and ppo["collapses"] == 1 and math.isinf(ppo["time_to"]["10"])
    text = precision.table(rows, 180.0)
    lines = text.splitlines()
    assert all(line.count("|") == lines[0].count("|") for line in lines)  # a well-formed markdown table
    assert "| lora | drpo | float32 | 3 | 60 s; 60 s, 90 s, 30 s | 150 s; 120 s, never, 150 s |" in text
    assert "1/1" in lines[-1]
    (decision,) = precision.decide(rows)
    assert "+10 points in 60 s against 60 s (1.00x)" in decision and "+20 points in 120 s against 150 s (1.25x)" \
        in decision and "1.50x the tokens/s" in decision and decision.endswith("bf16 rollouts pay")
    # a collapse of DRPO with bf16 rollouts keeps fp32, however fast
    cells[3]["collapsed"] = True
    (decision,) = precision.decide(precision.summarise(cells))
    assert "collapses bf16 1/3" in decision and decision.endswith("fp32 rollouts stay")


def test_the_trl_comparison_keeps_astratk_in_fp32_unless_asked(tmp_path):
    """tutorial 09's recipe samples in bf16 where the CPU has bf16 units; bench/vs_trl.py compares against TRL's fp32
    generation, so its astratk side stays fp32 unless `--astratk-set rollout.engine_args...` says otherwise."""
    import yaml

    recipe = yaml.safe_load((precision.ROOT / "tutorials" / "real_model.yaml").read_text())
    assert recipe["rollout"]["engine_args"]["dtype"] == "bfloat16-if-native"
    astratk_spec = bench_module("_vs_trl_astratk").astratk_spec

    def spec(*sets):
        return astratk_spec(argparse.Namespace(model="smollm2", lora=True, task="sums", seconds=30.0,
                                               astratk_set=list(sets)), tmp_path)

    assert spec().rollout.engine_args["dtype"] == "float32"
    assert spec("rollout.engine_args={dtype: bfloat16}").rollout.engine_args["dtype"] == "bfloat16"

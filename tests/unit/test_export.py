"""`export_hf` / `astratk export`: a trained policy as an HF directory that transformers loads with the trained
weights bit for bit (fp32, tied embeddings), the character tokenizer intact, and that a new run starts from.

The "run" here is a run directory laid out as `Run`/`Session` lay it out (config.yaml, summary.json, weights/ with
version 0 = the model directory) holding two trained versions: the base weights plus seeded noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from astratk.cli import main
from astratk.config import dump_spec
from astratk.envs.math.arithmetic import ArithmeticEnv
from astratk.models import build_char_tokenizer, ensure_model
from astratk.models.export import PROVENANCE, _sha256, export_hf
from astratk.models.loading import load_causal_lm
from astratk.models.tokenizer import check_round_trip
from astratk.runtime.deploy import publish_initial
from astratk.spec import ModelSpec, PolicySpec, RunSpec, TinyModelSpec
from astratk.weights.store import WeightStore

# head_dim 32, one layer, two warm-start steps: builds in about a second.
TINY = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     warm_start_steps=2, warm_start_batch=4, warm_start_target=None, seed=5)
ENV = ArithmeticEnv(n_heldout=8)
IDS = torch.tensor([[5, 40, 41, 42, 17, 2, 60, 61, 9, 100], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])  # [2, 10]


def _perturbed(base: str, seed: int) -> torch.nn.Module:
    """The base model plus seeded noise on every parameter: a stand-in for trained weights. Tied parameters are
    one object, so they stay tied."""
    model = load_causal_lm(base, torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}  # as PolicyModule.weights() publishes


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits  # [2, 10, vocab] fp32


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run_dir, base model dir, {version: trained model})."""
    cache = tmp_path_factory.mktemp("cache")
    base = str(ensure_model(ModelSpec(tiny=TINY), ENV, cache_dir=cache, log=lambda s: None))
    run_dir = tmp_path_factory.mktemp("runs") / "export-test-20260101-000000-abcd"
    run_dir.mkdir()
    spec = RunSpec(name="export-test", env=ENV, policies=[PolicySpec(model=ModelSpec(tiny=TINY, cache_dir=str(cache)))])
    (run_dir / "config.yaml").write_text(dump_spec(spec))
    store = WeightStore(str(run_dir / "weights"))
    publish_initial(store, "main", base)
    models = {0: load_causal_lm(base, torch.float32).eval(), 1: _perturbed(base, 1), 2: _perturbed(base, 2)}
    for version in (1, 2):
        store.publish("main", version, _state(models[version]))
    (run_dir / "summary.json").write_text(json.dumps({"policy_id": "main", "model_path": base, "final_version": 2}))
    return run_dir, base, models


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    run_dir, _, _ = run
    return export_hf(run_dir, tmp_path_factory.mktemp("exports") / "latest")


# ------------------------------------------------------------------------------------------------ happy paths
def test_export_reloads_with_the_trained_logits_and_tied_embeddings(run, exported):
    _, base, models = run
    reloaded = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert reloaded.dtype == torch.float32
    assert torch.equal(_logits(reloaded), _logits(models[2]))  # the newest version, exactly
    assert not torch.equal(_logits(reloaded), _logits(models[0]))
    # tie_word_embeddings: one tensor on disk (as in the base), one parameter after loading
    assert reloaded.config.tie_word_embeddings
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    with safe_open(exported / "model.safetensors", "pt") as f, \
            safe_open(Path(base) / "model.safetensors", "pt") as g:
        names = sorted(f.keys())  # safe_open handles are not mappings: no `in`
        assert names == sorted(g.keys()) and "lm_head.weight" not in names
        assert all(f.get_tensor(k).dtype == torch.float32 for k in names)


def test_export_carries_tokenizer_generation_config_and_provenance(run, exported):
    run_dir, base, _ = run
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json", PROVENANCE} <= names
    assert "warm_start.json" not in names  # the base's cache marker describes the base, not the export
    check_round_trip(AutoTokenizer.from_pretrained(exported), build_char_tokenizer())  # raises on any difference
    text = "12 + 345 =\n  357\t"
    tok = AutoTokenizer.from_pretrained(exported)
    assert tok.decode(tok(text)["input_ids"]) == text
    assert (exported / "generation_config.json").read_text() == (Path(base) / "generation_config.json").read_text()
    record = json.loads((exported / PROVENANCE).read_text())
    ref = WeightStore(str(run_dir / "weights")).ref("main", 2)
    assert record["policy_id"] == "main" and record["version"] == 2 and record["source"] == "run"
    assert record["run_dir"] == str(run_dir) and record["base_model"] == str(Path(base).resolve())
    assert record["store_checksum"] == ref.checksum and record["dtype"] == "float32"
    assert record["weights_sha256"] == {"model.safetensors": _sha256(exported / "model.safetensors")}


def test_a_run_starts_from_the_export(run, exported):
    """`model.path: <export>` passes validation, `ensure_model` hands the directory over unchanged, and what the
    trainer and `publish_initial` load from it (version 0 of the new run) is the exported version's state."""
    _, _, models = run
    spec = ModelSpec(path=str(exported))
    spec.validate("model")
    assert ensure_model(spec, ENV) == exported
    loaded = load_causal_lm(str(exported), torch.float32).state_dict()
    want = models[2].state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)


def test_chosen_versions_store_url_and_bf16(run, tmp_path):
    run_dir, base, models = run
    v1 = export_hf(run_dir, tmp_path / "v1", version=1)
    assert json.loads((v1 / PROVENANCE).read_text())["version"] == 1
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(v1)), _logits(models[1]))
    v0 = export_hf(str(run_dir / "weights"), tmp_path / "v0", version=0, base_model=base)  # a store + its base
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(v0)), _logits(models[0]))
    half = export_hf(run_dir, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(half, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(reloaded[k], v.to(torch.bfloat16)) for k, v in models[2].state_dict().items())


def test_lightning_checkpoint_of_a_policy_module(run, tmp_path):
    """A real `Trainer.save_checkpoint` of PolicyModule: `model.*` tensors, model_path in the hyper-parameters."""
    import lightning.pytorch as pl

    from astratk.losses.drpo import DRPO
    from astratk.training.module import PolicyModule

    _, base, models = run
    module = PolicyModule(base, DRPO())
    module.model.load_state_dict(models[1].state_dict())
    module.policy_version = 1
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(tmp_path / "step.ckpt")
    out = export_hf(tmp_path / "step.ckpt", tmp_path / "from-ckpt")
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out)), _logits(models[1]))
    record = json.loads((out / PROVENANCE).read_text())
    assert record["source"] == "checkpoint" and record["base_model"] == str(Path(base).resolve())
    # PolicyModule.on_save_checkpoint records policy and version (resume support); older checkpoints lack them
    recorded = "astratk" in torch.load(tmp_path / "step.ckpt", map_location="cpu", weights_only=True)
    assert record["version"] == (1 if recorded else None)
    with pytest.raises(ValueError, match="holds one version"):
        export_hf(tmp_path / "step.ckpt", tmp_path / "again", version=3)
    if recorded:
        with pytest.raises(ValueError, match="is of policy 'main', not 'judge'"):
            export_hf(tmp_path / "step.ckpt", tmp_path / "again", policy_id="judge")


# ------------------------------------------------------------------------------------------------ errors
def test_missing_version_and_policy_are_named(run, tmp_path):
    run_dir, _, _ = run
    with pytest.raises(KeyError, match=r"version 9 is not in .* \(retained: 0-2\)"):
        export_hf(run_dir, tmp_path / "out", version=9)
    with pytest.raises(KeyError, match=r"no policy 'judge' \(policies: \['main'\]\)"):
        export_hf(run_dir, tmp_path / "out", policy_id="judge")
    assert not (tmp_path / "out").exists()


def test_non_empty_out_dir_needs_overwrite_and_never_an_input(run, tmp_path):
    run_dir, base, _ = run
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty.*overwrite=True"):
        export_hf(run_dir, out)
    with pytest.raises(FileExistsError, match="holds no model"):  # overwrite deletes only a model directory
        export_hf(run_dir, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    export_hf(run_dir, out / "model", version=1)
    export_hf(run_dir, out / "model", overwrite=True)  # replaces an earlier export
    assert json.loads((out / "model" / PROVENANCE).read_text())["version"] == 2
    before = sorted(p.name for p in (run_dir / "weights" / "main").iterdir())
    # two rails keep overwrite=True off the inputs: no overlap with the store or the base model, and a non-empty
    # directory is deleted only when it holds a model
    for inside in (run_dir / "weights" / "new", Path(base), Path(base) / "sub"):
        with pytest.raises(ValueError, match="overlaps the export's own input"):
            export_hf(run_dir, inside, overwrite=True)
    for holder in (run_dir / "weights", run_dir / "weights" / "main", run_dir):
        with pytest.raises(FileExistsError, match="holds no model"):
            export_hf(run_dir, holder, overwrite=True)
    assert sorted(p.name for p in (run_dir / "weights" / "main").iterdir()) == before
    assert not list(tmp_path.glob(".*.tmp-*")) and not list(run_dir.glob(".*.tmp-*"))


def test_sources_that_cannot_say_their_base_model(run, tmp_path):
    run_dir, base, _ = run
    bare = tmp_path / "crashed-run"  # config.yaml + weights, no summary.json: the tiny model's dir is unknown
    bare.mkdir()
    (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    WeightStore(str(bare / "weights")).publish("main", 0, _state(load_causal_lm(base)))
    with pytest.raises(FileNotFoundError, match=r"summary.json .* does not name it.*base_model="):
        export_hf(bare, tmp_path / "a")
    assert export_hf(bare, tmp_path / "a", base_model=base).is_dir()
    (bare / "summary.json").write_text(json.dumps({"policy_id": "main", "model_path": str(tmp_path / "gone")}))
    with pytest.raises(FileNotFoundError, match="is gone or has no config.json"):
        export_hf(bare, tmp_path / "b")
    with pytest.raises(ValueError, match="needs base_model="):
        export_hf("memory://export-no-base", tmp_path / "c")
    with pytest.raises(ValueError, match="not a run directory"):
        export_hf(bare / "weights", tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="nothing to export"):
        export_hf(tmp_path / "nowhere", tmp_path / "c")


def test_the_exported_directory_is_readable_by_others(exported):
    import os

    mask = os.umask(0o022)
    os.umask(mask)
    assert exported.stat().st_mode & 0o777 == 0o777 & ~mask  # 0755 under the usual umask, not mkdtemp's 0700


def test_a_resumed_run_exports_from_the_store_it_published_to(run, tmp_path):
    """`resume_from`, as astratk resumed runs before they had their own store: the new run dir has no weights, and
    the export reads the resumed run's store. (A resumed run now copies its checkpoint's version into its own.)"""
    run_dir, base, models = run
    resumed = tmp_path / "resumed-run"
    resumed.mkdir()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    (resumed / "config.yaml").write_text(yaml.safe_dump({**config, "resume_from": str(run_dir)}))
    (resumed / "summary.json").write_text(json.dumps({"policy_id": "main", "model_path": base}))
    out = export_hf(resumed, tmp_path / "out", version=1)
    assert json.loads((out / PROVENANCE).read_text())["store"] == str(run_dir / "weights")
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out)), _logits(models[1]))


def test_tied_weights_that_differ_are_refused(run, tmp_path):
    """lm_head and embed_tokens are one parameter in a tied model: an untied pair cannot be exported faithfully."""
    _, base, models = run
    state = _state(models[2])
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    url = f"memory://export-untied-{tmp_path.name}"
    WeightStore(url).publish("main", 0, state)
    with pytest.raises(ValueError, match="tied parameter"):
        export_hf(url, tmp_path / "out", base_model=base)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*.tmp-*"))  # nothing half written


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_export(run, tmp_path, capsys):
    run_dir, _, models = run
    out = tmp_path / "cli"
    assert main(["export", str(run_dir), str(out), "--policy", "main", "--version", "1"]) == 0
    assert str(out) in capsys.readouterr().out
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out)), _logits(models[1]))
    assert main(["export", str(run_dir), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(run_dir), str(out), "--overwrite"]) == 0
    assert json.loads((out / PROVENANCE).read_text())["version"] == 2
    assert main(["export", str(run_dir), str(tmp_path / "x"), "--version", "7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("astratk export: policy 'main' version 7 is not in") and "retained: 0-2" in err
    assert main(["export", "--help"]) == 0 and "--base_model" in capsys.readouterr().out
    assert main(["export"]) == 2  # usage error: argparse prints it; main returns instead of exiting
    assert main(["bogus"]) == 2 and "['deploy', 'export', 'probe', 'run', 'status', 'train']" in capsys.readouterr().err

"""The front door: every bad input is one line on stderr that names the file or the key, a non-zero exit, and nothing
written. docs/errors.md lists the cases, each with the test here that holds it.

Most tests call `astratk.cli.main` in-process with files in tmp_path; `no_set_up` makes reaching a run's set-up (the
`Session`) a failure, so a bad input that slips past the door fails fast instead of starting a run.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from astratk.cli import main
from astratk.config import parse

REPO = Path(__file__).parents[2]


def write(path: Path, data) -> str:
    path.write_bytes(data if isinstance(data, bytes) else yaml.safe_dump(data).encode())
    return str(path)


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI; it must exit non-zero with exactly one line on stderr and no traceback. Returns the line."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_set_up(monkeypatch):
    from astratk.runtime import session

    def refuse(*args, **kwargs):
        raise AssertionError("the run's set-up started: the bad input was not refused at the door")

    monkeypatch.setattr(session.Session, "__init__", refuse)


# ------------------------------------------------------------------------------------------------- YAML files

BAD_YAML = {
    "syntax": (b"name: a\nrollout:\n  group_size: [4\n",
               ["line 4, column 1", "expected ',' or ']'", "flow sequence at line 3, column 15"]),
    "not_utf8": (b"name: caf\xe9\n", ["line 1, column 10", "not UTF-8", "0xe9"]),
    "duplicate": (b"name: a\nrollout:\n  group_size: 4\n  temperature: 1.0\n  group_size: 2\n",
                  ["line 5", "duplicate key 'rollout.group_size'", "first given at line 3"]),
}
# every command that reads a run config
ENTRIES = {
    "run": lambda f: ["run", "--config", f],
    "print_config": lambda f: ["run", "--config", f, "--print_config"],
    "deploy": lambda f: ["deploy", "--config", f, "--name", "x", "--cluster.scheduler_address", "tcp://127.0.0.1:9"],
    "status": lambda f: ["status", "--scheduler", "tcp://127.0.0.1:9", "--config", f, "--timeout", "1"],
    "train_fit": lambda f: ["train", "fit", "--run_config", f, "--deployment", "d", "--scheduler", "tcp://127.0.0.1:9"],
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("case", list(BAD_YAML))
def test_a_bad_yaml_file_is_one_line_naming_the_file_and_line(tmp_path, capsys, monkeypatch, no_set_up, case, entry):
    monkeypatch.chdir(tmp_path)  # a run that got through would write under ./runs
    text, words = BAD_YAML[case]
    path = write(tmp_path / "bad.yaml", text)
    line = one_line_error(capsys, ENTRIES[entry](path))
    assert path in line and all(w in line for w in words), line
    assert not (tmp_path / "runs").exists()


def test_yaml_merge_keys_may_still_override(tmp_path):
    """Refusing duplicate keys leaves YAML's own override (`<<: *anchor`, then the key) alone."""
    from astratk.config import read_yaml

    p = write(tmp_path / "m.yaml", b"base: &b {group_size: 4, temperature: 1.0}\nrollout:\n  <<: *b\n  group_size: 2\n")
    assert read_yaml(p)["rollout"] == {"group_size": 2, "temperature": 1.0}


# ------------------------------------------------------------------------------------------------- output_dir

def _read_only_dir(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes through permission bits: /proc takes no new entries
        if not Path("/proc").is_dir():
            pytest.skip("no /proc, and root ignores permission bits")
        return Path("/proc")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    return d


@pytest.mark.parametrize(("where", "words"), [
    ("file", ["is a file, not a directory"]),
    ("under_a_file", ["is a file, not a directory", "a part of"]),
    ("read_only", ["cannot create a run directory in"]),
])
def test_an_output_dir_that_cannot_hold_runs_is_refused_before_anything_is_written(tmp_path, capsys, no_set_up,
                                                                                     where, words):
    (tmp_path / "afile").write_text("not a directory")
    output_dir = {"file": tmp_path / "afile", "under_a_file": tmp_path / "afile" / "runs",
                  "read_only": _read_only_dir(tmp_path) / "astratk-front-door-runs"}[where]
    cfg = write(tmp_path / "c.yaml", {"output_dir": str(output_dir)})
    line = one_line_error(capsys, ["run", "--config", cfg])
    assert line.startswith("astratk run: output_dir: ") and all(w in line for w in words), line
    if where == "read_only":  # the directory the user gave is named, not only its nearest existing part
        assert repr(str(output_dir)) in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "c.yaml"] + (["ro"] if (tmp_path / "ro").exists()
                                                                                 else [])


# ---------------------------------------------------------------------------------------------- model.path

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from astratk.models.tokenizer import build_char_tokenizer, save_char_tokenizer

    out = tmp_path_factory.mktemp("model")
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out))
    save_char_tokenizer(tok, out)
    return out


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bad_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes((10**9).to_bytes(8, "little") + data[8:])


DAMAGE = {
    "config_json": (lambda d: (d / "config.json").write_text('{"model_type": "qwen2",\n  "hidden_size": 64,\n'),
                    ["config.json is not valid JSON", "line 3"]),
    "truncated_safetensors": (lambda d: _truncate(d / "model.safetensors"),
                              ["model.safetensors is not a whole safetensors file", "truncated"]),
    "safetensors_header": (lambda d: _bad_header(d / "model.safetensors"),
                           ["model.safetensors is not a whole safetensors file", "header claims 1000000000 bytes"]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_broken_model_directory_is_refused_before_the_run_directory_exists(model_dir, tmp_path, capsys, no_set_up,
                                                                              damage):
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    do, words = DAMAGE[damage]
    do(broken)
    cfg = write(tmp_path / "c.yaml", {"output_dir": str(tmp_path / "runs"),
                                      "policies": [{"model": {"path": str(broken)}}]})
    line = one_line_error(capsys, ["run", "--config", cfg])
    assert line.startswith("astratk run: policies[0].model.path: ") and all(w in line for w in words), line
    assert not (tmp_path / "runs").exists()


def test_a_whole_model_directory_passes_the_check(model_dir):
    from astratk.models.hub import resolve

    assert resolve(str(model_dir)).directory == model_dir


# --------------------------------------------------------------------------------------------------- resume_from

def _old_run(tmp_path: Path, ckpt: bytes | None = None, config: bytes | None = None) -> Path:
    old = tmp_path / "old-run"
    (old / "checkpoints" / "main").mkdir(parents=True)
    if ckpt is not None:
        (old / "checkpoints" / "main" / "step=3.ckpt").write_bytes(ckpt)
    if config is not None:
        (old / "config.yaml").write_bytes(config)
    return old


def _zip_bytes(tmp_path: Path) -> bytes:
    """A file in torch.save's format (a zip archive): what the checkpoint check lets through."""
    p = tmp_path / "z.zip"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("archive/data.pkl", b"x")
    return p.read_bytes()


RESUME = {
    "missing": (lambda t: t / "no-such-run", ["resume_from: ", "does not exist"]),
    "not_a_checkpoint": (lambda t: Path(write(t / "notes.txt", b"hello")), ["is not a checkpoint of policy 'main'"]),
    "no_checkpoints": (lambda t: _old_run(t), ["no checkpoints in", "checkpoint_every"]),
    "garbage_checkpoint": (lambda t: _old_run(t, ckpt=b"garbage"), ["step=3.ckpt is not a trainer checkpoint"]),
    "garbage_config": (lambda t: _old_run(t, ckpt=_zip_bytes(t), config=b"weights: [1\n"),
                       ["config.yaml, line 2", "YAML syntax error"]),
    "no_snapshots": (lambda t: _old_run(t, ckpt=_zip_bytes(t)), ["no data-layer snapshots at"]),
}


@pytest.mark.parametrize("case", list(RESUME))
def test_a_resume_from_that_cannot_resume_is_refused_in_validation(tmp_path, capsys, no_set_up, case):
    make, words = RESUME[case]
    given = make(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    cfg = write(tmp_path / "c.yaml", {"output_dir": str(tmp_path / "runs"), "resume_from": str(given)})
    line = one_line_error(capsys, ["run", "--config", cfg])
    assert line.startswith("astratk run: resume_from: ") and all(w in line for w in words), line
    # nothing written: no run directory, no data-layer directory made in the old run
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == sorted([*before, Path("c.yaml")])


# ------------------------------------------------------------------------------------------------- train fit

def test_train_fit_with_an_unknown_policy_is_one_line(capsys):
    line = one_line_error(capsys, ["train", "fit", "--run_config", str(REPO / "tutorials" / "quickstart.yaml"),
                                   "--policy_id", "nope", "--deployment", "d", "--scheduler", "tcp://127.0.0.1:9"])
    assert "--policy_id" in line and "no policy 'nope'" in line and "['main']" in line, line


def test_train_fit_gives_up_on_an_unreachable_scheduler_after_startup_timeout_s(tmp_path, capsys):
    cfg = write(tmp_path / "c.yaml", {"cluster": {"startup_timeout_s": 2}})
    t = time.monotonic()
    line = one_line_error(capsys, ["train", "fit", "--run_config", cfg, "--deployment", "d",
                                   "--scheduler", "tcp://127.0.0.1:9"])
    assert time.monotonic() - t < 60  # the default is 120 s: this one honours the config's 2 s
    assert "tcp://127.0.0.1:9" in line and "retried for 2s" in line, line


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_fit_on_a_refused_address_fails_in_seconds_not_after_startup_timeout_s(tmp_path, capsys):
    """Nothing listening: refusals are retried for a few seconds (a scheduler that is just starting), then one line;
    the config's 120 s startup timeout is for an address that accepts but does not answer."""
    from astratk.runtime.cluster import REFUSED_GRACE_S

    cfg = write(tmp_path / "c.yaml", {"cluster": {"startup_timeout_s": 120}})
    address = f"tcp://127.0.0.1:{_closed_port()}"
    t = time.monotonic()
    line = one_line_error(capsys, ["train", "fit", "--run_config", cfg, "--deployment", "d", "--scheduler", address])
    assert REFUSED_GRACE_S <= time.monotonic() - t < REFUSED_GRACE_S + 20, time.monotonic() - t
    assert address in line and "nothing accepts connections" in line, line


def test_a_scheduler_that_starts_listening_within_the_grace_is_waited_for():
    """A refused address that starts listening a second later is accepted (job scripts start the scheduler beside
    the trainer); one that accepts passes at once."""
    import socket
    import threading

    from astratk.runtime.cluster import check_listening

    port = _closed_port()
    server = socket.socket()

    def listen_later() -> None:
        time.sleep(1.0)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    t = time.monotonic()
    check_listening(f"tcp://127.0.0.1:{port}", timeout_s=120, grace_s=10)
    assert 0.9 < time.monotonic() - t < 9
    check_listening(f"tls://127.0.0.1:{port}", timeout_s=120, grace_s=10)  # listening: at once
    server.close()
    check_listening("inproc://x", timeout_s=1)  # other transports are left to distributed


# ----------------------------------------------------------------------------------------------------- status

def test_status_on_a_tls_address_without_certificates_is_one_line(capsys, monkeypatch):
    from astratk.spec import cluster

    monkeypatch.setattr(cluster, "dask_config_has_tls", lambda: False)  # whatever this machine's Dask config says
    line = one_line_error(capsys, ["status", "--scheduler", "tls://127.0.0.1:9", "--timeout", "2"])
    assert "tls://127.0.0.1:9 is a TLS scheduler" in line and "--config" in line, line


# ------------------------------------------------------------------------------------------- numeric fields

NAN, INF = math.nan, math.inf
NUMBERS = [
    ("policies[0].trainer.max_time_s", -5.0), ("policies[0].trainer.max_time_s", 0.0),
    ("policies[0].trainer.lr", INF),
    ("policies[0].trainer.weight_decay", -0.1), ("policies[0].trainer.grad_clip", -1.0),
    ("policies[0].trainer.grad_clip", NAN), ("policies[0].trainer.horizon", 0),
    ("policies[0].trainer.batch_timeout_s", 0.0), ("policies[0].trainer.kl_coef", NAN),
    ("policies[0].trainer.entropy_coef", NAN),
    ("policies[0].model.tiny.num_heads", 0), ("policies[0].model.tiny.num_layers", 0),
    ("policies[0].model.tiny.num_kv_heads", 3), ("policies[0].model.tiny.max_positions", 16),
    ("policies[0].model.tiny.warm_start_steps", -1), ("policies[0].model.tiny.warm_start_lr", 0.0),
    ("policies[0].model.tiny.warm_start_target", 1.5),
    ("rollout.temperature", NAN), ("rollout.temperature", INF),
    ("cluster.startup_timeout_s", 0.0), ("cluster.startup_timeout_s", NAN),
    ("cluster.pools[0].slowdown", NAN), ("eval.timeout_s", -1.0), ("weights.link_latency_s", NAN),
]


def _set(spec, dotted: str, value) -> None:
    *parents, last = dotted.replace("[", ".").replace("]", "").split(".")
    obj = spec
    for part in parents:
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    setattr(obj, last, value)


@pytest.mark.parametrize(("key", "value"), NUMBERS, ids=[f"{k}={v}" for k, v in NUMBERS])
def test_a_numeric_field_out_of_range_is_refused_naming_it(key, value):
    from astratk.spec import RunSpec, WorkerClass

    spec = RunSpec()
    spec.cluster.pools = [WorkerClass()]
    _set(spec, key, value)
    with pytest.raises(ValueError) as e:
        spec.validate()
    owner, _, field = key.rpartition(".")
    message = str(e.value)
    assert message.startswith((f"{key} must", f"{key}: ", f"{owner}: ")) and field in message, message


def test_negative_max_time_s_from_the_cli(tmp_path, capsys, no_set_up):
    cfg = write(tmp_path / "c.yaml", {"output_dir": str(tmp_path / "runs"), "policies": [{"trainer": {"max_time_s": -5}}]})
    line = one_line_error(capsys, ["run", "--config", cfg])
    assert line == "astratk run: policies[0].trainer.max_time_s must be > 0 seconds or null (run max_steps), got -5.0"


@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".."])
def test_a_run_name_must_be_one_path_component(name):
    with pytest.raises(ValueError, match=r"^name: .* names the run directory"):
        parse(["--name", name])


def test_a_type_error_deep_in_a_plug_in_is_one_line(tmp_path):
    cfg = write(tmp_path / "c.yaml", {"policies": [{"loss": {"class_path": "drpo", "init_args": {"delta": "abc"}}}]})
    with pytest.raises(ValueError) as e:
        parse(["--config", cfg])
    assert str(e.value) == "bad configuration: policies.loss.delta: Expected a <class 'float'>. Got value: abc"


# ------------------------------------------------------------------------------------ the run directory itself

def test_a_failed_set_up_leaves_no_run_directory_and_closes_what_it_started(tmp_path, monkeypatch):
    """Set-up wrote into the run directory and started something, then failed: the directory goes, and so does the
    output_dir made for it; what set-up started is closed; an output_dir that already held runs keeps them."""
    from astratk.runtime import session
    from astratk.runtime.run import Run
    from astratk.spec import RunSpec

    closed = []

    def failing_build(self):
        (self.run_dir / "weights").mkdir()
        (self.run_dir / "weights" / "v0").write_text("half-written")
        self._on_exit(lambda: closed.append("cluster"))
        raise RuntimeError("cluster did not start")

    monkeypatch.setattr(session.Session, "_build_models", failing_build)
    for output_dir, kept in ((tmp_path / "new" / "runs", []), (tmp_path / "used", ["earlier-run"])):
        for name in kept:
            (output_dir / name).mkdir(parents=True)
        with pytest.raises(RuntimeError, match="cluster did not start"):
            Run(RunSpec(output_dir=str(output_dir)), printer=lambda s: None).start()
        assert closed.pop() == "cluster"
        if kept:
            assert sorted(p.name for p in output_dir.iterdir()) == kept
        else:
            assert not (tmp_path / "new").exists()


def test_a_run_that_fails_after_set_up_keeps_what_it_wrote(tmp_path, monkeypatch):
    from astratk.runtime import session
    from astratk.runtime.run import Run
    from astratk.spec import RunSpec

    monkeypatch.setattr(session.Session, "__enter__", lambda self: self)

    def failing_train(self):
        (self.run_dir / "steps.json").write_text("[]")
        raise RuntimeError("diverged")

    monkeypatch.setattr(session.Session, "train", failing_train)
    with pytest.raises(RuntimeError, match="diverged"):
        Run(RunSpec(output_dir=str(tmp_path / "runs")), printer=lambda s: None).start()
    [run_dir] = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "steps.json"]


# ------------------------------------------------------------------------------------------- as a user runs it

def test_the_installed_command_prints_one_line_and_no_traceback(tmp_path):
    bad = write(tmp_path / "bad.yaml", BAD_YAML["duplicate"][0])
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": "", "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": ""}
    for argv, words in ((["run", "--config", bad], [bad, "duplicate key 'rollout.group_size'"]),
                        (["status", "--scheduler", "tls://127.0.0.1:9"], ["is a TLS scheduler"])):
        r = subprocess.run([sys.executable, "-m", "astratk.cli", *argv], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env=env, check=False)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
        assert list(tmp_path.iterdir()) == [Path(bad)]

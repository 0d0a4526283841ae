"""CUDA-built torchvision & co. next to a CPU torch: detected from the packages' files, hidden from the
process with a warning naming the fix, and Lightning refuses to start with that fix in its error."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from astratk import _addons


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A site directory with torch 2.13.0+cpu and torchvision 0.28.0+cu130 (version files only), searched first."""
    for name, version in (("torch", "2.13.0+cpu"), ("torchvision", "0.28.0+cu130"), ("torchaudio", "2.11.1+cpu")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "version.py").write_text(f"__version__ = '{version}'\ngit_version = 'abc'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("torch", "torchvision", "torchaudio", "torchcodec"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # restored after the test
    monkeypatch.setattr(_addons, "_warned", [])
    monkeypatch.setattr(_addons, "_hidden", [])
    return tmp_path


def test_cuda_addon_next_to_cpu_torch_is_found_hidden_and_named(fake_site, monkeypatch):
    monkeypatch.setattr(_addons.importlib.metadata, "version", lambda name: {"torchcodec": "0.17.0"}.get(name) or (
        _ for _ in ()).throw(_addons.importlib.metadata.PackageNotFoundError(name)))
    assert _addons.mismatched_addons() == ["torchvision==0.28.0+cu130"]  # torchaudio is a CPU build, codec untagged
    with pytest.warns(RuntimeWarning, match="pip uninstall -y torchvision"):
        assert _addons.hide_mismatched_addons() == ["torchvision==0.28.0+cu130"]
    assert sys.modules["torchvision"] is None
    with pytest.raises(ImportError):
        import torchvision  # noqa: F401
    with pytest.raises(ImportError, match="Lightning cannot start.*pip uninstall -y torchvision"):
        _addons.lightning_pytorch()


def test_matching_builds_are_left_alone(fake_site):
    (fake_site / "torchvision" / "version.py").write_text("__version__ = '0.28.0+cpu'\n")
    assert _addons.mismatched_addons() == []
    (fake_site / "torch" / "version.py").write_text("__version__ = '2.13.0+cu130'\n")  # a CUDA torch: all fine
    (fake_site / "torchvision" / "version.py").write_text("__version__ = '0.28.0+cu130'\n")
    assert _addons.mismatched_addons() == []


PROBE = """
import sys
if sys.argv[1] == "astratk-first":
    import astratk
import importlib.util
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, intermediate_size=64)
print("logits", tuple(Qwen2ForCausalLM(config)(torch.tensor([[1, 2, 3]])).logits.shape))
if sys.argv[1] == "astratk-first":
    from astratk import _addons
    try:
        _addons.lightning_pytorch()
    except ImportError as e:
        print("lightning refused:", e)
    if importlib.util.find_spec("vllm") is not None:
        from astratk.engines._vllm_compat import import_vllm
        print("vllm", import_vllm().__version__)
"""


@pytest.mark.slow  # seconds: left out of the fast tier
def test_the_import_hook_rescues_transformers_from_a_broken_cuda_torchvision(tmp_path):
    """End to end in a fresh interpreter: a torchvision that fails to import the way a CUDA build on a CPU torch does
    (first on the path, with package metadata, as pip leaves it) breaks transformers' model classes unless astratk
    is imported first; then models load, vLLM (where installed) imports, and Lightning refuses naming the fix."""
    import torch

    if "+cpu" not in torch.__version__:
        pytest.skip(f"the trap needs a CPU torch build; this one is {torch.__version__}")
    site = tmp_path / "site"
    (site / "torchvision").mkdir(parents=True)
    (site / "torchvision" / "version.py").write_text("__version__ = '0.28.0+cu130'\n")
    (site / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    (site / "torchvision-0.28.0.dist-info").mkdir()
    (site / "torchvision-0.28.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    (site / "torchvision-0.28.0.dist-info" / "RECORD").write_text("")
    env = {**os.environ, "PYTHONPATH": str(site)}

    def probe(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", PROBE, mode], check=False, capture_output=True, text=True,
                              env=env, timeout=300)

    broken = probe("transformers-first")
    assert broken.returncode != 0 and "Qwen2ForCausalLM" in broken.stderr, broken.stderr[-2000:]
    rescued = probe("astratk-first")
    assert rescued.returncode == 0, rescued.stderr[-3000:]
    assert "logits (1, 3, 64)" in rescued.stdout
    assert "lightning refused:" in rescued.stdout and _addons.FIX in rescued.stdout
    assert "torchvision==0.28.0+cu130" in rescued.stderr  # the warning names the hidden build
    if importlib.util.find_spec("vllm") is not None:
        assert "vllm " in rescued.stdout

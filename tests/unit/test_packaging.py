"""Packaging stays truthful: every package folder is installed, conda pins match pip pins, import starts nothing."""

import re
import subprocess
import sys
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed():
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set()
    for prefix, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([prefix, *rel.parts])
            if not any(name.startswith(other + ".") or name == other for other in mapping if other != prefix
                       and other.startswith(prefix + ".")):
                found.add(name)
    assert found == listed


def _pins(requirements):
    out = {}
    for req in requirements:
        m = re.match(r"^([A-Za-z0-9_.\-\[\]]+?)\s*(?:\[[^\]]*\])?\s*([<>=!~].*)?$", req.strip())
        name = re.sub(r"\[.*\]", "", m.group(1)).lower().replace("_", "-")
        out[name] = (m.group(2) or "").replace(" ", "")
    return out


def test_environment_yml_matches_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str) and dep not in ("pip",) and not dep.startswith("python="):
            name, _, spec = re.match(r"^([A-Za-z0-9_.\-]+)(([<>=!].*)?)$", dep).group(1, 0, 2)
            conda[name.lower().replace("_", "-")] = spec.replace(" ", "")  # conda-forge: huggingface_hub
    pip = _pins(PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"])
    pip["pytorch"] = "==" + PYPROJECT["project"]["optional-dependencies"]["cpu"][0].split("==")[1]
    pip.pop("torch")
    pip["distributed"] = pip["dask"]
    for name, spec in pip.items():
        assert name in conda, f"environment.yml lacks {name}"
        want = spec.replace("==", "=") if spec.startswith("==") else spec
        assert conda[name] == want, f"{name}: environment.yml has {conda[name]!r}, pyproject {spec!r}"


def test_import_astratk_starts_nothing():
    code = "import sys, astratk; print(sorted(m for m in ('torch', 'dask', 'distributed', 'lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"

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


# what a pip extra of a base dependency installs, as the conda-forge packages environment.yml must list for it
CONDA_FOR_EXTRAS = {"jsonargparse[signatures]": ("docstring-parser", "typeshed-client"),
                    "math-verify[antlr4_13_2]": ("antlr4-python3-runtime",)}


def _environment():
    """(conda-forge dependencies: name -> version spec, pip section: normalised requirement strings)."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda, pip_section = {}, set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip_section |= {line.replace(" ", "") for line in dep.get("pip", [])}
        elif dep not in ("pip",) and not dep.startswith("python="):
            name, _, spec = re.match(r"^([A-Za-z0-9_.\-]+)(([<>=!].*)?)$", dep).group(1, 0, 2)
            conda[name.lower().replace("_", "-")] = spec.replace(" ", "")  # conda-forge: huggingface_hub
    return conda, pip_section


def test_environment_yml_matches_pyproject():
    conda, pip_section = _environment()
    requirements = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"]
    pip = _pins(requirements)
    pip["pytorch"] = "==" + PYPROJECT["project"]["optional-dependencies"]["cpu"][0].split("==")[1]
    pip.pop("torch")
    pip["distributed"] = pip["dask"]
    from_pip = {_pins([r]).popitem()[0] for r in requirements if r.replace(" ", "") in pip_section}
    for name, spec in pip.items():
        if name in from_pip:  # not on conda-forge: installed by the pip section, with pyproject's own requirement
            assert name not in conda, f"{name} is both a conda and a pip dependency in environment.yml"
            continue
        assert name in conda, f"environment.yml lacks {name} (add it, or the pyproject requirement to its pip section)"
        want = spec.replace("==", "=") if spec.startswith("==") else spec
        assert conda[name] == want, f"{name}: environment.yml has {conda[name]!r}, pyproject {spec!r}"
    assert "-e." in pip_section and "math-verify" in from_pip


def test_environment_yml_brings_what_the_pip_extras_bring():
    conda, _ = _environment()
    requirements = {re.match(r"^[A-Za-z0-9_.\-]+(\[[^\]]*\])?", r).group(0).lower(): r
                    for r in PYPROJECT["project"]["dependencies"]}
    for extra, packages in CONDA_FOR_EXTRAS.items():
        assert extra in requirements, f"pyproject no longer asks for {extra}: update CONDA_FOR_EXTRAS"
        for package in packages:
            assert package in conda, f"environment.yml lacks {package}, which pip's {extra} installs"
    assert conda["antlr4-python3-runtime"] == "=4.13.2"  # the runtime math-verify's antlr4_13_2 extra pins


def test_import_astratk_starts_nothing():
    code = "import sys, astratk; print(sorted(m for m in ('torch', 'dask', 'distributed', 'lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"

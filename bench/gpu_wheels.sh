#!/usr/bin/env bash
# Download into .whl/ the wheels that bench/gpu_suite.py needs on a GPU machine with torch, transformers, Lightning,
# peft and huggingface_hub but without Dask and without network (the nvidia-h200 image: Python 3.12, torch 2.11,
# transformers 5.17, Lightning 2.6.6), check their total stays well under what a run may carry, and print the
# command that installs them there and runs the suite.
#
#   bench/gpu_wheels.sh                    # the suite's set: Dask and what it needs beyond the image, ~4 MB
#   bench/gpu_wheels.sh --config           # + jsonargparse, for `astratk run` / `astratk train fit` there
#   bench/gpu_wheels.sh --check            # + install them into a scratch folder here and import each one from it
#
# The set is what the suite imports (its rows, a local Dask cluster of worker processes, the in-process trainer)
# less what the image has; the suite keeps off hvplot/holoviews/bokeh/panel (the runs skip the dashboards). Wheels
# are fetched for CPython 3.12 on x86-64 manylinux, one version each, without dependencies: each needed one is
# named here. Versions are the ones this project tests with (pyproject.toml pins dask and distributed).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.whl
LIMIT_MB=48  # of the 64 MiB a device run carries, with the working tree (~2 MB) beside it
PY=${PYTHON:-python3}

# Dask's local cluster: dask and distributed, and their needs that the image lacks (it has click, cloudpickle,
# fsspec, jinja2, msgpack, packaging, psutil, pyyaml, sortedcontainers, toolz, urllib3).
SUITE=(dask==2026.8.0 distributed==2026.8.0 partd==1.4.2 locket==1.0.0 tblib==3.2.2 tornado==6.6.1 zict==3.0.0)
# The run config's parser (astratk.config), for `astratk run` and trainer jobs; the suite builds its specs in code.
CONFIG=(jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0)

want=("${SUITE[@]}")
check=0
for arg in "$@"; do
  case "$arg" in
    --config) want+=("${CONFIG[@]}") ;;
    --check) check=1 ;;
    *) echo "usage: bench/gpu_wheels.sh [--config] [--check]" >&2; exit 2 ;;
  esac
done

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${want[@]}"

# one version of each: two stop the whole install there
dupes=$(ls "$DEST" | sed -E 's/-[0-9][^-]*-.*//' | tr 'A-Z_' 'a-z-' | sort | uniq -d)
if [ -n "$dupes" ]; then echo "two versions of: $dupes" >&2; exit 1; fi

total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "$(ls "$DEST" | wc -l) wheels in $DEST: $((total / 1024)) KiB (limit ${LIMIT_MB} MiB)"
ls -1 "$DEST"
if [ "$total" -gt $((LIMIT_MB * 1024 * 1024)) ]; then echo "too large for a device run" >&2; exit 1; fi

if [ "$check" = 1 ]; then
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$scratch" "$DEST"/*.whl
  # every wheel's top-level modules import from the scratch folder, not from this machine's site-packages
  PYTHONPATH="$scratch" "$PY" - "$scratch" <<'PY'
import importlib, pathlib, sys
scratch = pathlib.Path(sys.argv[1]).resolve()
def top(path: str) -> str:
    """The importable top-level name a RECORD path belongs to ("" for metadata, scripts and data)."""
    first = path.split("/")[0] if "/" in path else path.removesuffix(".py") if path.endswith(".py") else ""
    return first if first.isidentifier() else ""


tops = sorted({top(line.split(",")[0]) for record in scratch.glob("*.dist-info/RECORD")
               for line in record.read_text().splitlines()} - {""})
for name in tops:
    module = importlib.import_module(name)
    where = pathlib.Path(module.__file__).resolve()
    assert scratch in where.parents, f"{name} imported from {where}, not from the wheels"
print(f"imported from the wheels: {', '.join(tops)}")
PY
fi

cat <<EOF

On the GPU machine (device run: carry [".whl"]), from the repository root:
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py --out \$OUT/gpu_suite.json
EOF

#!/usr/bin/env bash
# One command for a CUDA machine that has torch preinstalled and no package registry:
# make tinytron importable without touching its dependencies, run the GPU tests and the GPU
# benchmarks, and write a short report. Sized for about 8 minutes.
#   bash scripts/gpu_check.sh            # report in benchmarks/results/gpu/ (or $OUT if set)
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-benchmarks/results/gpu}
mkdir -p "$DEST"
REPORT="$DEST/gpu_report.md"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

# Install without dependencies and without build isolation (which would need the network);
# if even that fails, lay out the package as a tree of links and put it on PYTHONPATH.
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$DEST/install.log" 2>&1; then
  LINKS=$(mktemp -d)
  python3 - "$LINKS" <<'PY'
import os, sys, tomllib
dest = sys.argv[1]
dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
os.makedirs(os.path.join(dest, "tinytron"))
for name in os.listdir("chapters"):
    if name.endswith(".py"):
        os.symlink(os.path.abspath(os.path.join("chapters", name)), os.path.join(dest, "tinytron", name))
for pkg, folder in dirs.items():
    if pkg != "tinytron":
        os.symlink(os.path.abspath(folder), os.path.join(dest, *pkg.split(".")))
PY
  export PYTHONPATH="$LINKS${PYTHONPATH:+:$PYTHONPATH}"
  echo "pip install failed (see install.log); using a link tree on PYTHONPATH" >>"$DEST/install.log"
fi

{
  echo "# tinytron GPU check — $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
  echo '```'
} >"$REPORT"

timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider tests >"$DEST/pytest_gpu.log" 2>&1
echo "pytest -m gpu: exit $? — $(tail -n 1 "$DEST/pytest_gpu.log")" >>"$REPORT"

# Benchmarks that take --device run once on cuda, each with its own time limit.
for bench in benchmarks/bench_*.py; do
  [ -e "$bench" ] || continue
  grep -q -- '"--device"' "$bench" || continue
  name=$(basename "$bench" .py)
  timeout 90 python3 "$bench" --device cuda >"$DEST/$name.log" 2>&1
  echo "$name --device cuda: exit $? — $(tail -n 1 "$DEST/$name.log")" >>"$REPORT"
done
cat "$REPORT"

#!/usr/bin/env bash
# Set up tinytron on a fresh machine with Python >= 3.11 and pip: torch, the package with its
# test and book extras, and (where the distro allows) Chromium for the browser test of the book.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# 1. torch >= 2.11. Keep one that is already there (a CUDA box brings its own build); otherwise
#    install 2.13.0 (on a CPU-only Linux box, a CPU wheel of it is much smaller than the CUDA one).
if ! "$PY" - <<'PYCHECK' 2>/dev/null; then
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) else 1)
PYCHECK
  "$PY" -m pip install -q torch==2.13.0
fi

# 2. the package (editable, so the chapters you edit are what runs) and its extras.
"$PY" -m pip install -q -e ".[dev]"

# 3. a real browser for the book's rendering test (skipped with a reason if none can be had).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: could not install chromium; the browser test will be skipped" >&2
fi
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"

"""Shared pytest set-up: the gpu marker skips without CUDA; helpers to find the book's pages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Appendix C's Triton kernels run under the interpreter without CUDA. Triton reads the
    # variable when its own modules are imported, so it is set before any test imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"


def chapter_pages() -> list[Path]:
    """Every book page: the non-private modules inside a chapter folder (each has a .ipynb twin)."""
    return sorted(p for p in CHAPTERS.glob("*/*.py") if not p.name.startswith("_"))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a set-up error reported elsewhere
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

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


def _skip_gpu_tests_without_cuda(items) -> None:
    """The gpu marker: skipped with a reason when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _run_pages_once(items) -> None:
    """Run each page's demos once per session: the strict book build executes every page too.

    When the build test is selected, running each page again as a script would double the
    longest part of the suite; the build fails on any failing demo (allow_errors: false) and
    names the page. Selecting pages alone (`-k 04_data`, `-m "not slow"`) still runs them.
    """
    build = any(item.nodeid.endswith("test_site.py::test_book_builds_strict_and_offline")
                for item in items)
    if not build:
        return
    skip = pytest.mark.skip(reason="executed by the strict book build in this session "
                                   "(tests/test_site.py)")
    for item in items:
        if getattr(item, "originalname", "") == "test_page_runs_as_a_script":
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected what they deselect
def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests_without_cuda(items)
    _run_pages_once(items)

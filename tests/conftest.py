"""Shared pytest set-up: the gpu marker, one intra-op thread, the book build started early, page helpers."""

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


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny tensors on a shared 2-core machine thrash with two.

    Modules of small single-process tests use it with `pytestmark = pytest.mark.usefixtures(
    "one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    The build and its browser pass start here, in the background (tests/test_site.py's
    `start_book_build`), and test_site.py's tests move to the end of the session: the rest of
    the suite leaves about one of two cores idle, and the build fills it.
    """
    build = [item for item in items
             if item.nodeid.endswith("test_site.py::test_book_builds_strict_and_offline")]
    if not build:
        return
    if not build[0].config.option.collectonly:
        _BUILDS.append(build[0].module)
        build[0].module.start_book_build()  # runs beside the tests until test_site.py needs it
    skip = pytest.mark.skip(reason="executed by the strict book build in this session "
                                   "(tests/test_site.py)")
    for item in items:
        if getattr(item, "originalname", "") == "test_page_runs_as_a_script":
            item.add_marker(skip)
    site = [item for item in items if item.module is build[0].module]
    items[:] = [item for item in items if item.module is not build[0].module] + site


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected what they deselect
def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests_without_cuda(items)
    _run_pages_once(items)


_BUILDS: list = []  # the module whose book build was started at collection


def pytest_sessionfinish(session, exitstatus):
    """A build still running when the session ends (-x, Ctrl-C, a failure) is stopped."""
    for module in _BUILDS:
        module.stop_book_build()

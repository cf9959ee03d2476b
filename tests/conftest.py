"""Shared pytest set-up: the gpu marker, one intra-op thread, the book build started early, page helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Appendix C's Triton kernels run under the interpreter without CUDA. Triton reads the
    # variable when its own modules are imported, so it is set before any test imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"

if "PYTEST_XDIST_WORKER" in os.environ:
    # Two workers and the book build share the cores (the README's `-n 2`): one intra-op thread
    # per worker, as each rank of a gloo world has, so no process spin-waits on its own threads.
    torch.set_num_threads(1)


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


# -- hermetic: no test reads or writes the repository's runs/ ---------------------------------
# A user runs the README's main job (it writes runs/tiny), then the tests. A test that resolves
# a config without its own checkpoint.save would resume, refuse or overwrite that run. Three
# nets, checked around every test: the trainer's run directory (`tinytron.train.output_dir`,
# wrapped once per session) must not resolve into runs/ even on a clean clone where runs/ does
# not exist; no file under runs/ may be opened or listed in this process (an audit hook); and
# runs/ must be unchanged after the test (what a torchrun subprocess writes).
RUNS = ROOT / "runs"
_TOUCHED: list[str] = []
_AUDITED = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.remove", "os.rename",
            "os.rmdir", "shutil.rmtree", "os.truncate", "os.utime"}


def touches_runs(path) -> bool:
    """Whether a path (a relative one against the working directory) lies in the repo's runs/."""
    if isinstance(path, int) or path is None:
        return False
    try:
        full = os.path.abspath(os.fsdecode(os.fspath(path)))
    except TypeError:
        return False
    return full == str(RUNS) or full.startswith(str(RUNS) + os.sep)


def _audit(event: str, args: tuple) -> None:
    if event in _AUDITED and args and touches_runs(args[0]):
        _TOUCHED.append(f"{event} {args[0]}")


def _guard_output_dir() -> None:
    import tinytron.train as train

    resolve = train.output_dir

    def output_dir(*args, **kwargs):
        path = resolve(*args, **kwargs)
        if touches_runs(path):
            _TOUCHED.append(f"tinytron.train.output_dir -> {path}")
        return path
    train.output_dir = output_dir


def _runs_snapshot() -> dict:
    if not RUNS.exists():
        return {}
    return {str(p.relative_to(RUNS)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in RUNS.rglob("*")}


def pytest_configure(config):
    """Under pytest-xdist (`-n 2 --dist loadfile`) hand out the test files in collection order.

    xdist's default hands out the files with the most tests first, which put test_site.py (moved
    to the end of the collection above, because it waits for the book build) in the middle: one
    worker then waited on the build for 15 minutes while the other ran the remaining files alone.
    """
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_sessionstart(session):
    _guard_output_dir()
    sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def _leaves_runs_alone():
    """Fails the test that resolved, opened or changed anything in the repository's runs/."""
    before = _runs_snapshot()
    del _TOUCHED[:]
    yield
    touched, _TOUCHED[:] = list(_TOUCHED), []
    changed = sorted(set(before.items()) ^ set(_runs_snapshot().items()))
    if touched or changed:
        pytest.fail("the test touched the repository's runs/ (give every trainer run its own "
                    f"checkpoint.save under tmp_path): {(touched + [c[0] for c in changed])[:5]}",
                    pytrace=False)


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected what they deselect
def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests_without_cuda(items)
    _run_pages_once(items)


_BUILDS: list = []  # the module whose book build was started at collection


def pytest_sessionfinish(session, exitstatus):
    """A build still running when the session ends (-x, Ctrl-C, a failure) is stopped."""
    for module in _BUILDS:
        module.stop_book_build(session_end=True)

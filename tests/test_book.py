"""The book: pages paired with notebooks, every demo runs, importing runs none, the site builds."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

jupytext = pytest.importorskip("jupytext")  # the book extra; absent on a bare GPU box

from tests.conftest import CHAPTERS, ROOT, chapter_pages

PAGES = chapter_pages()
PAGE_IDS = [str(p.relative_to(CHAPTERS)) for p in PAGES]


def _module_name(page) -> str:
    """Import name of a page, from pyproject's package-dir map (chapters/04_data -> tinytron.data)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folder = str(page.parent.relative_to(ROOT))
    package = next(pkg for pkg, path in package_dir.items() if path == folder)
    return f"{package}.{page.stem}"


def _cells(path):
    return [(c.cell_type, c.source.strip()) for c in jupytext.read(path).cells]


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_page_and_notebook_are_in_sync(page):
    notebook = page.with_suffix(".ipynb")
    assert notebook.exists(), f"{notebook} is missing: run `jupytext --to ipynb {page}`"
    assert _cells(page) == _cells(notebook), (
        f"{notebook} has drifted from {page}: run `jupytext --to ipynb {page}`")


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_page_runs_as_a_script(page, tmp_path):
    """Running the page runs all its demos; their asserts are the page's claims."""
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, str(page)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{page} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def test_importing_pages_runs_no_demo():
    if not PAGES:
        pytest.skip("no chapter pages yet")
    code = "\n".join(f"import {_module_name(p)}" for p in PAGES)
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stdout == "", f"importing the pages printed (a demo ran on import?):\n{proc.stdout[:2000]}"


def test_every_chapter_folder_is_a_package():
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        assert (ROOT / folder / "__init__.py").exists(), f"{folder} (for {package}) has no __init__.py"


def test_nav_follows_the_chapter_order(tmp_path):
    sys.path.insert(0, str(ROOT / "book"))
    try:
        import hooks
    finally:
        sys.path.pop(0)
    for name in ["model", "04_data", "00_overview", "parallel", "empty"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f'"""{name} title: more."""\n')
    for page in ["04_data/b.py", "04_data/a.py", "04_data/_private.py", "00_overview/x.py",
                 "parallel/grid.py", "model/gpt.py"]:
        (tmp_path / page).write_text("")
    (tmp_path / "04_data" / "__init__.py").write_text('"""04 data."""\n__pages__ = ["b"]\n')
    nav = hooks.build_nav(tmp_path)
    assert nav == [{"Home": "index.md"}, {"00_overview title": ["00_overview/x.py"]},
                   {"04 data": ["04_data/b.py", "04_data/a.py"]},
                   {"parallel title": ["parallel/grid.py"]}, {"model title": ["model/gpt.py"]}]
    (tmp_path / "04_data" / "__init__.py").write_text('__pages__ = ["missing"]\n')
    with pytest.raises(ValueError, match="missing"):
        hooks.build_nav(tmp_path)

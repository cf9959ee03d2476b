"""The book: pages paired with notebooks, every demo runs, importing runs none, pages are readable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")  # the book extra; absent on a bare GPU box

from tests.conftest import CHAPTERS, ROOT, chapter_pages

PAGES = chapter_pages()
PAGE_IDS = [str(p.relative_to(CHAPTERS)) for p in PAGES]

# The longest code cell a page may have: past ~60 lines a reader scrolls through a cell
# instead of reading it, so a long definition is split by method with prose between the parts.
MAX_CODE_CELL_LINES = 60


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


def _hooks():
    """book/hooks.py, imported by path (it is an mkdocs hook, not a package module)."""
    sys.path.insert(0, str(ROOT / "book"))
    try:
        import hooks
    finally:
        sys.path.pop(0)
    return hooks


def test_nav_follows_the_chapter_order(tmp_path):
    hooks = _hooks()
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


def test_the_build_executes_the_pages_and_no_private_module():
    """The pool executes each page the site shows once, and no `_*.py` or `__init__.py` module
    (mkdocs-jupyter's wrapper used to make those look included: 141 kernels for 85 pages)."""
    from mkdocs.config import load_config
    from mkdocs.structure.files import get_files

    hooks = _hooks()
    config = load_config(str(ROOT / "mkdocs.yml"))
    plugin = config["plugins"]["mkdocs-jupyter"]
    files = plugin.on_files(get_files(config), config)  # the order mkdocs runs them in
    executed = sorted(Path(p) for p in hooks.executed_pages(files, plugin))
    assert executed == chapter_pages()


def _check(page, check: str, problems: list[str]) -> None:
    """Fail on a page's problems with one readability check (every page passes every check)."""
    assert not problems, f"{page} ({check}): " + "; ".join(problems)


def _prose(page) -> str:
    """The text a reader reads: markdown cells of a page, or a whole markdown file."""
    if page.suffix == ".md":
        return page.read_text(encoding="utf-8")
    return "\n\n".join(c.source for c in jupytext.read(page).cells if c.cell_type == "markdown")


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_page_has_a_figure(page):
    """A mermaid diagram in the prose, or a matplotlib figure that a demo shows or saves."""
    cells = jupytext.read(page).cells
    diagram = any("```mermaid" in c.source for c in cells if c.cell_type == "markdown")
    plot = any(re.search(r"\bplt\.show\(\)|\.savefig\(", c.source) for c in cells if c.cell_type == "code")
    _check(page, "figure", [] if diagram or plot else ["no mermaid diagram and no plt.show()/savefig"])


def _unquoted_semicolons(block: str) -> list[str]:
    """Lines of a mermaid block with a ';' outside "quotes" (mermaid ends a statement there)."""
    return [line.strip() for line in block.splitlines()
            if ";" in re.sub(r'"[^"]*"', "", line)]


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_mermaid_lines_do_not_break_at_a_semicolon(page):
    """A ';' in a message or label splits the statement, and the whole diagram fails to render."""
    blocks = re.findall(r"```mermaid\n(.*?)```", _prose(page), re.S)
    bad = [line for block in blocks for line in _unquoted_semicolons(block)]
    assert not bad, f"{page}: mermaid lines with an unquoted ';' (use a comma): {bad}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_no_code_cell_is_too_long(page):
    cells = [c for c in jupytext.read(page).cells if c.cell_type == "code"]
    problems = [f"a code cell of {n} lines starting '{c.source.strip().splitlines()[0][:60]}'"
                for c in cells if (n := len(c.source.strip().splitlines())) > MAX_CODE_CELL_LINES]
    _check(page, "cell_length", [f"{p} (limit {MAX_CODE_CELL_LINES})" for p in problems])


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_code_cell_parses_on_its_own(page):
    """A notebook runs one cell at a time: a cell may not end inside a def, a class, a decorator."""
    for i, cell in enumerate(c for c in jupytext.read(page).cells if c.cell_type == "code"):
        try:
            compile(cell.source, f"{page.name}, code cell {i}", "exec")
        except SyntaxError as err:
            pytest.fail(f"{page}: code cell {i} does not parse alone ({err.msg}): "
                        f"...{cell.source.strip()[-80:]!r}")


_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _headings(page) -> set[str]:
    """The anchors of a page's headings, as the site builds them (Python-Markdown's slugify)."""
    from markdown.extensions.toc import slugify

    found = set()
    for line in _prose(page).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            text = re.sub(r"\[([^]]*)\]\([^)]*\)|`([^`]*)`", lambda g: g.group(1) or g.group(2), m.group(1))
            found.add(slugify(text, "-"))
    return found


def dead_links(page) -> list[str]:
    """Relative links of a page whose target is not a page (or file) of the book, or lacks the heading."""
    problems = []
    for href in _MD_LINK.findall(_prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:|#", href):
            continue  # another site, or a heading of the same page
        path, _, anchor = href.partition("#")
        target = (page.parent / path).resolve()
        twin = target.with_suffix(".py") if target.suffix == ".ipynb" else target
        if not target.is_file() or twin.name.startswith("_") or not twin.is_relative_to(CHAPTERS):
            problems.append(f"'{href}' is not a page of the book")
        elif anchor and anchor not in _headings(twin):
            problems.append(f"'{href}': {twin.name} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("page", [*PAGES, CHAPTERS / "index.md"], ids=[*PAGE_IDS, "index.md"])
def test_links_between_pages_resolve(page):
    """Every relative link reaches a page of the book and, when it names one, the heading."""
    assert not dead_links(page), f"{page}: {dead_links(page)}"


# "page B.3" or "appendix A" in plain text sends the reader looking; a link takes them there.
_PAGE_REFERENCE = re.compile(r"\bpages? [A-C]\.\d\b")


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_numbered_page_references_are_links(page):
    prose = re.sub(r"\[[^]]*\]\([^)]*\)", "", _prose(page))  # drop the links themselves
    _check(page, "page_refs", [f"plain-text reference '{m}'" for m in _PAGE_REFERENCE.findall(prose)])


# The book spells in American English, like the APIs it reads (optimizer, initialize, normalize).
_BRITISH = re.compile(r"\b(?:normalis|initialis|optimis|serialis|materialis|synchronis|recognis|summaris|"
                      r"utilis|minimis|maximis|amortis|tokenis|parallelis(?!m)|colour|behaviour|favour|neighbour|"
                      r"centre|modelling|labelled|travelled|cancelled|artefact|analyse)\w*|\bgrey\b", re.I)


# A class is whole in one cell: a definition continued in a later cell as `class X(X):` breaks
# "find the definition" and reads as a class that subclasses itself (DESIGN.md, style).
_CONTINUED_CLASS = re.compile(r"^class (\w+)\(\1\)", re.M)


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_no_class_is_continued_across_cells(page):
    continued = _CONTINUED_CLASS.findall(page.read_text(encoding="utf-8"))
    assert not continued, f"{page}: class continued in a later cell: {continued}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_one_spelling(page):
    comments = "\n".join(line for line in page.read_text(encoding="utf-8").splitlines()
                         if line.lstrip().startswith("#"))  # prose cells and code comments
    _check(page, "spelling", sorted({m.lower() for m in _BRITISH.findall(comments)}))


def test_megatron_citations_become_links():
    hooks = _hooks()
    cited = {"schedules.py": ["megatron/core/pipeline_parallel/schedules.py"],
             "utils.py": ["megatron/core/utils.py", "megatron/training/utils.py"]}
    html = ("<p><code>megatron/core/pipeline_parallel/schedules.py:251</code>, <code>:494-500</code> "
            "and <code>utils.py:12</code></p><p><code>:7</code> <code>schedules.py:634</code></p>"
            '<pre><span class="c1"># megatron/training/training.py:2162</span></pre>')
    out = hooks.link_citations(html, cited)
    base = "https://github.com/NVIDIA/Megatron-LM/blob/e03878b5f/"
    links = re.findall(r'<a href="([^"]+)">([^<]+)</a>', out)
    assert links == [(base + "megatron/core/pipeline_parallel/schedules.py#L251",
                      "megatron/core/pipeline_parallel/schedules.py:251"),
                     (base + "megatron/core/pipeline_parallel/schedules.py#L494-L500", ":494-500"),
                     (base + "megatron/core/pipeline_parallel/schedules.py#L634", "schedules.py:634"),
                     (base + "megatron/training/training.py#L2162", "megatron/training/training.py:2162")]
    # `utils.py` names two files; `:7` starts a paragraph with no citation before it: both stay text


def test_built_site_links_are_checked(tmp_path):
    hooks = _hooks()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "index.html").write_text('<h2 id="demo">Demo</h2>')
    (tmp_path / "a" / "index.html").write_text(
        '<a href="../b/">ok</a><a href="../b/#demo">ok</a><a href="../c/">dead</a>'
        '<a href="../b/#nope">dead anchor</a><a href="https://x.org/">remote</a><a href="#top">self</a>')
    problems = hooks.dead_links(tmp_path, tmp_path / "a" / "index.html")
    assert problems == ["links to '../c/', which is not in the site",
                        "links to '../b/#nope', which has no such heading"]


_FOLD_PAGE = '''# %% [markdown]
# # 09 · A page: `train_step` in a `<title>`

# %%
import math

__all__ = ["area"]

# %% [markdown]
# ## `area`, the one definition

# %%
def area(r):
    return math.pi * r * r

# %% tags=["hide-input"]
def plot_area(ax):
    ax.plot([area(r) for r in range(3)])

# %%
print(area(1.0))
'''


def test_rendered_page_folds_imports_and_keeps_code_in_the_toc(tmp_path):
    """The site folds the imports cell and hide-input cells; the TOC keeps headings' code text."""
    convert = pytest.importorskip("mkdocs_jupyter.convert")
    hooks = _hooks()
    page = tmp_path / "page.py"
    page.write_text(_FOLD_PAGE)
    html = convert.nb2html(str(page), execute=False, theme="light", no_prompt=True)
    out = hooks.fold_code_cells(html, hooks._code_cell_sources(page), "page.py")
    folds = re.findall(r'<details class="tt-folded"><summary>(.*?)</summary>(.*?)</details>', out, re.S)
    assert [label for label, _ in folds] == ["imports and <code>__all__</code>",
                                             "code: <code>plot_area</code>"]
    assert "math" in folds[0][1] and "plot_area" in folds[1][1]
    for _, body in folds:  # each fold holds one whole input area: its <div>s balance
        assert body.count("<div") == body.count("</div>") and body.lstrip().startswith("<div")
    assert "area</span><span" in out.split("</details>")[1]  # the definition cell stays open
    assert out.replace(folds[0][1], "").count("jp-CodeCell") == html.count("jp-CodeCell")
    toc = hooks.heading_toc_tokens(out)
    assert [(t["level"], t["name"]) for t in toc] == [(1, "09 · A page: train_step in a &lt;title&gt;")]
    assert [(t["name"], t["id"]) for t in toc[0]["children"]] == [
        ("area, the one definition", "area-the-one-definition")]
    assert f'id="{toc[0]["children"][0]["id"]}"' in out  # the TOC links to the page's own heading
    # a page whose source and rendering disagree on the cells is left as it is, with a warning
    assert hooks.fold_code_cells(html, hooks._code_cell_sources(page)[:2], "page.py") == html


def test_no_markdown_line_starts_with_a_plus():
    """A prose line starting "+ " (a formula wrapped before its plus) renders as a bullet."""
    found = []
    for page in [*PAGES, CHAPTERS / "index.md"]:
        fenced = False
        for line in _prose(page).splitlines():
            fenced ^= line.lstrip().startswith("```")
            if not fenced and re.match(r"\s*\+ ", line):
                found.append(f"{page.relative_to(ROOT)}: {line.strip()[:60]}")
    assert not found, found


def test_private_modules_are_published_and_linked():
    """Every `_*.py` module becomes a source page outside the nav, and a code span naming one
    (bare, by chapter path or by repository path) links to it; an unknown name stays text."""
    from mkdocs.config import load_config
    from mkdocs.structure.files import File, Files
    from mkdocs.structure.pages import Page

    hooks = _hooks()
    config = load_config(str(ROOT / "mkdocs.yml"))
    config.plugins._current_plugin = None  # mkdocs sets it while an event runs
    files = Files([File.generated(config, "01_main_loop/loop.md", content="# the page")])
    hooks._add_source_pages(files, config)
    modules = hooks.private_modules(CHAPTERS)
    assert len(modules) > 50 and CHAPTERS / "_fields.py" in modules
    for module in modules:
        uri = module.relative_to(CHAPTERS).with_suffix(".md").as_posix()
        published = files.get_file_from_path(uri)
        assert published is not None and published.inclusion.is_not_in_nav(), uri
        assert module.read_text(encoding="utf-8") in published.content_string, uri
    page = Page(None, files.get_file_from_path("01_main_loop/loop.md"), config)
    html = hooks.link_private_modules(
        "<p><code>_parts.py</code>, <code>chapters/01_main_loop/_parts.py</code>, "
        "<code>02_optimizer/_config.py</code>, <code>_no_such_module.py</code></p>", page, files)
    assert html.count('<a href="../_parts/"><code>') == 2
    assert '<a href="../../02_optimizer/_config/"><code>02_optimizer/_config.py</code></a>' in html
    assert "<code>_no_such_module.py</code>" in html and html.count("<a ") == 3


def test_every_page_has_one_number_and_a_short_title():
    """The sidebar numbers every page one way (07.3, A.2, C.0) with a title of at most ~40
    characters, and a page whose heading carries a number carries the same one."""
    hooks = _hooks()
    titles = hooks.page_titles(CHAPTERS)
    assert sorted(titles) == sorted(p.relative_to(CHAPTERS).as_posix() for p in PAGES)
    numbers = [number for number, _ in titles.values()]
    assert len(set(numbers)) == len(numbers), "two pages share a number"
    assert all(re.fullmatch(r"(?:0\d|[A-Z])\.\d+", n) for n in numbers), numbers
    long = [t for _, t in titles.values() if len(t) > 40]
    assert not long, f"sidebar titles over 40 characters: {long}"
    for page, (number, _) in titles.items():
        heading = hooks._heading(CHAPTERS / page)
        if m := re.match(r"(\d\d\.\d+|[A-Z]\.\d+) ·", heading):
            assert m.group(1) == number, f"{page} is headed {m.group(1)} and sits at {number}"


# A numbered link names the page it points to: "[07.10](07_memory/step_compute.py)" must be the page
# the nav numbers 07.10, so splitting or reordering a chapter cannot leave a stale number behind.
_NUMBERED_LINK = re.compile(r"\[(?:pages? |appendix )?((?:\d\d|[A-C])\.\d+)\b[^]]*\]\(([^)#\s]+\.py)(?:#[^)]*)?\)")


def test_numbered_links_name_the_page_they_point_to():
    numbers = {page: number for page, (number, _) in _hooks().page_titles(CHAPTERS).items()}
    wrong = []
    for source in [*PAGES, CHAPTERS / "index.md"]:
        for number, target in _NUMBERED_LINK.findall(_prose(source)):
            page = os.path.normpath(os.path.join(str(source.parent.relative_to(CHAPTERS)), target))
            if page in numbers and numbers[page] != number:
                wrong.append(f"{source.relative_to(CHAPTERS)}: [{number}]({target}) is page {numbers[page]}")
    assert not wrong, "numbered links that name another page's number:\n" + "\n".join(wrong)


def test_the_build_starts_the_longest_pages_first():
    """The pool's head start goes to pages that exist (a renamed page would silently lose it)."""
    hooks = _hooks()
    missing = [page for page in hooks.LONGEST_PAGES if not (CHAPTERS / page).exists()]
    assert not missing, f"LONGEST_PAGES names pages that do not exist: {missing}"
    order = hooks.longest_first([str(p) for p in PAGES])
    assert [str(Path(p).relative_to(CHAPTERS)) for p in order[:len(hooks.LONGEST_PAGES)]] == \
        hooks.LONGEST_PAGES
    assert sorted(order) == sorted(map(str, PAGES))

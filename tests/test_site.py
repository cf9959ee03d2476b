"""The rendered book: `mkdocs build --strict` executes every page, and a real browser renders it offline."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from html import unescape
from pathlib import Path

import pytest

from tests import site_workers
from tests.conftest import ROOT, chapter_pages

ARTIFACTS = ROOT / "test-artifacts"

# the strict build executes every page, and the browser pass loads every page: minutes each
# (a test may wait for both: allow it more than pytest's default 600 s)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

_RUN: dict = {}  # the session's one build and browser pass: its process and output directory
BUILD_LOG: dict[str, str] = {}  # the strict build's console output, for the tests that read it
BUILD_TIMEOUT_S = 1200
BROWSER_TIMEOUT_S = 1200  # counted once the build has ended; a loaded machine renders slower
PAGE_BYTES_MAX = 600_000  # the heaviest page, with its figures, was 0.39 MB besides the inline CSS


def start_book_build() -> None:
    """Start the strict build and its browser pass in the background, once per session.

    `python -m tests.site_workers OUT` runs `mkdocs build --strict` (which executes every page),
    then loads every built page in headless Chromium. tests/conftest.py calls this at collection
    when the build test is selected and moves this module's tests to the end of the session, so
    both run beside the rest of the suite. The build and its checks are unchanged; only when they
    run moves.

    Under pytest-xdist (the README's `-n 2`) every worker collects, and one build serves them
    all: the first worker to create the run's directory (named by xdist's id of the test run)
    starts it, and whichever worker runs this module reads it. The build watches the pytest
    controller and ends with it.
    """
    if _RUN:
        return
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        out, first, session = Path(tempfile.mkdtemp(prefix="tinytron-site-")), True, os.getpid()
    else:
        out, session = Path(tempfile.gettempdir()) / f"tinytron-site-{run_id}", os.getppid()
        try:
            out.mkdir()
            first = True
        except FileExistsError:
            first = False
    proc = None
    if first:
        with open(out / "driver.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "tests.site_workers", str(out),
                                     "--session", str(session)], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its kernels, their ranks, the browser
    _RUN.update(proc=proc, out=out)


def _driver_alive() -> bool:
    """Whether the build's driver still runs (started here, or by another xdist worker)."""
    if _RUN["proc"] is not None:
        return _RUN["proc"].poll() is None
    pid = _RUN["out"] / "driver.pid"
    if not pid.exists():
        return True  # just started: it writes its pid first
    try:
        os.kill(int(pid.read_text()), 0)
    except ProcessLookupError:
        return False
    return True


def stop_book_build(session_end: bool = False) -> None:
    """End a run still going and remove its output (at the end of the site tests, or of a
    session stopped early). At the end of an xdist worker's session the build may still serve
    another worker's site tests: it is left to them, and to its watch on the controller."""
    if not _RUN or (session_end and os.environ.get("PYTEST_XDIST_TESTRUNUID")):
        return
    if _driver_alive():
        pid = _RUN["proc"].pid if _RUN["proc"] is not None else \
            int((_RUN["out"] / "driver.pid").read_text())
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if _RUN["proc"] is not None:
            _RUN["proc"].wait()
    shutil.rmtree(_RUN["out"], ignore_errors=True)
    _RUN.clear()


def _wait_for(name: str, timeout_s: float) -> Path:
    """The run's file `name`, once written; fails naming what did not finish in time."""
    path = _RUN["out"] / name
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not _driver_alive() and not path.exists():  # it may have ended just after writing
            driver = (_RUN["out"] / "driver.log").read_text(errors="replace")
            pytest.fail(f"the site run ended without writing {name}:\n{driver[-5000:]}")
        if time.monotonic() > deadline:
            stop_book_build()
            pytest.fail(f"the site run did not write {name} within {timeout_s} s")
        time.sleep(0.5)
    return path


@pytest.fixture(scope="session")
def site_dir():
    """The book built once per session (started early by tests/conftest.py, or here)."""
    start_book_build()
    # the limit counts from here: a build started early has had a head start, not less time
    rc = int(_wait_for("build.rc", BUILD_TIMEOUT_S).read_text())
    text = (_RUN["out"] / "build.log").read_text(encoding="utf-8", errors="replace")
    if rc != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{text[-11000:]}")
    BUILD_LOG["text"] = text
    yield _RUN["out"] / "site"
    stop_book_build()


def test_book_builds_strict_and_offline(site_dir):
    assert (site_dir / "index.html").exists()
    for page in chapter_pages():
        html = site_dir / page.parent.name / page.stem / "index.html"
        assert html.exists(), f"{page} is not in the built book (missing from the nav?)"
        if "plt.show()" in page.read_text():
            # A page that draws must show its figure (an Agg backend in the kernel draws nothing).
            assert re.search(r'<img[^>]+src="data:image/png', html.read_text(encoding="utf-8")), (
                f"{page} calls plt.show() but its rendered page has no figure")
    for html in site_dir.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        # No page may load a script or a font from the network: readers may be offline.
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', text)
        remote += re.findall(r'import\("(https?://[^"]+)"\)', text)
        assert not remote, f"{html.relative_to(site_dir)} loads from the network: {remote[:3]}"


def test_build_log_is_quiet(site_dir):
    """No per-page kernel noise (every executed page used to log an unencrypted-TCP warning)."""
    log = BUILD_LOG["text"]
    assert "running over TCP without encryption" not in log, "the kernels run over TCP again"
    assert not re.findall(r"^WARNING", log, re.M)  # --strict fails on these; kept as a guard


def test_megatron_citations_link_to_the_pinned_commit(site_dir):
    """Every `megatron/...py:LINE` citation of the built book is a link to that line at e03878b5f."""
    unlinked, linked = [], 0
    for html in site_dir.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        unlinked += [(str(html.relative_to(site_dir)), m) for m in
                     re.findall(r"<code>(megatron/[\w./-]+\.py:\d[\d,-]*)</code>", text)]
        linked += len(re.findall(r'<a href="https://github\.com/NVIDIA/Megatron-LM/blob/e03878b5f/'
                                 r'megatron/[\w./-]+\.py#L\d+', text))
    assert not unlinked, f"citations left as plain text: {unlinked[:5]}"
    assert linked > 200, f"only {linked} citation links in the whole book"


@pytest.fixture(scope="session")
def served_site(site_dir):
    server, address = site_workers.serve(site_dir)
    yield address
    server.shutdown()


def _browser(url: str, *extra: str) -> str:
    if site_workers.chromium() is None:
        pytest.skip(site_workers.NO_CHROMIUM)
    return site_workers.browser(url, *extra)


@pytest.fixture(scope="session")
def rendered_pages(site_dir):
    """(address, source, DOM) of every page as headless Chromium renders it at 1280 px."""
    listed = json.loads(_wait_for("doms.json", BROWSER_TIMEOUT_S).read_text())
    if isinstance(listed, dict):
        pytest.skip(listed["skip"])
    sources = dict(site_workers.pages_to_check())
    assert [rel for rel, _ in listed] == list(sources), "the browser pass skipped pages"
    doms = _RUN["out"] / "doms"
    return [(rel, sources[rel], (doms / name).read_text(encoding="utf-8")) for rel, name in listed]


def test_browser_renders_diagrams_and_math(rendered_pages):
    """In headless Chromium every mermaid block becomes an SVG and the math is typeset."""
    checked_mermaid = checked_math = 0
    for rel, source, dom in rendered_pages:
        assert "</html>" in dom, f"Chromium returned no page for /{rel}"
        expected = source.count("```mermaid")
        rendered = re.findall(r'<div class="mermaid"[^>]*data-tt-svg="yes"[^>]*data-tt-error="no"', dom)
        assert len(rendered) == expected, (
            f"/{rel}: {len(rendered)} of {expected} mermaid diagrams rendered as SVG without error; "
            f"left unrendered: {re.findall(r'<pre class=.mermaid.>(.{0,80})', dom, re.S)[:2]}")
        checked_mermaid += expected
        if re.search(r"(?<![\\$])\$[^$\s][^$\n]*\$", source):
            assert "<mjx-container" in dom, f"/{rel}: has $math$ but nothing was typeset by MathJax"
            checked_math += 1
    assert checked_mermaid >= 1 and checked_math >= 1


def _glued_words(source: str) -> list[tuple[str, str]]:
    """(word before, word after) of every `<br/>` line break in a page's mermaid labels."""
    pairs = []
    for block in re.findall(r"```mermaid\n(.*?)```", source, re.S):
        for before, after in re.findall(r"([\w.+-]+)<br/>([\w.+-]+)", block):
            if before + after not in source.replace("<br/>", " "):
                pairs.append((before, after))
    return pairs


def test_mermaid_labels_keep_their_line_breaks(rendered_pages):
    """A label's `<br/>` breaks the line as drawn: no "bucketschapter 05" (nbconvert wrote the
    notebook pages' mermaid source unescaped, and the browser ate every `<br/>`)."""
    checked = 0
    for rel, source, dom in rendered_pages:
        labels = " | ".join(unescape(t) for t in re.findall(r'data-tt-labels="([^"]*)"', dom))
        for before, after in _glued_words(source):
            assert before + after not in labels, (
                f"/{rel}: the mermaid label '{before}<br/>{after}' renders as '{before}{after}'")
            checked += 1
    assert checked > 50, f"only {checked} mermaid line breaks checked"


def test_mermaid_diagrams_are_legible(rendered_pages):
    """No diagram squeezed into a strip: every one draws its labels at 9 px or more at 1280 px
    (00's pipeline and 01's loop, long chains laid left to right, were 59-67 px tall with 6 px
    text)."""
    for rel, _, dom in rendered_pages:
        for height, font in re.findall(r'data-tt-height="(\d+)"[^>]*?data-tt-font-px="([\d.]+)"', dom):
            assert float(font) >= 9, (
                f"/{rel}: a mermaid diagram drawn {height} px tall with {font} px labels")


def test_no_formula_is_split_into_a_bullet(site_dir):
    """Every list item of a rendered notebook page's prose starts like a list item of its source
    (a line starting "+ " in the middle of a formula became a bullet of its own)."""
    for page in chapter_pages():
        starts = {_first_words(item) for item in re.findall(
            r"^#\s*(?:[-*]|\d+[.)])\s+(.*)|<li>\s*(.*)", page.read_text(encoding="utf-8"), re.M)}
        html = (site_dir / page.parent.name / page.stem / "index.html").read_text(encoding="utf-8")
        for cell in re.split(r'<div class="jp-Cell ', html):
            if not cell.startswith("jp-MarkdownCell"):
                continue
            for item in re.findall(r"<li>(.*?)(?=<li>|</li>|<ul|<ol)", cell, re.S):
                words = _first_words(unescape(re.sub(r"<[^>]+>", "", item)))
                assert words in starts, f"{page}: a list item that is no list item in the source: {item[:80]!r}"


def _first_words(item) -> str:
    """The first two words of a list item, markup, links and math delimiters aside."""
    text = " ".join(item) if isinstance(item, tuple) else item
    text = re.sub(r"\]\([^)]*\)", "", text)
    return " ".join(re.findall(r"[A-Za-z0-9]+", text)[:2])


def test_pages_are_light_and_linked_in_order(site_dir):
    """Each page weighs under PAGE_BYTES_MAX (the JupyterLab styles are one shared stylesheet,
    not 590 KB inline on every notebook page), loads mermaid and MathJax only when it has a
    diagram or math, keeps no MathJax 2 leftovers, and links its previous and next page."""
    from book.site_weight import page_weights

    weights = page_weights(site_dir)
    heavy = {rel: size for rel, size in weights.items() if size > PAGE_BYTES_MAX}
    assert not heavy, f"pages over {PAGE_BYTES_MAX} bytes of HTML: {sorted(heavy.items())[:5]}"
    in_nav = [""] + [f"{p.parent.name}/{p.stem}/" for p in chapter_pages()]
    sheets, no_next = set(), []
    for rel in weights:
        html = (site_dir / rel / "index.html").read_text(encoding="utf-8")
        body = re.sub(r"<script\b.*?</script>", "", html[html.find("<body"):], flags=re.S)
        if "mermaid.min.js" in html:
            assert 'class="mermaid"' in body, f"/{rel} loads mermaid and has no diagram"
        assert '<script src="">' not in html and "text/x-mathjax-config" not in html, rel
        assert not re.search(r"<style[^>]*>[^<]{20000}", html), f"/{rel} inlines a large stylesheet"
        sheets.update(re.findall(r'href="[./]*(assets/stylesheets/notebook\.\w+\.css)"', html))
        if rel in in_nav:
            links = set(re.findall(r'md-footer__link--(prev|next)', html))
            assert ("prev" in links) == (rel != ""), f"/{rel}: footer links {links}"
            no_next += [rel] if "next" not in links else []
    assert len(no_next) == 1, f"pages without a link to the next page: {no_next[:5]}"
    assert len(sheets) == 1, f"notebook pages link {len(sheets)} shared stylesheets: {sheets}"


def test_the_search_index_holds_the_prose_and_not_the_code_cells(site_dir):
    """The index the theme loads on a first visit: the prose of every page (a phrase of 01's
    loop page is found), no code cell's body (a line that appears only in code is not)."""
    index = site_dir / "search" / "search_index.json"
    text = index.read_text(encoding="utf-8")
    assert index.stat().st_size < 2_000_000, f"the search index weighs {index.stat().st_size} B"
    prose, code = "finalize_model_grads" in text, "def train_at_a_glance(" in text
    assert prose and not code, f"prose found: {prose}; a code cell's body found: {code}"


def test_private_modules_are_readable_on_the_site(site_dir):
    """Each `_*.py` module has a source page, and a page that names `_parts.py` links to it."""
    for module in [*ROOT.glob("chapters/_*.py"), *ROOT.glob("chapters/*/_*.py")]:
        if module.name.startswith("__"):
            continue
        rel = module.relative_to(ROOT / "chapters").with_suffix("")
        shown = unescape(re.sub(r"<[^>]+>", "", (site_dir / rel / "index.html").read_text(encoding="utf-8")))
        last = [line for line in module.read_text(encoding="utf-8").splitlines() if line.strip()][-1]
        assert last in shown, f"{rel}: its source page lacks its last line"
    loop = (site_dir / "01_main_loop" / "loop" / "index.html").read_text(encoding="utf-8")
    assert '<a href="../_parts/"><code>' in loop, "01/loop names _parts.py without a link"


def test_titles_keep_the_text_of_code_spans(site_dir):
    """Nav entries and browser tabs read "the .bin / .idx indexed dataset", not "the / indexed"."""
    html = (site_dir / "04_data" / "indexed" / "index.html").read_text(encoding="utf-8")
    title = re.search(r"<title>(.*?)</title>", html, re.S).group(1)
    assert ".bin / .idx" in title, title
    assert re.search(r'md-nav__link[^>]*>\s*(?:<[^>]+>\s*)*04\.1 The .bin / .idx', html), (
        "the nav entry of the indexed-dataset page lost its code text or its number")


def _code_fits(rel: str, dom: str) -> bool:
    """No code block of a rendered page scrolls, and a 110-character line fits without wrapping."""
    assert "</html>" in dom, f"Chromium returned no page for /{rel}"
    clipped = re.search(r'data-tt-clipped="([^"]*)"', dom)
    assert clipped and clipped.group(1) == "0", (
        f"/{rel}: code blocks cut off at 1280 px (content > box, first one): "
        f"{clipped.group(1) if clipped else 'not measured'}")
    line = re.search(r'data-tt-line110="(\d+)/(\d+)"', dom)
    if line is None:
        return False  # a page without code cells
    need, room = int(line.group(1)), int(line.group(2))
    assert need <= room, f"/{rel}: a 110-character code line needs {need} px, the column has {room}"
    return True


def test_prose_lines_are_at_most_100_characters(rendered_pages):
    """At 1280 px no paragraph is wider than a 100-character line of prose (it was ~130; 183 at
    1920 px): the measure stays readable at any window width."""
    measured = 0
    for rel, _, dom in rendered_pages:
        if m := re.search(r'data-tt-prose="(\d+)/(\d+)"', dom):
            assert int(m.group(1)) <= int(m.group(2)), (
                f"/{rel}: a paragraph {m.group(1)} px wide, 100 characters take {m.group(2)} px")
            measured += 1
    assert measured >= len(chapter_pages()) // 2, f"only {measured} pages had prose measured"


def test_code_scrolls_instead_of_wrapping_on_a_phone(rendered_pages):
    """On a 412 px screen a code cell keeps Python's indentation: it scrolls, it does not wrap."""
    dom = (_RUN["out"] / "doms" / "phone.html").read_text(encoding="utf-8")
    ws = re.search(r'data-tt-pre-ws="([^"]*)"', dom)
    assert ws and ws.group(1) == "pre", f"code cells on a phone: white-space {ws and ws.group(1)}"


def test_code_lines_are_not_cut_off_at_1280_px(rendered_pages):
    """At a 1280 px window no code block hides text behind a scroll bar (folded cells opened),
    and a 110-character line (the book's long lines) shows on one line."""
    checked = sum(_code_fits(rel, dom) for rel, _, dom in rendered_pages)
    assert checked >= len(chapter_pages()) // 2, f"only {checked} pages had code cells measured"


def _toc(html: str) -> list[tuple[str, str]]:
    """(href, text) of each entry of a built page's table of contents (the nav's in-page links)."""
    return [(href, " ".join(unescape(re.sub(r"<[^>]+>", "", text)).split()))
            for href, text in re.findall(r'<a href="(#[^"]*)" class="md-nav__link">(.*?)</a>', html, re.S)]


def test_tables_of_contents_keep_the_text_of_code_spans(site_dir):
    """01's TOCs read "train_step, in Megatron's exact order", not ", in Megatron's exact
    order", and on every page each TOC entry links to a heading the page has."""
    for page, headings in (("loop", ["train_step, in Megatron's exact order"]),
                           ("run", ["train: the iteration loop", "pretrain: everything set up once"])):
        html = (site_dir / "01_main_loop" / page / "index.html").read_text(encoding="utf-8")
        names = [text for _, text in _toc(html)]
        for name in headings:
            assert name in names, names
        assert not [n for n in names if re.match(r"[,:]", n)], f"headings that lost their code: {names}"
    for html in site_dir.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        if 'data-md-component="toc"' not in text:
            continue
        dead = [href for href, _ in _toc(text) if f'id="{href[1:]}"' not in text]
        assert not dead, f"{html.relative_to(site_dir)}: TOC entries with no heading: {dead[:3]}"


def test_front_page_flowchart_is_legible(rendered_pages):
    """At a common laptop width the iteration flowchart's labels render at 12 px or more."""
    rel, _, dom = rendered_pages[0]
    assert rel == "", "the browser pass starts at the front page"
    sizes = [float(x) for x in re.findall(r'data-tt-font-px="([\d.]+)"', dom)]
    assert sizes, "the front page's flowchart did not render"
    assert min(sizes) >= 12.0, f"flowchart labels render at {min(sizes)} px: too small to read"


def test_front_page_screenshot(served_site):
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "front-page.png"
    shot.unlink(missing_ok=True)
    _browser(f"{served_site}/", f"--screenshot={shot}", "--window-size=1280,2000")
    assert shot.exists() and shot.stat().st_size > 20_000, "no screenshot of the front page"


def test_a_failing_demo_fails_the_parallel_build(tmp_path):
    """Pages execute in a pool (book/hooks.py); a page whose demo raises still fails the build."""
    docs = tmp_path / "docs" / "00_overview"
    docs.mkdir(parents=True)
    (tmp_path / "docs" / "index.md").write_text("# mini\n")
    (docs / "__init__.py").write_text('__pages__ = ["good", "bad"]\n')
    (docs / "good.py").write_text("# %% [markdown]\n# # Good\n\n# %%\nprint(1 + 1)\n")
    (docs / "bad.py").write_text('# %% [markdown]\n# # Bad\n\n# %%\nraise ValueError("the demo broke")\n')
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: mini\ndocs_dir: docs\nstrict: true\nexclude_docs: |\n  __init__.py\n"
        f"hooks:\n  - {ROOT / 'book' / 'hooks.py'}\nplugins:\n  - mkdocs-jupyter:\n"
        '      include: ["*/*.py"]\n      execute: true\n      allow_errors: false\n'
        "      kernel_name: python3\n")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                           str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert proc.returncode != 0 and "the demo broke" in proc.stdout + proc.stderr
    assert "00_overview/bad.py" in proc.stdout + proc.stderr

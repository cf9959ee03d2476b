"""The rendered book: `mkdocs build --strict` executes every page, and a real browser renders it offline."""

from __future__ import annotations

import concurrent.futures
import functools
import http.server
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from html import unescape
from pathlib import Path

import pytest

from tests.conftest import ROOT, chapter_pages

ARTIFACTS = ROOT / "test-artifacts"

# the strict build executes every page, and the browser pass loads every page: minutes each
# (the build executes every page: allow it more than pytest's default 600 s per test)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# Injected by the test server only: material renders each mermaid diagram into a *closed*
# shadow root, invisible to --dump-dom. The probe opens those roots and copies what they hold
# into attributes, so the test reads the browser's own rendering.
PROBE = b"""<script>(function () {
  var attach = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) {
    return attach.call(this, Object.assign({}, init, {mode: "open"}));
  };
  setInterval(function () {
    document.querySelectorAll("div.mermaid").forEach(function (d) {
      var root = d.shadowRoot;
      if (!root) return;
      var svg = root.querySelector("svg");
      d.setAttribute("data-tt-svg", svg ? "yes" : "no");
      d.setAttribute("data-tt-error", /Syntax error|Parse error/.test(root.textContent) ? "yes" : "no");
      var label = svg && root.querySelector(".nodeLabel, .label, text");
      if (label && svg.viewBox.baseVal.width) {  // the label's font size as drawn on screen
        var scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
        d.setAttribute("data-tt-font-px", (parseFloat(getComputedStyle(label).fontSize) * scale).toFixed(1));
      }
    });
    // Code blocks at the window's width: every folded cell opened, each <pre> that scrolls
    // (its content wider than its box) counted, and the width a 110-character line needs in
    // the first code cell's font against the width its box leaves for text.
    document.querySelectorAll("details.tt-folded").forEach(function (d) { d.open = true; });
    var clipped = [];
    document.querySelectorAll(".md-content pre, .md-content pre > code").forEach(function (p) {
      if (p.clientWidth && p.scrollWidth > p.clientWidth + 1)
        clipped.push(p.scrollWidth + ">" + p.clientWidth + ":" + p.textContent.trim().slice(0, 40));
    });
    document.body.setAttribute("data-tt-clipped", clipped.length + (clipped.length ? " " + clipped[0] : ""));
    var pre = document.querySelector(".jupyter-wrapper .highlight-ipynb pre");
    if (pre && pre.clientWidth) {
      var probe = document.createElement("span");
      probe.textContent = "x".repeat(110);
      pre.appendChild(probe);
      var need = probe.getBoundingClientRect().width, style = getComputedStyle(pre);
      pre.removeChild(probe);
      var room = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      document.body.setAttribute("data-tt-line110", need.toFixed(0) + "/" + room.toFixed(0));
    }
  }, 100);
})();</script>"""


BUILD_LOG: dict[str, str] = {}  # the strict build's console output, for the tests that read it
_BUILD: dict = {}  # the session's one build: its process, console file and output directory
BUILD_TIMEOUT_S = 1200


def start_book_build() -> None:
    """Start `mkdocs build --strict` in the background, once per session (this executes every page).

    tests/conftest.py calls it at collection when the build test is selected, so the build runs
    beside the tests before this module: the rest of the suite keeps about one of two cores
    busy (one pytest process, single-process tests), and the build's kernels use what is idle.
    The build and its checks are unchanged; only its start moves.
    """
    if _BUILD:
        return
    out = Path(tempfile.mkdtemp(prefix="tinytron-site-"))
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    # The kernels must use Jupyter's inline backend: with MPLBACKEND=Agg, plt.show() draws
    # nothing and the book would lose every figure.
    env.pop("MPLBACKEND", None)
    console = tempfile.TemporaryFile(mode="w+", encoding="utf-8")  # no pipe to fill while tests run
    proc = subprocess.Popen([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                            cwd=ROOT, env=env, stdout=console, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its kernels and their ranks: one group
    _BUILD.update(proc=proc, console=console, out=out)


def stop_book_build() -> None:
    """End a build still running (the session stopped early) and remove its output."""
    proc = _BUILD.get("proc")
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if _BUILD:
        _BUILD["console"].close()
        shutil.rmtree(_BUILD["out"], ignore_errors=True)
    _BUILD.clear()


@pytest.fixture(scope="session")
def site_dir():
    """The book built once per session (started early by tests/conftest.py, or here)."""
    start_book_build()
    proc, console = _BUILD["proc"], _BUILD["console"]
    try:  # the limit counts from here: a build started early has had a head start, not less time
        proc.wait(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_book_build()
        pytest.fail(f"mkdocs build --strict did not finish within {BUILD_TIMEOUT_S} s")
    console.seek(0)
    text = console.read()
    if proc.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{text[-11000:]}")
    BUILD_LOG["text"] = text
    yield _BUILD["out"]
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


class _ProbeHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            path = os.path.join(path, "index.html")
        if not path.endswith(".html"):
            return super().do_GET()
        try:
            data = Path(path).read_bytes().replace(b"<head>", b"<head>" + PROBE, 1)
        except OSError:
            return self.send_error(404)
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def served_site(site_dir):
    handler = functools.partial(_ProbeHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium found: install it with `apt-get install chromium` (scripts/setup.sh does)")


def _browser(url: str, *extra: str) -> str:
    user_dir = tempfile.mkdtemp(prefix="tinytron-chromium-")
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={user_dir}", "--virtual-time-budget=15000",
           *extra, url]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(user_dir, ignore_errors=True)
    return proc.stdout


def _pages_to_check(site_dir):
    yield "", site_dir / "index.html", (ROOT / "chapters" / "index.md").read_text()
    for page in chapter_pages():
        yield f"{page.parent.name}/{page.stem}/", None, page.read_text()


@pytest.fixture(scope="session")
def rendered_pages(site_dir, served_site):
    """(address, source, DOM) of every page as headless Chromium renders it at 1280 px."""
    pages = list(_pages_to_check(site_dir))
    # one headless Chromium per page, two at a time: the pass is bound by browser start-ups
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        doms = list(pool.map(lambda page: _browser(f"{served_site}/{page[0]}", "--dump-dom",
                                                   "--window-size=1280,2000"), pages))
    return [(rel, source, dom) for (rel, _, source), dom in zip(pages, doms)]


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


def test_titles_keep_the_text_of_code_spans(site_dir):
    """Nav entries and browser tabs read "the .bin / .idx indexed dataset", not "the / indexed"."""
    html = (site_dir / "04_data" / "indexed" / "index.html").read_text(encoding="utf-8")
    title = re.search(r"<title>(.*?)</title>", html, re.S).group(1)
    assert ".bin / .idx" in title, title
    assert re.search(r'md-nav__link[^>]*>\s*(?:<[^>]+>\s*)*04 · Data: the .bin / .idx', html), (
        "the nav entry of the indexed-dataset page lost its code text")


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
    """01/loop's TOC reads "train_step, in Megatron's exact order", not ", in Megatron's exact
    order", and on every page each TOC entry links to a heading the page has."""
    loop = (site_dir / "01_main_loop" / "loop" / "index.html").read_text(encoding="utf-8")
    names = [text for _, text in _toc(loop)]
    for name in ["train_step, in Megatron's exact order", "train: the iteration loop",
                 "pretrain: everything set up once"]:
        assert name in names, names
    assert not [n for n in names if re.match(r"[,:]", n)], f"headings that lost their code: {names}"
    for html in site_dir.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        if 'data-md-component="toc"' not in text:
            continue
        dead = [href for href, _ in _toc(text) if f'id="{href[1:]}"' not in text]
        assert not dead, f"{html.relative_to(site_dir)}: TOC entries with no heading: {dead[:3]}"


def test_front_page_flowchart_is_legible(served_site):
    """At a common laptop width the iteration flowchart's labels render at 12 px or more."""
    dom = _browser(f"{served_site}/", "--dump-dom", "--window-size=1280,2000")
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

"""Subprocess entry point of the site tests: the strict book build, then its browser pass.

    python -m tests.site_workers OUT [--session PID]

runs `mkdocs build --strict` into OUT/site (its console in OUT/build.log, its exit status in
OUT/build.rc, written once the build has ended), then loads every page of the built site in one
headless Chromium at 1280 px (and one at a phone's 412 px, OUT/doms/phone.html) and keeps each
page's DOM under OUT/doms/, listed in OUT/doms.json
(written last: a list of [address, DOM file], or {"skip": reason} when no Chromium is found).

With `--session PID` it watches the pytest process PID and, once that has ended, removes OUT
and stops itself with everything it started: a session stopped early (-x, Ctrl-C, a crash)
leaves no build behind, however its workers ended.

tests/conftest.py starts this at collection and tests/test_site.py reads what it leaves, at the
end of the suite. Both halves run beside the other tests: the build's kernels and the browser
fill the cores between the tests. The pages load one at a time in one browser: a Chromium
started for each page kept both cores busy for about 2 s a page (107 pages: 223 s on an idle
two-core machine, against 84 s in one browser), and three at once took longer still.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.conftest import ROOT, chapter_pages

# Injected by the test server only: material renders each mermaid diagram into a *closed*
# shadow root, invisible to --dump-dom. The probe opens those roots and copies what they hold
# into attributes, so the test reads the browser's own rendering. It measures every 500 ms of
# the page's virtual time: each pass lays the page out again, and at every 100 ms a load took
# 2.6 s instead of 2.0 s. The last pass before the 15 s budget ends is what the DOM keeps.
PROBE = rb"""<script>(function () {
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
      if (svg) {  // each label's text, a line break as a newline; the diagram's drawn height
        var texts = [];
        root.querySelectorAll(".nodeLabel, .edgeLabel, text").forEach(function (l) {
          texts.push(l.innerHTML.replace(/<br\s*\/?>|<\/tspan>/gi, "\n").replace(/<[^>]+>/g, ""));
        });
        d.setAttribute("data-tt-labels", texts.join(" | "));
        d.setAttribute("data-tt-height", svg.getBoundingClientRect().height.toFixed(0));
      }
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
    // Prose measure: the widest paragraph against a 100-character line of prose in its font.
    var widest = null;
    document.querySelectorAll(".md-content .md-typeset p").forEach(function (p) {
      if (p.textContent.length > 120 && (!widest || p.clientWidth > widest.clientWidth)) widest = p;
    });
    if (widest) {
      var line = document.createElement("span");
      line.textContent = "the bucket holds every grad of the layer, and the last one to arrive starts its reduce-scatter early";
      line.style.whiteSpace = "nowrap";
      widest.appendChild(line);
      var hundred = line.getBoundingClientRect().width;
      widest.removeChild(line);
      document.body.setAttribute("data-tt-prose", widest.clientWidth + "/" + hundred.toFixed(0));
    }
    var pre = document.querySelector(".jupyter-wrapper .highlight-ipynb pre");
    if (pre) document.body.setAttribute("data-tt-pre-ws", getComputedStyle(pre).whiteSpace);
    if (pre && pre.clientWidth) {
      var probe = document.createElement("span");
      probe.textContent = "x".repeat(110);
      pre.appendChild(probe);
      var need = probe.getBoundingClientRect().width, style = getComputedStyle(pre);
      pre.removeChild(probe);
      var room = pre.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      document.body.setAttribute("data-tt-line110", need.toFixed(0) + "/" + room.toFixed(0));
    }
  }, 500);
})();</script>"""

PHONE_PAGE = "01_main_loop/loop/"  # rendered once more at 412 px (tests/test_site.py)

NO_CHROMIUM = "no Chromium found: install it with `apt-get install chromium` (scripts/setup.sh does)"


class ProbeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the built site, each HTML page with PROBE at the top of its <head>; the browser
    pass's page (PASS_PAGE) and, by POST to DOM_POST + i, each DOM it sends back."""

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path == PASS_PAGE:
            return self._send(self.server.pass_html)
        path = self.translate_path(self.path)
        if os.path.isdir(path):
            path = os.path.join(path, "index.html")
        if not path.endswith(".html"):
            return super().do_GET()
        try:
            data = Path(path).read_bytes().replace(b"<head>", b"<head>" + PROBE, 1)
        except OSError:
            return self.send_error(404)
        self._send(data)

    def do_POST(self):  # noqa: N802
        name = self.path.removeprefix(DOM_POST)
        if self.server.doms_dir is None or not (self.path.startswith(DOM_POST) and name.isdigit()):
            return self.send_error(404)
        dom = self.rfile.read(int(self.headers["Content-Length"]))
        (self.server.doms_dir / f"{int(name):03d}.html").write_bytes(dom)
        self._send(b"ok")

    def _send(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def serve(site_dir: Path, pass_html: bytes = b"",
          doms_dir: Path | None = None) -> tuple[http.server.ThreadingHTTPServer, str]:
    """(server, its address) of the probed site, served from a daemon thread; with `doms_dir`,
    also the browser pass's page and the DOMs it posts back."""
    handler = functools.partial(ProbeHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.pass_html, server.doms_dir = pass_html, doms_dir
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


def browser(url: str, *extra: str, budget_ms: int = 15000) -> str:
    """What headless Chromium prints for `url` (the DOM with --dump-dom), after 15 s of page time."""
    user_dir = tempfile.mkdtemp(prefix="tinytron-chromium-")
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={user_dir}", f"--virtual-time-budget={budget_ms}",
           *extra, url]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=120 + budget_ms / 1000)
    finally:
        shutil.rmtree(user_dir, ignore_errors=True)
    return proc.stdout


def pages_to_check() -> list[tuple[str, str]]:
    """(address under the site, the page's source text) of the front page and every chapter page."""
    pages = [("", (ROOT / "chapters" / "index.md").read_text())]
    return pages + [(f"{p.parent.name}/{p.stem}/", p.read_text()) for p in chapter_pages()]


def build(out: Path) -> int:
    """`mkdocs build --strict` into out/site; its console in out/build.log, then out/build.rc."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    # The kernels must use Jupyter's inline backend: with MPLBACKEND=Agg, plt.show() draws
    # nothing and the book would lose every figure.
    env.pop("MPLBACKEND", None)
    # Beside two test workers on two cores the machine is saturated, and a kernel with two
    # intra-op threads spends CPU with each waiting for the other (01.2 run under load: 5.2 s
    # of CPU with two threads, 3.9 s with one). The page kernels take one, as the ranks do.
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(out / "build.log", "w", encoding="utf-8") as console:
        rc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d",
                             str(out / "site")], cwd=ROOT, env=env, stdout=console,
                            stderr=subprocess.STDOUT).returncode
    _write(out / "build.rc", str(rc))
    return rc


# One browser for every page: a Chromium started for each page cost about 2 s of both cores,
# most of it the browser's own start. The pass opens a page of its own (PASS_JS) that loads
# each page in turn into a frame of the window's size (1280 x 2000; the phone page at 412 x
# 900, which a window cannot be: Chromium lays a 412 px window out some 90 px wider), lets it
# run SETTLE_MS of the page's time (the probe measures every 500 ms; mermaid and MathJax are
# done within the first pass), and posts the frame's DOM back to the server as --dump-dom
# prints a page. Virtual time stands still while a fetch is pending, so the budget counts only
# the pages' own time; a page the budget left out is loaded alone, in a browser of its own.
# Every probed value of the 106 pages at 1280 px was the same both ways (1,500 ms or 3,000 ms).
PASS_PAGE, DOM_POST, SETTLE_MS = "/__tinytron_pass__.html", "/__tinytron_dom__/", 3000
PASS_JS = """<!doctype html><html><head><style>html, body { margin: 0; overflow: hidden }
iframe { border: 0; display: block }</style></head><body><script>
var pages = %s, i = 0;
function next() {
  if (i >= pages.length) { document.title = "done"; return; }
  var frame = document.createElement("iframe");
  frame.width = pages[i][1]; frame.height = pages[i][2];
  frame.onload = function () { setTimeout(function () {
    var d = frame.contentDocument, x = new XMLHttpRequest();
    x.open("POST", "%s" + i, false);
    x.send((d.doctype ? new XMLSerializer().serializeToString(d.doctype) : "")
           + d.documentElement.outerHTML);
    document.body.removeChild(frame);
    i += 1; next();
  }, %d); };
  frame.src = pages[i][0];
  document.body.appendChild(frame);
}
next();
</script></body></html>"""


def render(out: Path) -> None:
    """Every page's DOM at 1280 px, and one page at a phone's 412 px, in one browser."""
    if chromium() is None:
        _write(out / "doms.json", json.dumps({"skip": NO_CHROMIUM}))
        return
    pages = [[f"/{rel}", 1280, 2000] for rel, _ in pages_to_check()] + [
        [f"/{PHONE_PAGE}", 412, 900]]
    doms = out / "doms"
    doms.mkdir()
    server, address = serve(out / "site", (PASS_JS % (json.dumps(pages), DOM_POST,
                                                      SETTLE_MS)).encode(), doms)
    try:
        browser(f"{address}{PASS_PAGE}", "--dump-dom", "--window-size=1280,2000",
                budget_ms=(SETTLE_MS + 2000) * len(pages))
        for i, (url, width, height) in enumerate(pages):
            if not (doms / f"{i:03d}.html").exists():  # the budget ended first: this page alone
                dom = browser(f"{address}{url}", "--dump-dom", f"--window-size={width},{height}")
                (doms / f"{i:03d}.html").write_text(dom, encoding="utf-8")
    finally:
        server.shutdown()
    (doms / f"{len(pages) - 1:03d}.html").rename(doms / "phone.html")
    _write(out / "doms.json", json.dumps([[rel, f"{i:03d}.html"]
                                          for i, (rel, _) in enumerate(pages_to_check())]))


def _write(path: Path, text: str) -> None:
    """Write a file whole or not at all: a reader waiting for it never sees half of it."""
    part = path.with_name(path.name + ".part")
    part.write_text(text, encoding="utf-8")
    part.rename(path)


def watch(session: int, out: Path) -> None:
    """Once the pytest process `session` has ended, remove `out` and stop this process group."""
    def loop():
        while True:
            time.sleep(2)
            try:
                os.kill(session, 0)
            except ProcessLookupError:
                shutil.rmtree(out, ignore_errors=True)
                os.killpg(os.getpgrp(), signal.SIGKILL)  # the build, its kernels, the browser
            except PermissionError:
                pass  # alive, another user's
    threading.Thread(target=loop, daemon=True).start()


def main(out: Path, session: int | None = None) -> None:
    _write(out / "driver.pid", str(os.getpid()))
    if session is not None:
        watch(session, out)
    if build(out) == 0:
        render(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[3]) if sys.argv[2:3] == ["--session"] else None)

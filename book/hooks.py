"""MkDocs hooks for the book: the nav, pages executed in parallel, offline mermaid, Megatron
citations as links, checked page links, tables of contents that keep code text, folded import
cells."""

from __future__ import annotations

import ast
import concurrent.futures
import logging
import os
import posixpath
import re
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.tinytron")  # under "mkdocs": a warning fails --strict

# The book's order: the seed's chapters 00 -> 08, then the appendices.
CHAPTER_ORDER = [
    "00_overview", "01_main_loop", "02_optimizer", "03_checkpoint", "04_data", "05_buffers",
    "06_recompute_offload", "07_memory", "08_reliability", "parallel", "model", "kernels",
]


def _folder_info(folder: Path) -> tuple[str, list[str]]:
    """(section title, ordered page names) read from the folder's __init__.py without importing it."""
    init = folder / "__init__.py"
    tree = ast.parse(init.read_text(encoding="utf-8")) if init.exists() else ast.Module(body=[])
    title = (ast.get_docstring(tree) or folder.name).split(":")[0].strip().rstrip(".")
    listed: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__pages__" for t in node.targets):
            listed = list(ast.literal_eval(node.value))
    present = sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_"))
    unknown = [name for name in listed if name not in present]
    if unknown:
        raise ValueError(f"{init}: __pages__ names modules that do not exist: {unknown}")
    return title, listed + [name for name in present if name not in listed]


def build_nav(docs_dir: Path) -> list:
    """index.md, then one section per chapter folder that has at least one page."""
    nav: list = [{"Home": "index.md"}]
    for name in CHAPTER_ORDER:
        folder = docs_dir / name
        if not folder.is_dir():
            continue
        title, pages = _folder_info(folder)
        if pages:
            nav.append({title: [f"{name}/{page}.py" for page in pages]})
    return nav


# One numbering for every page: its chapter (00 .. 08, or the appendix letter A, B, C) and its
# place in the chapter's `__pages__`, from 1 (from 0 where the chapter's first page is headed
# "X.0": a prologue, appendix C's roofline). The sidebar shows that number and a short title
# (the heading without the number, the chapter's repeated "Memory:"-style prefix, or the part
# after a dash or colon when the heading is long); the page's own heading gets the same number.
SHORT_TITLE_CHARS = 36
SHORT_TITLES = {  # where the rule above reads badly
    "04_data/distribute.py": "get_batch across TP, CP and PP",
    "08_reliability/restarts.py": "Restarts, torchrun and resuming",
    "03_checkpoint/torch_dist.py": "torch_dist through torch DCP",
    "00_overview/modes.py": "Pretrain, SFT and RL, one train step",
    "02_optimizer/scheduler.py": "Learning-rate and weight-decay schedule",
    "05_buffers/param_and_grad_buffer.py": "One contiguous buffer for all grads",
    "05_buffers/bucket_group.py": "Bucket groups and their collectives",
    "05_buffers/distributed_data_parallel.py": "The DDP wrapper and its hooks",
    "06_recompute_offload/checkpoint.py": "A checkpoint that replays the RNG",
    "model/layers.py": "RMSNorm, RoPE and the init",
}
_NUMBER = re.compile(r"^(?:Appendix\s+)?(?:\d\d(?:\.\d+)?|[A-Z](?:\.\d+)?)\s*·\s*")
_PART = re.compile(r"\s*\(\d+/\d+\)")  # "Recompute (1/4)": the number says it now


def _heading(source: Path) -> str:
    """The first level-1 heading of a jupytext page, code spans as their text."""
    for line in source.read_text(encoding="utf-8").splitlines():
        if line.startswith("# # "):
            return re.sub(r"`+([^`]+)`+", r"\1", line[4:].strip())
    return source.stem


def chapter_label(folder: str, title: str) -> str:
    """'07' for a numbered chapter folder, the letter for an appendix ('Appendix C · ...')."""
    if m := re.match(r"(\d\d)_", folder):
        return m.group(1)
    m = re.match(r"Appendix\s+([A-Z])\b", title)
    return m.group(1) if m else folder


def _plain_word(text: str) -> bool:
    """Whether a title's first word is an English word (capitalized), not a code name."""
    word = text.split(" ")[0]
    return word.replace("-", "").isalpha() and not word.startswith("tinytron")


def short_title(heading: str, chapter_prefixes: set[str]) -> str:
    """A sidebar title of at most SHORT_TITLE_CHARS characters, from a page's heading."""
    text = _PART.sub("", _NUMBER.sub("", heading)).strip()
    head, sep, rest = text.partition(": ")
    if sep and head in chapter_prefixes:
        text = rest[:1].upper() + rest[1:] if _plain_word(rest) else rest
    for cut, shortest in ((" — ", 6), (": ", 6), (", ", 16)):  # "RMSNorm, RoPE and ..." stays
        if len(text) > SHORT_TITLE_CHARS and len(text.split(cut)[0]) >= shortest:
            text = text.split(cut)[0]
    if len(text) > SHORT_TITLE_CHARS:
        words = text[:SHORT_TITLE_CHARS - 1].rsplit(" ", 1)[0].split(" ")
        while words[-1] in {"a", "and", "of", "on", "the", "to", "with", "into", "for"}:
            words.pop()
        text = " ".join(words) + "…"
    return text


def page_titles(docs_dir: Path) -> dict[str, tuple[str, str]]:
    """(number, short title) of every page of the nav, by its path under docs_dir."""
    titles: dict[str, tuple[str, str]] = {}
    for section in build_nav(docs_dir)[1:]:
        (title, pages), = section.items()
        folder = pages[0].split("/")[0]
        label = chapter_label(folder, title)
        headings = [_heading(docs_dir / page) for page in pages]
        heads = [_PART.sub("", _NUMBER.sub("", h)).partition(": ")[0] for h in headings]
        prefixes = {h for h in heads if heads.count(h) > 1 and len(h.split()) <= 3}
        first = _NUMBER.match(headings[0])
        start = 0 if first and first.group(0).split("·")[0].strip().endswith(".0") else 1
        for i, (page, heading) in enumerate(zip(pages, headings), start):
            titles[page] = (f"{label}.{i}", SHORT_TITLES.get(page) or short_title(heading, prefixes))
    return titles


_TITLES: dict[str, tuple[str, str]] = {}


def number_heading(html: str, number: str) -> str:
    """Give a rendered page's first level-1 heading the page's number ("07.3 · ...")."""
    def renumber(m: re.Match) -> str:
        text = _PART.sub("", _NUMBER.sub("", m.group(2)), count=1)
        return f"{m.group(1)}{number} · {text}"
    return re.sub(r"(<h1\b[^>]*>)([^<]*)", renumber, html, count=1)


def on_config(config, **kwargs):
    config["nav"] = build_nav(Path(config["docs_dir"]))
    _TITLES.clear()
    _TITLES.update(page_titles(Path(config["docs_dir"])))
    os.environ["TINYTRON_KERNEL_DIR"] = _kernel_dir()  # the page workers' kernels use it too
    _quiet_kernels()
    _sharp_figures()
    _CITED.clear()
    _CITED.update(cited_megatron_paths(Path(config["docs_dir"])))
    return config


# Every executed page starts a Jupyter kernel, and over TCP each kernel logs that its traffic is
# unencrypted: 70 identical lines that would hide a real warning. Local IPC sockets are what the
# kernel asks for, and they remove the cause (not the message). nbconvert reads this setting
# from the Jupyter config path (book/jupyter/jupyter_nbconvert_config.py gives every kernel its
# own socket path); the variable reaches only this build and the kernels it starts.
def _quiet_kernels() -> None:
    """Point nbconvert at book/jupyter, whose config runs each kernel over IPC, not TCP."""
    ours = str(_JUPYTER_DIR)
    paths = [p for p in os.environ.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p]
    if ours not in paths:
        os.environ["JUPYTER_CONFIG_PATH"] = os.pathsep.join([ours, *paths])


_JUPYTER_DIR = Path(__file__).resolve().parent / "jupyter"


# Matplotlib's inline figures default to 100 dots per inch, which a high-density screen shows
# blurred and a 7-point label as a smudge. The page kernels read book/matplotlibrc (150 dpi): a
# figure keeps its size on the page (the column scales it) and gains 1.5x the pixels. A reader's
# own notebook or a page run as a script keeps the reader's settings.
def _sharp_figures() -> None:
    """Point the page kernels' matplotlib at book/matplotlibrc unless the builder chose one."""
    os.environ.setdefault("MATPLOTLIBRC", str(_JUPYTER_DIR.parent / "matplotlibrc"))


# In a virtual environment over the system's packages (scripts/setup.sh's .venv), Jupyter looks
# for nbconvert's "lab" template under the environment's prefix only, and it is installed under
# the base interpreter's: every page failed with "No template sub-directory with name 'lab'".
def _base_jupyter_path() -> None:
    """Add the base interpreter's share/jupyter to Jupyter's data path inside a venv."""
    import sys

    base = os.path.join(sys.base_prefix, "share", "jupyter")
    paths = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    if sys.prefix != sys.base_prefix and os.path.isdir(base) and base not in paths:
        os.environ["JUPYTER_PATH"] = os.pathsep.join([*paths, base])


_base_jupyter_path()


def _kernel_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"tinytron-kernels-{os.getuid()}-{os.getpid()}")


def on_build_error(**kwargs):
    """A page failed: start no other page (those already running finish)."""
    if _POOL is not None:
        _POOL.shutdown(wait=False, cancel_futures=True)


def on_shutdown(**kwargs):
    """Remove this build's directory of kernel sockets (each kernel removed its own sockets)."""
    if _POOL is not None:
        _POOL.shutdown(cancel_futures=True)
    shutil.rmtree(os.environ.get("TINYTRON_KERNEL_DIR", _kernel_dir()), ignore_errors=True)


# mkdocs-jupyter executes a page when it renders it, one page after the other: a kernel start,
# the demo, the conversion, some 6 s a page over 80 pages. The pages are independent (each demo
# writes its own temporary files and hosts its gloo world on a port the OS picks), so the build
# starts every page's conversion up front, a few at a time (each in its own kernel process;
# the threads here only wait for them), and hands mkdocs-jupyter the finished HTML when it
# renders the page. A demo that fails still fails the build, with the cell's error.
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_PAGES: dict[str, tuple[dict, concurrent.futures.Future]] = {}


def _converted(path, **kwargs) -> str:
    """mkdocs-jupyter's nb2html, answered from the pool when the page was started there."""
    started = _PAGES.pop(str(path), None)
    if started is None or started[0] != kwargs:
        return _NB2HTML[0](path, **kwargs)
    return started[1].result()  # the page's own error, if its demo failed


_NB2HTML: list = []  # mkdocs-jupyter's own nb2html, kept before it is replaced


# Each chapter keeps the engineering around its mechanism (argparse, validation, plumbing,
# plotting) in private `_*.py` modules, and its pages name them: "the code you read is the
# code that runs" holds on the site only if those can be read there too. Each becomes a page
# of its source (`01_main_loop/_parts/`), outside the nav and the search index, and every code
# span on a page that names one (`_parts.py`, `01_main_loop/_parts.py`, `chapters/...`) links it.
def private_modules(docs_dir: Path) -> list[Path]:
    """The private modules the site publishes: chapters/_*.py and chapters/*/_*.py."""
    return sorted(p for p in [*docs_dir.glob("_*.py"), *docs_dir.glob("*/_*.py")]
                  if not p.name.startswith("__"))


def source_page(module: Path, docs_dir: Path) -> str:
    """The markdown of a private module's source page."""
    rel = module.relative_to(docs_dir).as_posix()
    text = module.read_text(encoding="utf-8")
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`{3,}", text)), default=0))
    doc = ast.get_docstring(ast.parse(text)) or ""
    lead = doc.split("\n\n")[0].replace("\n", " ")
    return (f"---\nsearch:\n  exclude: true\n---\n\n# `chapters/{rel}`\n\n"
            f"{lead}\n\nThe private module's whole source ({len(text.splitlines())} lines), as the "
            f"pages import and run it.\n\n{fence}python\n{text}\n{fence}\n")


def _add_source_pages(files, config) -> None:
    from mkdocs.structure.files import File, InclusionLevel

    docs_dir = Path(config["docs_dir"])
    for module in private_modules(docs_dir):
        uri = module.relative_to(docs_dir).with_suffix(".md").as_posix()
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, content=source_page(module, docs_dir),
                                        inclusion=InclusionLevel.NOT_IN_NAV))


_MODULE_SPAN = re.compile(r"(?<!\">)(<code>)((?:\.\./|chapters/)?(?:[\w]+/)?(_[a-z]\w*)\.py)(</code>)")


def link_private_modules(html: str, page, files) -> str:
    """Link each code span naming a published private module to its source page."""
    here = posixpath.dirname(page.file.src_uri)

    def link(m: re.Match) -> str:
        named = m.group(2).removeprefix("chapters/").removeprefix("../")
        candidates = [named] if "/" in named else [posixpath.join(here, named), named]
        for cand in candidates:
            found = files.get_file_from_path(cand[:-3] + ".md")
            if found is not None and found.inclusion.is_not_in_nav():
                return (f'<a href="{found.url_relative_to(page.file)}">{m.group(1)}{m.group(2)}'
                        f"{m.group(4)}</a>")
        return m.group(0)
    return _MODULE_SPAN.sub(link, html)


def on_files(files, config, **kwargs):
    """Add the private modules' source pages; start executing every notebook page in a pool
    (TINYTRON_SERIAL_BOOK=1: one at a time)."""
    global _POOL
    _add_source_pages(files, config)
    plugin = config["plugins"].get("mkdocs-jupyter")
    if plugin is None or not plugin.config["execute"] or os.environ.get("TINYTRON_SERIAL_BOOK"):
        return files
    from mkdocs_jupyter import convert

    if not _NB2HTML:
        _NB2HTML.append(convert.nb2html)
        convert.nb2html = _converted
    keys = ("kernel_name", "theme", "allow_errors", "show_input", "no_input", "no_prompt",
            "remove_tag_config", "highlight_extra_classes", "include_requirejs",
            "custom_mathjax_url")
    kwargs = {"execute": True, **{k: plugin.config[k] for k in keys}}
    workers = max(1, min(4, os.cpu_count() or 1))
    if _POOL is not None:  # `mkdocs serve` builds again: start from a fresh pool
        _POOL.shutdown(cancel_futures=True)
        _PAGES.clear()
    _POOL = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="book-page")
    for path in longest_first(executed_pages(files, plugin)):
        _PAGES[path] = (kwargs, _POOL.submit(_NB2HTML[0], path, **kwargs))
    return files


# The pages whose demos run longest (a trainer, a Triton kernel under the interpreter, a search
# over layouts), longest first, as measured on two CPU cores. The pool starts them before the
# rest: in the book's order appendix C's kernels came last and the build waited minutes on them
# after every other page had finished. A page missing here only starts later.
LONGEST_PAGES = [
    "kernels/inductor.py", "01_main_loop/host_syncs.py", "01_main_loop/assembled.py",
    "kernels/flash_attention.py", "model/gpt.py", "07_memory/measured.py",
    "07_memory/calculator.py", "01_main_loop/interleaved.py", "model/generate.py",
    "kernels/roofline.py",
    "07_memory/step_published.py", "kernels/swiglu.py", "01_main_loop/schedules.py",
    "08_reliability/fault_injection.py", "01_main_loop/run.py", "kernels/rmsnorm.py",
    "model/config.py", "02_optimizer/training.py", "kernels/fused_adamw.py",
]


def longest_first(paths: list[str]) -> list[str]:
    """`paths` with the pages of LONGEST_PAGES first, in that list's order; the rest as given."""
    rank = {page: i for i, page in enumerate(LONGEST_PAGES)}
    key = lambda path: rank.get(Path(path).parent.name + "/" + Path(path).name, len(rank))  # noqa: E731
    return sorted(paths, key=key)


def executed_pages(files, plugin) -> list[str]:
    """The source paths of the notebook pages the site shows: what the pool executes.

    mkdocs-jupyter's on_files (it runs before this hook) wraps every file its `include` glob
    matches, the excluded `_*.py` and `__init__.py` modules too, in a NotebookFile that does not
    copy the file's inclusion level: the wrapper answers with File's class default, UNDEFINED,
    which counts as included. MkDocs sets the levels again after on_files, so those modules never
    become pages, but a pool that trusted the wrapper executed each of them (76 kernels, a third
    of the build's work). The wrapped file keeps its real level.
    """
    return [f.abs_src_path for f in files
            if getattr(f, "file", f).inclusion.is_included() and plugin.should_include(f)]


# nbconvert wraps a notebook's mermaid block as <div class="jp-Mermaid"><pre class="mermaid">
# and hides it until its own CDN script has rendered it. Renaming the wrapper unhides it, and
# material then renders every `pre.mermaid` with the vendored mermaid.min.js.
# nbconvert also injects a module script that imports mermaid from a CDN: drop it, so that no
# page of the book reaches for the network.
_JP_MERMAID = re.compile(r'class="jp-Mermaid"')
_CDN_MERMAID_SCRIPT = re.compile(
    r'<script type="module">(?:(?!</script>).)*?https://[^"]*mermaid(?:(?!</script>).)*</script>', re.S)


# nbconvert writes a mermaid block's text into <pre class="mermaid"> unescaped, so the browser
# parses a label's `<br/>` as an element and mermaid, which reads the text, glued the words on
# either side ("bucketschapter 05"). Escaped, mermaid reads `<br/>` and breaks the line, as it
# does on the markdown pages (superfences escapes it).
_MERMAID_PRE = re.compile(r'(<pre class="mermaid">)(.*?)(</pre>)', re.S)


def escape_mermaid(html: str) -> str:
    """Escape the markup characters of every mermaid block's source on a notebook page."""
    return _MERMAID_PRE.sub(lambda m: m.group(1) + m.group(2).replace("<", "&lt;")
                            .replace(">", "&gt;") + m.group(3), html)


def on_page_content(html, page, config, files):
    if page.file.abs_src_path is None:  # a private module's source page (on_files made it)
        page.title = "chapters/" + page.file.src_uri[: -len(".md")] + ".py"
        return html
    title = code_span_title(Path(page.file.abs_src_path))
    if title is not None:
        page.title = title  # the nav and the browser tab
    if page.file.src_uri in _TITLES:
        number, short = _TITLES[page.file.src_uri]
        page.title = f"{number} {short}"  # the nav, the previous/next links and the browser tab
        html = number_heading(html, number)
    html = _CDN_MERMAID_SCRIPT.sub("", html)
    if _JP_MERMAID.search(html):
        html = escape_mermaid(_JP_MERMAID.sub('class="tt-mermaid"', html))
    html = shared_notebook_css(html, page)
    html = link_citations(html, _CITED)
    if page.file.src_uri.endswith(".py"):  # markdown pages: mkdocs checks their links itself
        html = _link_pages(html, page, files)
        html = fold_code_cells(html, _code_cell_sources(Path(page.file.abs_src_path)),
                               page.file.src_uri)
        from mkdocs.structure.toc import get_toc
        page.toc = get_toc(heading_toc_tokens(html))
    return code_out_of_search(link_private_modules(html, page, files))


# The search index: every page's code cells were 43% of its 3.5 MB (1.2 MB without them), and
# the theme's worker loads the index on a reader's first visit. A code cell's text stays on the
# page and is found by the browser's own find; the search finds the prose, the headings and the
# code spans in them, which name every function a page builds. Left out with the code: the
# hidden copy of each cell's source that its copy button reads (and the button's "Copied!"), a
# demo's printed output and a diagram's source (numbers and graph syntax).
_NOT_SEARCHED = re.compile(
    r'<(div class="highlight-ipynb hl-python"|div class="jp-OutputArea jp-Cell-outputArea"'
    r'|pre class="mermaid"|div class="zeroclipboard-container"'
    r'|div class="clipboard-copy-txt" id="[^"]*")>')


def code_out_of_search(html: str) -> str:
    """Mark code cells' sources, their outputs and mermaid sources as left out of the search."""
    return _NOT_SEARCHED.sub(r'<\1 data-search-exclude>', html)


def on_post_page(output, page, config):
    """Every entry of a page's table of contents links to a heading the page has; the page
    links the shared notebook stylesheet and loads mermaid and MathJax only if it uses them."""
    missing = [link.id for link in _toc_links(page.toc) if f'id="{link.id}"' not in output]
    if missing:
        log.warning("%s: its table of contents links to headings it does not have: %s",
                    page.file.src_uri, missing[:3])
    css = _PAGE_CSS.pop(page.file.src_uri, None)
    if css is not None:
        href = posixpath.relpath(css, posixpath.dirname(page.file.dest_uri))
        output = output.replace("</head>", f'<link rel="stylesheet" href="{href}">\n</head>', 1)
    return drop_unused_scripts(output)


# Each notebook page carried the same 590 KB of JupyterLab styles inline (three quarters of the
# site's HTML), and every page loaded mermaid (3.6 MB) and MathJax (2.1 MB), used by about half
# of them. The styles go to one stylesheet, named by its content's hash, that every notebook
# page links (a browser fetches it once); each script stays only on a page that uses it.
# nbconvert's MathJax 2 block (an empty <script src=""> and a config no script reads) goes.
_HEAD_STYLE = re.compile(r'<style type="text/css">\s*(.*?)</style>\s*', re.S)
_MATHJAX2 = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->\s*", re.S)
_NOTEBOOK_CSS: dict[str, str] = {}   # site path of a shared stylesheet -> its text
_PAGE_CSS: dict[str, str] = {}       # page source -> the shared stylesheet it links
_MATH = re.compile(r'class="arithmatex"|(?<![\\$])\$[^$\s][^$\n]*\$|\\\(|\\\[|\$\$')


def shared_notebook_css(html: str, page) -> str:
    """Move the inline styles ahead of a notebook page's cells into one shared stylesheet."""
    import hashlib

    html = _MATHJAX2.sub("", html)
    start = html.find('<div class="jupyter-wrapper">')
    if start < 0:
        return html
    head = html[:start]
    styles = _HEAD_STYLE.findall(head)
    if not styles:
        return html
    text = "\n".join(styles)
    path = f"assets/stylesheets/notebook.{hashlib.sha256(text.encode()).hexdigest()[:8]}.css"
    _NOTEBOOK_CSS[path] = text
    _PAGE_CSS[page.file.src_uri] = path
    return _HEAD_STYLE.sub("", head) + html[start:]


def drop_unused_scripts(output: str) -> str:
    """Remove the mermaid script from a page with no diagram and MathJax from one with no math."""
    body = output[output.find("<body"):]
    body = re.sub(r"<script\b.*?</script>", "", body, flags=re.S)
    if 'class="mermaid"' not in body:
        output = re.sub(r'<script src="[^"]*/mermaid\.min\.js"></script>\s*', "", output)
    if not _MATH.search(body):
        output = re.sub(r'<script src="[^"]*/(?:mathjax-tex-svg|mathjax-config)\.js"></script>\s*',
                        "", output)
    return output


def _toc_links(items):
    for item in items:
        yield item
        yield from _toc_links(item.children)


# mkdocs-jupyter builds a notebook page's table of contents from a markdown copy of the page
# with every code span deleted, so "`train_step`, in Megatron's exact order" read ", in
# Megatron's exact order" in the TOC and linked to an id the page does not have (the page's
# heading keeps its code, and its id `train_step-in-megatrons-exact-order`). The TOC is rebuilt
# from the rendered headings instead: their text as shown, their ids as written.
_HEADING = re.compile(r'<h([1-6])\s[^>]*?id="([^"]+)"[^>]*>(.*?)</h\1>', re.S)
_ANCHOR_LINK = re.compile(r'<a class="anchor-link"[^>]*>.*?</a>', re.S)


def heading_toc_tokens(html: str) -> list[dict]:
    """The nested TOC tokens (as Python-Markdown makes them) of a rendered page's headings."""
    from markdown.extensions.toc import nest_toc_tokens

    flat = []
    for m in _HEADING.finditer(html):
        inner = _ANCHOR_LINK.sub("", m.group(3))
        name = " ".join(re.sub(r"<[^>]+>", "", inner).split())
        flat.append({"level": int(m.group(1)), "id": m.group(2), "name": name, "html": inner,
                     "data-toc-label": ""})
    return nest_toc_tokens(flat)


# A page opens with its imports and `__all__` (DESIGN.md §3: the first code cell holds those
# only), some twenty lines a reader skips; plotting helpers can fill a screen. In the rendered
# site such a cell's code is folded into a closed <details> whose summary says what it holds
# (its output, a figure say, stays in view); the .py and the notebook keep every line. Folded:
# the first code cell when it starts with an import, and every cell tagged `hide-input`
# (jupytext: `# %% tags=["hide-input"]`).
HIDE_INPUT_TAG = "hide-input"
_CODE_CELL_INPUT = re.compile(r'<div class="jp-Cell jp-CodeCell[^"]*"[^>]*>\s*'
                              r'(?:<div class="jp-Cell jp-CodeCell[^"]*"[^>]*>\s*)?'
                              r'(?=<div class="jp-Cell-inputWrapper")')
_DIV = re.compile(r"<div\b|</div>")


def _code_cell_sources(source: Path) -> list[tuple[str, list[str]]]:
    """(source, tags) of each code cell of a jupytext page, in order."""
    import jupytext

    return [(cell.source, list(cell.metadata.get("tags", [])))
            for cell in jupytext.read(source).cells if cell.cell_type == "code"]


def fold_label(index: int, source: str, tags: list[str]) -> str | None:
    """The summary of a code cell folded on the site, or None when the cell stays open."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        body = []
    if index == 0 and body and isinstance(body[0], (ast.Import, ast.ImportFrom)):
        exports = any(isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                        for t in s.targets) for s in body)
        return "imports and <code>__all__</code>" if exports else "imports"
    if HIDE_INPUT_TAG in tags:
        names = [s.name for s in body
                 if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        return "code: " + ", ".join(f"<code>{n}</code>" for n in names) if names else "code"
    return None


def fold_code_cells(html: str, cells: list[tuple[str, list[str]]], where: str = "") -> str:
    """Wrap the input of each code cell that fold_label names in a closed <details>."""
    starts = [m.end() for m in _CODE_CELL_INPUT.finditer(html)]
    if len(starts) != len(cells):
        log.warning("%s: the page shows %d code cells, its source has %d", where,
                    len(starts), len(cells))
        return html
    out, done = [], 0
    for index, (start, (source, tags)) in enumerate(zip(starts, cells)):
        label = fold_label(index, source, tags)
        if label is None:
            continue
        depth = 0
        for m in _DIV.finditer(html, start):
            depth += -1 if m.group(0) == "</div>" else 1
            if depth == 0:
                break
        end = m.end()
        out += [html[done:start], f'<details class="tt-folded"><summary>{label}</summary>',
                html[start:end], "</details>"]
        done = end
    return "".join(out) + html[done:]


# Titles are taken from the page's first heading with its markup stripped, and Python-Markdown
# drops the text of inline code there: "the `.bin` / `.idx` indexed dataset" would read
# "the / indexed dataset". A heading with code spans keeps their text instead.
def code_span_title(source: Path) -> str | None:
    """The first level-1 heading of a .md page or a jupytext .py page, if it has code spans."""
    for line in source.read_text(encoding="utf-8").splitlines():
        if source.suffix == ".py":
            if not line.startswith("# "):
                continue
            line = line[2:]
        if line.startswith("# "):
            heading = line[2:].strip()
            return re.sub(r"`+([^`]+)`+", r"\1", heading) if "`" in heading else None
    return None


# Megatron citations become links to the file at the commit the book reads. A citation is an
# inline code span: a full path (`megatron/core/distributed/param_and_grad_buffer.py:940`), a
# file name or partial path that the book cites in full elsewhere (`schedules.py:634`), or a
# bare continuation (`:494`) that follows a resolved citation in the same paragraph, list item
# or table cell. Anything that does not resolve to exactly one Megatron file stays plain text.
MEGATRON_BLOB = "https://github.com/NVIDIA/Megatron-LM/blob/e03878b5f/"
_FULL = re.compile(r"(?:megatron|tools)/[\w./-]*\w\.(?:py|cpp|h)|tests/(?:unit|functional)_tests/"
                   r"[\w./-]*\w\.py|(?:pretrain_\w+|train_rl)\.py")
_CITATION = re.compile(r"(?P<path>[\w./-]*\w\.(?:py|cpp|h))?(?::(?P<a>\d+)(?:-(?P<b>\d+))?(?:,\s*\d+(?:-\d+)?)*)?")
_TOKEN = re.compile(r"(<[^>]+>)")
_BLOCK = re.compile(r"</?(?:p|li|td|th|tr|h[1-6]|div|pre|blockquote|table|ul|ol|dd|dt)\b", re.I)
_COMMENT_SPAN = re.compile(r'<span class="(?:c|c1|cm|ch|cs|sd)">')  # pygments: comments, docstrings
_IN_COMMENT = re.compile(r"(?<![\w/.-])([\w./-]*\w\.(?:py|cpp|h))(?::(\d+)(?:-(\d+))?)?(?![\w/])")
_CITED: dict[str, list[str]] = {}   # file name or partial path -> the full paths it can mean


def cited_megatron_paths(docs_dir: Path) -> dict[str, list[str]]:
    """Every full Megatron path the book cites, indexed by each of its path suffixes."""
    full = set()
    for source in [*docs_dir.glob("*/*.py"), *docs_dir.glob("*.md"), docs_dir.parent / "README.md"]:
        if source.is_file():
            full.update(m.group(0) for m in _FULL.finditer(source.read_text(encoding="utf-8")))
    index: dict[str, list[str]] = {}
    for path in sorted(full):
        parts = path.split("/")
        for i in range(len(parts)):
            index.setdefault("/".join(parts[i:]), []).append(path)
    return index


def megatron_url(path: str, first: str | None = None, last: str | None = None) -> str:
    """The GitHub address of a Megatron file at e03878b5f, at a line or a range of lines."""
    return MEGATRON_BLOB + path + (f"#L{first}" + (f"-L{last}" if last else "") if first else "")


def _resolve(path: str, with_line: bool, page_paths: set[str], cited: dict[str, list[str]]) -> str | None:
    """The one full Megatron path a cited (possibly partial) path names, or None."""
    if _FULL.fullmatch(path):
        return path
    candidates = cited.get(path, [])
    on_page = [c for c in candidates if c in page_paths]
    if len(on_page) == 1:
        return on_page[0]
    # a bare file name cited nowhere else on the page is still unambiguous with a line number
    return candidates[0] if with_line and len(candidates) == 1 and not on_page else None


def _link_in_comment(text: str, page_paths: set[str], cited: dict[str, list[str]]) -> str:
    """Link the citations inside a code cell's comment or docstring (no bare continuations)."""
    def link(m: re.Match) -> str:
        path = _resolve(m.group(1), bool(m.group(2)), page_paths, cited)
        return f'<a href="{megatron_url(path, m.group(2), m.group(3))}">{m.group(0)}</a>' if path else m.group(0)
    return _IN_COMMENT.sub(link, text)


def link_citations(html: str, cited: dict[str, list[str]]) -> str:
    """Wrap every Megatron citation of a rendered page (prose and code comments) in a link."""
    page_paths = {m.group(0) for m in _FULL.finditer(html)}
    out, last_path, in_code, in_link, in_pre, in_comment = [], None, False, 0, 0, False
    for token in _TOKEN.split(html):
        if token.startswith("<"):
            name = re.match(r"</?\s*(\w+)", token)
            tag, closing = (name.group(1).lower() if name else ""), token.startswith("</")
            step = -1 if closing else 1
            in_code = (not closing) if tag == "code" else in_code
            in_link += step if tag == "a" else 0
            in_pre += step if tag == "pre" else 0
            in_comment = bool(_COMMENT_SPAN.match(token)) if tag == "span" else in_comment
            if _BLOCK.match(token):
                last_path = None
            out.append(token)
            continue
        if in_pre and in_comment and not in_link:
            token = _link_in_comment(token, page_paths, cited)
        elif in_code and not in_link and not in_pre and (m := _CITATION.fullmatch(token.strip())):
            if m.group("path"):
                last_path = _resolve(m.group("path"), bool(m.group("a")), page_paths, cited)
            path = last_path if (m.group("path") or m.group("a")) else None
            if path:
                token = f'<a href="{megatron_url(path, m.group("a"), m.group("b"))}">{token}</a>'
        out.append(token)
    return "".join(out)


# Pages link to each other by their source file (`../05_buffers/param_and_grad_buffer.py`, or
# the notebook twin `.ipynb`), which works in Jupyter and on GitHub. On the site those links are
# rewritten to the page's address. A link to a page that does not exist, or (checked in the
# built site, for every page) to a heading that the target page does not have, is a warning,
# and `--strict` fails the build on it.
_HREF = re.compile(r'(<a\s[^>]*?href=")([^"#?]*)(#[^"]*)?(")')


def _link_pages(html: str, page, files) -> str:
    """Rewrite a notebook page's relative links to pages into site addresses; warn on dead ones."""
    def rewrite(m: re.Match) -> str:
        href, anchor = m.group(2), m.group(3) or ""
        if not href or re.match(r"[a-z][a-z0-9+.-]*:|/", href):
            return m.group(0)  # in-page anchor, another site, or an absolute path
        target = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), href))
        if target.endswith(".ipynb"):
            target = target[: -len(".ipynb")] + ".py"
        if posixpath.basename(target).startswith("_") and target.endswith(".py"):
            target = target[:-3] + ".md"  # a private module: its source page
        found = files.get_file_from_path(target)
        if found is None or found.inclusion.is_excluded():
            log.warning("%s links to '%s', which is not a page or file of the book",
                        page.file.src_uri, href)
            return m.group(0)
        return m.group(1) + found.url_relative_to(page.file) + anchor + m.group(4)
    return _HREF.sub(rewrite, html)


def on_post_build(config, **kwargs):
    """Write the shared notebook stylesheets; every link between pages of the built site
    reaches a page, and the heading it names."""
    site = Path(config["site_dir"])
    for path, text in _NOTEBOOK_CSS.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text, encoding="utf-8")
    for html in sorted(site.rglob("*.html")):
        for problem in dead_links(site, html):
            log.warning("%s: %s", html.relative_to(site), problem)


_A_HREF = re.compile(r'<a\s[^>]*?href="(?!/)([^"#?:]+)(?:#([^"]*))?"')  # relative links only


def dead_links(site: Path, html: Path) -> list[str]:
    """The relative links of one built page whose target file or #anchor does not exist."""
    problems, texts = [], {}
    for href, anchor in _A_HREF.findall(html.read_text(encoding="utf-8")):
        if href.endswith((".py", ".ipynb")):
            continue  # a source link left as written: reported with its page when rendered
        target = (html.parent / href).resolve()
        target = target / "index.html" if href.endswith("/") or target.is_dir() else target
        if not target.is_file():
            problems.append(f"links to '{href}', which is not in the site")
        elif anchor and target.suffix == ".html":
            text = texts.setdefault(target, target.read_text(encoding="utf-8"))
            if f'id="{anchor}"' not in text:
                problems.append(f"links to '{href}#{anchor}', which has no such heading")
    return problems

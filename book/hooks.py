"""MkDocs hooks for the book: the nav from the chapter folders, and offline mermaid on notebook pages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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


def on_config(config, **kwargs):
    config["nav"] = build_nav(Path(config["docs_dir"]))
    return config


# nbconvert wraps a notebook's mermaid block as <div class="jp-Mermaid"><pre class="mermaid">
# and hides it until its own CDN script has rendered it. Renaming the wrapper unhides it, and
# material then renders every `pre.mermaid` with the vendored mermaid.min.js.
# nbconvert also injects a module script that imports mermaid from a CDN: drop it, so that no
# page of the book reaches for the network.
_JP_MERMAID = re.compile(r'class="jp-Mermaid"')
_CDN_MERMAID_SCRIPT = re.compile(
    r'<script type="module">(?:(?!</script>).)*?https://[^"]*mermaid(?:(?!</script>).)*</script>', re.S)


def on_page_content(html, page, config, files):
    title = code_span_title(Path(page.file.abs_src_path))
    if title is not None:
        page.title = title  # the nav and the browser tab
    html = _CDN_MERMAID_SCRIPT.sub("", html)
    return _JP_MERMAID.sub('class="tt-mermaid"', html)


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

"""The book's Megatron citations, as a table checked against the source at e03878b5f.

Every `megatron/...:line` a page cites (in full, by a file name the book cites in full elsewhere,
or as a bare `:line` continuation) is resolved with the same rules that turn it into a link on
the site (`hooks.py`). `book/megatron_citations.tsv` holds one row per distinct citation of a
page: the page, the citation as written, the full path and lines it resolves to, and the text
found at those lines at e03878b5f. `tests/test_book_citations.py` checks that the table and the
pages agree (no citation without a row, no row without a citation) and, with
`TINYTRON_MEGATRON_SRC` set to a Megatron-LM tree at e03878b5f, that every row's text is what
that tree holds.

    python3 book/citations.py --src /path/to/Megatron-LM   # rewrite the table from the source
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hooks  # noqa: E402  (the site's own citation rules)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "chapters"
TABLE = ROOT / "book" / "megatron_citations.tsv"
COLUMNS = ["page", "cited", "path", "first", "last", "text"]
_SPAN = re.compile(r"`([^`\n]+)`")
_TEXT_WIDTH = 90


def _pages(docs_dir: Path) -> list[Path]:
    return sorted([*docs_dir.glob("*/*.py"), *docs_dir.glob("*.md")])


def _comment_lines(page: Path):
    """(line, is_prose) for each line that the site renders as prose or as a code comment."""
    prose = page.suffix == ".md"
    for line in page.read_text(encoding="utf-8").splitlines():
        if page.suffix == ".md":
            yield line, True
            continue
        if line.startswith("# %%"):
            prose = "[markdown]" in line
            continue
        stripped = line.lstrip()
        if stripped.startswith("#"):
            yield stripped.lstrip("#").strip(), prose
        elif not prose and "#" in line:
            yield line.split("#", 1)[1], False
        else:
            yield "", prose  # a code line ends a paragraph


def extract(docs_dir: Path = DOCS) -> set[tuple[str, str, str, int, int]]:
    """Every resolved citation: (page, cited text, full path, first line, last line)."""
    cited = hooks.cited_megatron_paths(docs_dir)
    found = set()
    for page in _pages(docs_dir):
        text = page.read_text(encoding="utf-8")
        page_paths = {m.group(0) for m in hooks._FULL.finditer(text)}
        name, last_path = str(page.relative_to(docs_dir)), None
        for line, is_prose in _comment_lines(page):
            if not line.strip():
                last_path = None  # a paragraph ends: a bare `:N` no longer continues
                continue
            for span in _SPAN.findall(line):
                m = hooks._CITATION.fullmatch(span.strip())
                if not m or not (m.group("path") or m.group("a")):
                    continue
                if m.group("path"):
                    last_path = hooks._resolve(m.group("path"), bool(m.group("a")), page_paths, cited)
                if last_path and m.group("a"):
                    first = int(m.group("a"))
                    found.add((name, span.strip(), last_path, first, int(m.group("b") or first)))
            if not is_prose:  # a code comment: citations without backticks link too
                for m in hooks._IN_COMMENT.finditer(_SPAN.sub(" ", line)):
                    path = hooks._resolve(m.group(1), bool(m.group(2)), page_paths, cited)
                    if path and m.group(2):
                        first = int(m.group(2))
                        found.add((name, m.group(0), path, first, int(m.group(3) or first)))
    return found


def source_text(src: Path, path: str, first: int, last: int) -> str:
    """What the cited lines hold at the source tree: the first line, and the last if a range."""
    file = src / path
    if not file.is_file():
        return "!! no such file"
    lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
    if not 1 <= first <= last <= len(lines):
        return f"!! past the end of the file ({len(lines)} lines)"
    def cut(s):
        s = " ".join(s.split())
        return s if len(s) <= _TEXT_WIDTH else s[:_TEXT_WIDTH - 1] + "…"
    head = cut(lines[first - 1])
    return head if first == last else f"{head} ⟶ {cut(lines[last - 1])}"


def build_rows(src: Path, docs_dir: Path = DOCS) -> list[list[str]]:
    """The table's rows, sorted, with the text read from the source tree `src`."""
    return [[page, cited, path, str(a), str(b), source_text(src, path, a, b)]
            for page, cited, path, a, b in sorted(extract(docs_dir))]


def read_table(table: Path = TABLE) -> list[list[str]]:
    lines = table.read_text(encoding="utf-8").splitlines()
    assert lines[0].split("\t") == COLUMNS, f"{table}: unexpected header"
    return [line.split("\t") for line in lines[1:]]


def write_table(rows: list[list[str]], table: Path = TABLE) -> None:
    body = ["\t".join(COLUMNS)] + ["\t".join(c.replace("\t", " ") for c in r) for r in rows]
    table.write_text("\n".join(body) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", required=True, type=Path,
                        help="a Megatron-LM source tree checked out at e03878b5f")
    args = parser.parse_args(argv)
    rows = build_rows(args.src)
    write_table(rows)
    bad = [r for r in rows if r[-1].startswith("!!")]
    for r in bad:
        print(f"{r[0]}: `{r[1]}` -> {r[2]}:{r[3]}-{r[4]}: {r[-1][3:]}", file=sys.stderr)
    print(f"{TABLE.relative_to(ROOT)}: {len(rows)} citations, {len(bad)} that do not land")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

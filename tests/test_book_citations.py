"""The book's Megatron citations and their committed table (book/megatron_citations.tsv) agree,
and with TINYTRON_MEGATRON_SRC (a Megatron-LM tree at e03878b5f) the table is what the source holds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "book"))
try:
    import citations
finally:
    sys.path.pop(0)

REGENERATE = "python3 book/citations.py --src <Megatron-LM at e03878b5f>"


def _keyed(rows):
    return {tuple(r[:5]): r[5] for r in rows}


def test_every_citation_of_the_book_is_in_the_table():
    table = _keyed(citations.read_table())
    found = {(p, c, path, str(a), str(b)) for p, c, path, a, b in citations.extract()}
    missing = sorted(found - table.keys())
    stale = sorted(table.keys() - found)
    assert not missing, (f"{len(missing)} citations are not in {citations.TABLE.name} "
                         f"(first: {missing[0]}); rewrite it: {REGENERATE}")
    assert not stale, (f"{len(stale)} rows of {citations.TABLE.name} are cited nowhere "
                       f"(first: {stale[0]}); rewrite it: {REGENERATE}")


def test_every_citation_lands_on_a_line_of_the_source():
    bad = [r for r in citations.read_table() if r[5].startswith("!!")]
    assert not bad, "\n".join(f"{r[0]}: `{r[1]}` -> {r[2]}:{r[3]}-{r[4]}: {r[5][3:]}" for r in bad)


def test_the_table_resolves_bare_names_and_continuations(tmp_path):
    """A file name cited in full elsewhere and a `:N` after it resolve; a new paragraph resets."""
    docs = tmp_path / "chapters"
    (docs / "01_x").mkdir(parents=True)
    (docs / "01_x" / "page.py").write_text(
        "# %% [markdown]\n# See `megatron/core/pipeline_parallel/schedules.py:10` and `:12-14`.\n"
        "#\n# Again `schedules.py:20`; `:7` below a blank line stays text.\n#\n# `:8`\n"
        "# %%\nx = 1  # the loop (training.py:99): a comment citation of an uncited file stays text\n"
        "y = 2  # schedules.py:30\n", encoding="utf-8")
    got = sorted(citations.extract(docs))
    full = "megatron/core/pipeline_parallel/schedules.py"
    assert got == [("01_x/page.py", ":12-14", full, 12, 14), ("01_x/page.py", ":7", full, 7, 7),
                   ("01_x/page.py", "megatron/core/pipeline_parallel/schedules.py:10", full, 10, 10),
                   ("01_x/page.py", "schedules.py:20", full, 20, 20),
                   ("01_x/page.py", "schedules.py:30", full, 30, 30)]


def test_a_citation_past_the_end_of_a_file_or_of_a_missing_file_is_caught(tmp_path):
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "a.py").write_text("one\ntwo\n")
    assert citations.source_text(tmp_path, "megatron/a.py", 2, 2) == "two"
    assert citations.source_text(tmp_path, "megatron/a.py", 1, 2) == "one ⟶ two"
    assert citations.source_text(tmp_path, "megatron/a.py", 2, 3).startswith("!! past the end")
    assert citations.source_text(tmp_path, "megatron/b.py", 1, 1) == "!! no such file"


@pytest.mark.skipif("TINYTRON_MEGATRON_SRC" not in os.environ,
                    reason="set TINYTRON_MEGATRON_SRC to a Megatron-LM tree at e03878b5f")
def test_the_table_is_what_the_source_holds():
    src = Path(os.environ["TINYTRON_MEGATRON_SRC"])
    table = _keyed(citations.read_table())
    derived = _keyed(citations.build_rows(src))
    differ = sorted(k for k in table if derived.get(k) != table[k])
    assert not differ, (f"{len(differ)} rows differ from {src} (first: {differ[0]}: "
                        f"table {table[differ[0]]!r}, source {derived.get(differ[0])!r})")

"""The front page's chapter table opens each chapter at its first page (`__pages__[0]`), and
chapter 01 opens with the loop, the pages after it taking its parts apart."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

CHAPTERS = ROOT / "chapters"


def _pages(folder: str) -> list[str]:
    tree = ast.parse((CHAPTERS / folder / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__pages__":
            return ast.literal_eval(node.value)
    raise AssertionError(f"{folder} has no __pages__")


def test_front_page_links_each_chapter_at_its_first_page():
    rows = re.findall(r"^\| \[[^]]+\]\(([\w]+)/(\w+)\.py\) \|", (CHAPTERS / "index.md").read_text(),
                      flags=re.M)
    assert len(rows) >= 12
    wrong = [f"{folder}/{page}.py (first page: {_pages(folder)[0]})" for folder, page in rows
             if page != _pages(folder)[0]]
    assert not wrong, wrong


def test_chapter_01_opens_with_the_loop():
    pages = _pages("01_main_loop")
    assert pages[0] == "loop"
    assert pages.index("schedules") < pages.index("interleaved") < pages.index("schedule_timeline")

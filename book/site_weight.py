"""The weight of the built site: HTML bytes per page, and the bytes one cold visit fetches.

    python book/site_weight.py site/ [PAGE ...]

prints the site's HTML total, the lightest and heaviest page, and for each PAGE (an address
under the site, `07_memory/ledger/`; the front page when none is given) the bytes a first
visit with an empty cache fetches: the page, every stylesheet and script it links from the
site, and the search index and worker that the theme loads on every page. Files are counted
as stored (the test server sends them uncompressed).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_LINKED = re.compile(r'<(?:script|link)\b[^>]*?(?:src|href)="([^"#?]+)[^"]*"[^>]*>')
_SEARCH_WORKER = re.compile(r'"search":\s*"([^"]+)"')


def page_weights(site: Path) -> dict[str, int]:
    """Bytes of each page's HTML, by its address under the site."""
    return {(str(p.parent.relative_to(site)) + "/" if p.parent != site else ""): p.stat().st_size
            for p in sorted(site.rglob("index.html"))}


def cold_visit(site: Path, address: str) -> dict[str, int]:
    """Bytes of each site file a first visit to `address` fetches (the page itself included)."""
    page = site / address / "index.html"
    html = page.read_text(encoding="utf-8")
    fetched = {str(page.relative_to(site)): page.stat().st_size}
    for href in _LINKED.findall(html):
        if re.match(r"[a-z]+:", href) or not href.endswith((".css", ".js")):
            continue
        target = (page.parent / href).resolve()
        if target.is_file():
            fetched[str(target.relative_to(site.resolve()))] = target.stat().st_size
    config = re.search(r'<script id="__config"[^>]*>(.*?)</script>', html, re.S)
    if config and (worker := _SEARCH_WORKER.search(config.group(1))):
        base = json.loads(config.group(1)).get("base", ".")
        for path in (worker.group(1), "search/search_index.json"):
            target = (page.parent / base / path).resolve() if path.startswith("search/") \
                else (page.parent / path).resolve()
            if target.is_file():
                fetched[str(target.relative_to(site.resolve()))] = target.stat().st_size
    return fetched


def main(argv: list[str]) -> None:
    site, addresses = Path(argv[0]), argv[1:] or [""]
    weights = page_weights(site)
    light, heavy = min(weights, key=weights.get), max(weights, key=weights.get)
    print(f"{len(weights)} pages, {sum(weights.values()) / 1e6:.1f} MB of HTML; lightest "
          f"/{light} {weights[light] / 1e6:.3f} MB, heaviest /{heavy} {weights[heavy] / 1e6:.3f} MB")
    for address in addresses:
        files = cold_visit(site, address)
        big = sorted(files.items(), key=lambda kv: -kv[1])[:4]
        print(f"cold visit of /{address}: {sum(files.values()) / 1e6:.2f} MB in {len(files)} files "
              f"(largest: {', '.join(f'{k} {v / 1e6:.2f}' for k, v in big)})")


if __name__ == "__main__":
    main(sys.argv[1:])

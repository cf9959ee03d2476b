"""`--data-path` parsing for chapter 04's blend page, out of its way (not a page)."""

from __future__ import annotations

import os
from typing import Optional


def parse_data_path(args) -> tuple[list[str], Optional[list[float]]]:
    """Megatron's `--data-path`: `p1 p2 ...` or `w1 p1 w2 p2 ...` -> (prefixes, weights or None).

    Example::

        parse_data_path("0.3 data/wiki_text_document 0.7 data/code_text_document")
        # -> (['data/wiki_text_document', 'data/code_text_document'], [0.3, 0.7])
    """
    # one string is split on whitespace, as the shell splits Megatron's command line
    args = str(args).split() if isinstance(args, (str, os.PathLike)) else [str(a) for a in args]
    if not args:
        raise ValueError("--data-path is empty")
    if len(args) == 1:
        return args, None

    def is_number(s):
        try:
            float(s)
            return True
        except ValueError:
            return False

    if not is_number(args[0]):
        if any(is_number(a) for a in args):
            raise ValueError(f"--data-path mixes weights and paths: {args}")
        return args, None
    if len(args) % 2 or not all(is_number(w) for w in args[0::2]):
        raise ValueError(f"--data-path with weights needs 'w1 p1 w2 p2 ...' pairs, got {args}")
    weights, prefixes = [float(w) for w in args[0::2]], args[1::2]
    bad = [p for p in prefixes if is_number(p)]
    if bad:
        raise ValueError(f"--data-path expected paths at odd positions, got numbers {bad}")
    return prefixes, weights


def path_list(name: str, value) -> Optional[list]:
    """None, or the list of words of a path argument (a string is split on whitespace)."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value).split()
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike, int, float))
                                                and not isinstance(v, bool) for v in value):
        return [v if isinstance(v, (int, float)) else os.fspath(v) for v in value]
    raise ValueError(f"DataConfig.{name} must be a string or a list of prefixes (and weights), "
                     f"got {value!r}")

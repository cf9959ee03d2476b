"""The blend's cache identity, cache files and size check (chapter 04's blend page; not a page).

A `BlendedDataset`'s two index arrays are saved under a key built from its own description
(class, split, weights, size) and its components' keys, which include their data; rank 0 writes
them atomically, every other rank (and every later run) loads them.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from tinytron.data.gpt_dataset import _is_rank_zero, _save_atomic


def describe(blend, weights, size) -> tuple[str, str]:
    """(unique_description, its md5): what the cached tables depend on."""
    ident = {"class": type(blend).__name__, "split": blend.split.name, "weights": weights,
             "size": size, "datasets": [d.unique_description_hash for d in blend.datasets]}
    description = json.dumps(ident, indent=4)
    return description, hashlib.md5(description.encode()).hexdigest()


def load_or_build(blend, build) -> tuple:
    """Cached index arrays, or `build()` them (rank 0 saves)."""
    root = blend.config.path_to_cache
    if root is None:
        return build()
    base = os.path.join(root, f"{blend.unique_description_hash}-{type(blend).__name__}-"
                              f"{blend.split.name}")
    paths = [f"{base}-dataset_index.npy", f"{base}-dataset_sample_index.npy",
             f"{base}-description.txt"]
    if all(os.path.isfile(p) for p in paths):
        return tuple(np.load(p, mmap_mode="r") for p in paths[:2])
    tables = build()
    if _is_rank_zero():
        os.makedirs(root, exist_ok=True)
        _save_atomic(paths[0], tables[0])
        _save_atomic(paths[1], tables[1])
        _save_atomic(paths[2], text=blend.unique_description)
    return tables


def check_sizes(blend) -> None:
    """Every component must hold the samples the blend asks of it."""
    used = np.bincount(np.asarray(blend.dataset_index, dtype=np.int64),
                       minlength=len(blend.datasets))
    for i, (n, d) in enumerate(zip(used, blend.datasets)):
        if n > len(d):
            raise ValueError(
                f"the {blend.split.name} blend asks dataset {i} ({d.dataset_path!r}) for {n} "
                f"samples but it has {len(d)}; raise mid_level_dataset_surplus "
                f"(now {blend.config.mid_level_dataset_surplus})")

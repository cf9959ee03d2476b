"""Where GPTDataset's three index tables are cached, and under which key.

The tables themselves are built on the page `chapters/04_data/gpt_indices.py`; this module
holds the bookkeeping around them: the description whose md5 names the cache files (Megatron's
`megatron/core/datasets/megatron_dataset.py:57-71`, plus the data's own identity), the file
names, the atomic writes, and the rule that only global rank 0 builds. `data_identity`,
`_save_atomic` and `_is_rank_zero` are re-exported from the page.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Optional

import numpy as np
import torch

from tinytron.data.indexed import get_bin_path, get_idx_path

__all__ = ["data_identity", "describe", "load_or_build"]

_TABLES = ("document_index", "sample_index", "shuffle_index")


def data_identity(path_prefix: str) -> dict:
    """File sizes and the .idx hash of a prefix: changes whenever the sequence lengths change."""
    idx, bin_ = get_idx_path(path_prefix), get_bin_path(path_prefix)
    st = os.stat(idx)
    return {"idx_blake2b": _idx_hash(idx, st.st_size, st.st_mtime_ns, st.st_ino),
            "idx_size": st.st_size, "bin_size": os.path.getsize(bin_)}


@functools.lru_cache(maxsize=256)
def _idx_hash(idx: str, size: int, mtime_ns: int, inode: int) -> str:
    """BLAKE2 of the .idx, memoised per file version (one read per process, not per split)."""
    h = hashlib.blake2b(digest_size=16)
    with open(idx, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def describe(ds) -> None:
    """Set ds.unique_identifiers, its JSON description and the md5 that names the cache."""
    config, indices = ds.config, ds.indices
    ds.unique_identifiers = {
        "class": type(ds).__name__, "dataset_path": ds.dataset_path, "num_samples": ds.num_samples,
        "index_split": ds.index_split.name, "random_seed": config.random_seed,
        "sequence_length": config.sequence_length, "split": config.split,
        "split_matrix": config.split_matrix, "eod_id": config.eod_id,
        "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
        "drop_last_partial_validation_sequence": config.drop_last_partial_validation_sequence,
        "first_index": int(indices[0]) if len(indices) else None,
        "num_indices": len(indices),
        "data": data_identity(ds.dataset_path) if ds.dataset_path else None,
    }
    ds.unique_description = json.dumps(ds.unique_identifiers, indent=4)
    ds.unique_description_hash = hashlib.md5(ds.unique_description.encode()).hexdigest()


def _cache_paths(ds) -> Optional[dict]:
    """The four cache file paths, or None when caching is impossible."""
    root = ds.config.path_to_cache
    if root is None and ds.dataset_path:
        root = os.path.join(ds.dataset_path, "cache", f"{type(ds).__name__}_indices")
    if root is None:
        return None
    base = f"{ds.unique_description_hash}-{type(ds).__name__}-{ds.index_split.name}"
    return {a: os.path.join(root, f"{base}-{a}{'.txt' if a == 'description' else '.npy'}")
            for a in ("description",) + _TABLES}


def load_or_build(ds, build):
    """Load cached tables (mmap) or build them with `build()` on rank 0 and save them."""
    paths = _cache_paths(ds)
    hit = paths is not None and all(os.path.isfile(p) for p in paths.values())
    if paths is None or (not hit and _is_rank_zero()):
        tables = build()
        if paths is not None:
            os.makedirs(os.path.dirname(paths["description"]), exist_ok=True)
            for name, arr in zip(_TABLES, tables):
                _save_atomic(paths[name], arr)
            _save_atomic(paths["description"], text=ds.unique_description)
        return tables
    if not hit:
        raise FileNotFoundError(f"{paths['description']}: index cache missing on a non-zero "
                                "rank; build the dataset on rank 0 first (barrier)")
    ds.cache_hit = True
    return tuple(np.load(paths[name], mmap_mode="r").view(np.ndarray) for name in _TABLES)


def _save_atomic(path: str, array: Optional[np.ndarray] = None, text: Optional[str] = None) -> None:
    """Write one cache file under a temporary name, then rename it into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        if text is not None:
            f.write(text.encode())
        else:
            np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def _is_rank_zero() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
        or torch.distributed.get_rank() == 0

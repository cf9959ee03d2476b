"""The `.bin`/`.idx` consistency checks of chapter 04's indexed page, out of its way (not a page).

Each check raises `IndexedDatasetError` (a `ValueError`) naming the file and the problem; the
page lists what is checked and why.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair that cannot be read: the message names the file and the problem."""


IndexedDatasetError.__module__ = "tinytron.data.indexed"  # its public home, which re-exports it


def _error(message: str) -> Exception:
    return IndexedDatasetError(message)


def check_files(idx_path: str, bin_path: str, header_bytes: int) -> None:
    """Both files exist and the index is at least as long as its fixed header."""
    for p in (idx_path, bin_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: missing (an IndexedDataset needs both "
                                    f"{Path(bin_path).name} and {Path(idx_path).name})")
    if os.path.getsize(idx_path) < header_bytes:
        raise _error(f"{idx_path}: truncated index, {os.path.getsize(idx_path)} "
                     f"bytes is shorter than the {header_bytes}-byte header")


def check_dtype(idx_path: str, dtype, dtype_code, dtype_codes) -> None:
    """The index's dtype is the one the caller expects (when it says which)."""
    if dtype_code is not None and dtype_codes.dtype_from_code(dtype_code) != dtype:
        raise _error(
            f"{idx_path}: dtype mismatch, the index holds {np.dtype(dtype).name} "
            f"(code {dtype_codes.code_from_dtype(dtype)}) but code {dtype_code} "
            f"({np.dtype(dtype_codes.dtype_from_code(dtype_code)).name}) was expected")


def check_index_size(idx_path: str, size: int, need: int, n: int, d: int,
                     multimodal: bool) -> None:
    """The index is exactly as long as its header's counts say (plus N mode bytes if multimodal)."""
    allowed = (need + n,) if multimodal else (need,)
    if size not in allowed:
        what = "truncated" if size < allowed[0] else "oversized"
        raise _error(f"{idx_path}: {what} index, {size} bytes but the header "
                     f"declares N={n}, D+1={d} -> {allowed[0]} bytes")


def check_tables(idx_path, lengths, pointers, docs, itemsize, block: int) -> None:
    """Consistency of lengths, pointers and document indices."""
    n = len(lengths)
    if len(docs) == 0 or docs[0] != 0 or docs[-1] != n:
        first, last = (docs[0], docs[-1]) if len(docs) else (None, None)
        raise _error(f"{idx_path}: inconsistent document indices (first {first}, "
                     f"last {last}); expected first 0 and last {n} = sequence count")
    if np.any(np.diff(docs) < 0):
        raise _error(f"{idx_path}: document indices decrease")
    if n and lengths.min() < 0:
        raise _error(f"{idx_path}: negative sequence length {lengths.min()}")
    start = 0  # pointers must be the running byte sum of the lengths; checked in blocks so a
    for lo in range(0, n, block):  # 100M-sequence index needs no 800 MB temporary
        part = lengths[lo:lo + block].astype(np.int64) * itemsize
        expected = start + np.cumsum(part) - part
        bad = np.flatnonzero(expected != pointers[lo:lo + block])
        if bad.size:
            i = lo + int(bad[0])
            raise _error(f"{idx_path}: inconsistent pointer for sequence {i}: "
                         f"{pointers[i]} bytes, lengths say {expected[bad[0]]}")
        start = int(expected[-1] + part[-1])


def check_bin_size(bin_path: str, lengths, pointers, itemsize: int) -> int:
    """The `.bin` is exactly as long as the index says; its size in bytes."""
    n = len(lengths)
    expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if n else 0
    actual = os.path.getsize(bin_path)
    if actual != expected:
        what = "shorter" if actual < expected else "longer"
        raise _error(f"{bin_path}: data file is {actual} bytes, {what} than the "
                     f"{expected} bytes its index says (truncated or mismatched pair)")
    return actual


def as_tokens(tokens, dtype) -> np.ndarray:
    """A 1-D array in the builder's dtype (lists, numpy arrays, torch tensors); ids must fit it."""
    if hasattr(tokens, "numpy"):
        tokens = tokens.numpy()
    arr = np.asarray(tokens).reshape(-1)
    target = np.dtype(dtype)
    if arr.dtype.kind in "USO":   # ids as text ("12"): numpy parses them, as megatron-core's
        try:                      # np.array(tokens, dtype=...) does; anything else is refused
            arr = arr.astype(np.int64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tokens: not integer token ids ({e})") from e
    if arr.size and arr.dtype != target and target.kind in "iu":
        # numpy's cast wraps around: 70000 -> 4464 and -1 -> 65535 in uint16, without a word
        info = np.iinfo(target)
        bad = arr[(arr < info.min) | (arr > info.max) | (arr != np.round(arr))] \
            if arr.dtype.kind == "f" else arr[(arr < info.min) | (arr > info.max)]
        if bad.size:
            raise ValueError(f"token id {bad[0].item()} does not fit the builder's dtype "
                             f"{target.name} (ids {info.min}..{info.max})")
    return np.ascontiguousarray(arr, dtype=dtype)

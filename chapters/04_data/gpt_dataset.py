# %% [markdown]
# # 04 · Data: GPTDataset and its three index tables
#
# How Megatron turns a pile of variable-length sequences into a fixed, shuffled list of
# `seq_length + 1`-token windows — the same windows in the same order as Megatron, built with a
# few numpy calls instead of a C++ extension, cached on disk and keyed on the data itself.
#
# Why three tables instead of one list of windows: a corpus of a trillion tokens read as
# 4,097-token windows is about 244 million samples, and each must be found in constant time, in
# a shuffled order that every data-parallel rank agrees on, and again after a restart at sample
# 1,000,000 without replaying the first million. Materializing the windows would copy the
# corpus; instead three small integer arrays say where each window lives in the `.bin`, and a
# sample is a lookup. They are:
#
# * the **document index**: which sequence comes next in the stream, epoch after epoch, shuffled;
# * the **sample index**: where in that stream each window starts (a position in the document
#   index and a token offset in that sequence);
# * the **shuffle index**: in which order the windows are handed out.
#
# A sample is three lookups, the last table first:
#
# ```mermaid
# flowchart TB
#   I["sample i"] -->|"shuffle_index[i]"| J["window j"]
#   J -->|"sample_index[j], sample_index[j + 1]"| P["(position, offset) where it starts<br/>and where it ends"]
#   P -->|"document_index[position]"| D["which sequences of the .bin,<br/>and where in them"]
#   D -->|"read and concatenate"| W["seq_length + 1 tokens"]
# ```
#
# ### Three documents, worked by hand
#
# Take a split of 3 sequences of lengths 5, 3 and 4 ($T = 12$ tokens per epoch), windows of
# $L = 3$ tokens (each reads $L + 1 = 4$) and $S = 4$ samples asked for, seed 1234.
#
# *Epochs.* Four samples read $4 \cdot 3 + 1 = 13$ tokens, more than 12, so $E = 2$ passes. Of
# the second pass only one sample is needed: the first pass gives $(12 - 1)//3 = 3$ samples, so
# $S_{last} = 4 - 3 = 1 < \lfloor 0.8 \cdot 3 \rfloor = 2$, and the second epoch is shuffled
# apart from the first (the 80% rule below).
#
# *Document index.* Each epoch is `[0, 1, 2]` shuffled by `RandomState(1234)`, the first epoch
# and then the second from the same stream: `[0, 1, 2 | 1, 2, 0]`. In that order the lengths are
# 5, 3, 4, 3, 4, 5, so position $j$ starts at token $c_j$ = 0, 5, 8, 12, 15, 19 (and 24 ends).
#
# *Sample index.* Both epochs hold 24 tokens, so $(24 - 1)//3 = 7$ windows, starting at tokens
# 0, 3, 6, ..., 21 — more than the 4 asked for, because the tables cover whole epochs. Token 6
# lies in position 1 (5 ≤ 6 < 8) at offset 1, token 21 in position 5 at offset 2:
#
# | row | start token | (position, offset) | | row | start token | (position, offset) |
# |---|---|---|---|---|---|---|
# | 0 | 0 | (0, 0) | | 4 | 12 | (3, 0) |
# | 1 | 3 | (0, 3) | | 5 | 15 | (4, 0) |
# | 2 | 6 | (1, 1) | | 6 | 18 | (4, 3) |
# | 3 | 9 | (2, 1) | | 7 | 21 | (5, 2) |
#
# *Shuffle index.* The 3 windows of the first epoch are shuffled among themselves, the 4 of the
# separate last epoch among themselves, from the same stream after the document shuffles:
# `[2, 1, 0 | 3, 5, 4, 6]`. So step 0 reads window 2, rows 2 and 3: the last 2 tokens of
# sequence 1 (offsets 1, 2) and the first 2 of sequence 2 — 4 tokens, the inputs of the first
# 3 and the labels of the last 3. The first $S = 4$ steps read windows 2, 1, 0 and 3, all of the
# first epoch but one: the partial epoch does not leak into the first steps. The demo below
# checks every one of these numbers.

# %%
from __future__ import annotations

import math
import numbers
import os
import re
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import numpy as np
import torch

from tinytron._fields import check_fields, check_range, document_fields
from tinytron.data._dataset_cache import (_is_rank_zero, _save_atomic,  # noqa: F401 (re-exported)
                                          data_identity, describe, load_or_build)
from tinytron.data.indexed import IndexedDataset
from tinytron.overview.batch import PAD_SENTINEL, get_ltor_masks_and_position_ids, mask_padding

__all__ = [
    "Split", "parse_and_normalize_split", "convert_split_vector_to_split_matrix", "split_indices",
    "GPTDatasetConfig", "checked_blend", "get_num_epochs", "needs_separate_final_epoch",
    "build_document_index", "build_sample_index", "build_sample_index_loop", "build_shuffle_index",
    "shuffle_index_dtype", "build_document_sample_shuffle_indices",
    "data_identity", "GPTDataset",
]

# %% [markdown]
# ## Splits
#
# `--split 969,30,1` (any separator: Megatron reads the numbers with `re.findall(r"[.0-9]+")`,
# so `90/5/5` and `90 5 5` mean the same) is normalized to weights and turned into book-ends
# $[(0, .969), (.969, .999), (.999, 1)]$; a dataset of $n$ sequences gives split $i$ the
# sequence ids `arange(round(lo·n), round(hi·n))` — the unit is the *sequence* (for GPT one
# sequence per document). A zero weight gives `None`, no split at all
# (`megatron/core/datasets/blended_megatron_dataset_config.py:155-215`,
# `megatron/core/datasets/blended_megatron_dataset_builder.py:470`).
#
# Why the split is over sequences, not tokens or samples: the validation set must hold text the
# model never trained on. Cutting by sequence id, before any window is made, means no window of
# the validation split can share a token with a training window; cutting the shuffled samples
# instead would put the two halves of one document on both sides. With `969,30,1` and 1,000
# sequences, train gets ids 0..968, validation 969..998 and test 999.

# %%
class Split(Enum):
    """The three splits, in Megatron's order."""

    train = 0
    valid = 1
    test = 2


def parse_and_normalize_split(split: str) -> list[float]:
    """'99,1,0' (or '99/1/0', '99 1 0') -> [0.99, 0.01, 0.0]."""
    if not isinstance(split, str):
        raise ValueError(f"split must be a string such as '969,30,1', got {split!r}")
    try:
        parts = [float(x) for x in re.findall(r"[.0-9]+", split) if x.strip(".")]
    except ValueError:  # '1.2.3'
        parts = []
    # Megatron's pattern would silently read '-1' as 1: a minus sign is refused instead
    if not parts or len(parts) > 3 or re.search(r"-\s*[.0-9]", split) or sum(parts) <= 0:
        raise ValueError(f"split {split!r} must be up to three non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    total = float(np.sum(np.array(parts, dtype=np.float64)))
    return (np.array(parts, dtype=np.float64) / total).tolist()


def convert_split_vector_to_split_matrix(vector: list[float]) -> list[Optional[tuple]]:
    """Cumulative book-ends per split; None for an empty split."""
    ends = [0.0]
    for w in vector:
        ends.append(ends[-1] + w)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(ends[:-1], ends[1:])]


def split_indices(bookends: Optional[tuple], num_elements: int) -> Optional[np.ndarray]:
    """The sequence ids of one split (int32)."""
    if bookends is None:
        return None
    beg = int(round(bookends[0] * float(num_elements)))
    end = int(round(bookends[1] * float(num_elements)))
    return np.arange(beg, end, dtype=np.int32)

# %% [markdown]
# A blend is a pair: the dataset prefixes and their weights (or None for equal shares by size).
# It is checked here, once, so that a wrong shape names the field instead of failing inside the
# builder.

# %%
def checked_blend(blend, name: str = "blend") -> tuple:
    """(prefixes as str, weights or None); ValueError naming `name` for any other shape."""
    if not isinstance(blend, (tuple, list)) or len(blend) != 2:
        raise ValueError(f"{name} must be a (prefixes, weights or None) pair, got {blend!r}")
    prefixes, weights = blend
    if (isinstance(prefixes, (str, os.PathLike)) or not isinstance(prefixes, (list, tuple))
            or not prefixes or not all(isinstance(p, (str, os.PathLike)) for p in prefixes)):
        raise ValueError(f"{name}[0] must be a non-empty list of path prefixes, got {prefixes!r}")
    prefixes = [os.fspath(p) for p in prefixes]
    if weights is None:
        return prefixes, None
    if not isinstance(weights, (list, tuple)) or len(weights) != len(prefixes):
        raise ValueError(f"{name}[1] must be None or one weight per prefix ({len(prefixes)}), "
                         f"got {weights!r}")
    if (not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and w >= 0 for w in weights)
            or sum(weights) <= 0):
        raise ValueError(f"{name}[1] must be non-negative numbers with a positive sum, got {weights!r}")
    return prefixes, [float(w) for w in weights]


# %% [markdown]
# The config holds either one blend cut by `split` or one blend per split, never both. This
# check runs when a config is made, and puts each blend through `checked_blend` with its name.

# %%
def _check_blends(cfg) -> None:
    """Either `blend` or `blend_per_split` (3 blends or None), each checked; normalized in place."""
    if cfg.blend is not None and cfg.blend_per_split is not None:
        raise ValueError("give either blend (with split) or blend_per_split, not both")
    if cfg.blend is not None:
        cfg.blend = checked_blend(cfg.blend, "blend")
    if cfg.blend_per_split is not None:
        if not isinstance(cfg.blend_per_split, (list, tuple)) or len(cfg.blend_per_split) != 3:
            raise ValueError("blend_per_split must list 3 blends (train, valid, test; None for "
                             f"none), got {cfg.blend_per_split!r}")
        cfg.blend_per_split = [None if b is None else checked_blend(b, f"blend_per_split[{i}]")
                               for i, b in enumerate(cfg.blend_per_split)]

# %% [markdown]
# ## How many epochs, and the separate final epoch
#
# A split holds $T$ tokens. $S$ samples of $L$ tokens, plus the one extra token the last sample
# reads, need $E$ passes over the data: the smallest $E \ge 1$ with $E\cdot T \ge S\cdot L + 1$
# (`_get_num_epochs`, `gpt_dataset.py:617`, a loop there, a ceiling here).
#
# If the last epoch is only partly used, shuffling all $E$ epochs together would let its
# sequences land anywhere and over-represent the documents of that partial pass early on. So
# when the samples drawn from the final epoch are fewer than 80% of a full epoch's samples,
# that epoch is shuffled separately and appended (`gpt_dataset.py:453-494`).
#
# Worked example: $T = 100$, $L = 10$, $S = 12$: $E = 2$ ($200 \ge 121$);
# $S_{prev} = (100 - 1)//10 = 9$, $S_{last} = 3$, $S_{epoch} = 9$; $3 < \lfloor 0.8\cdot 9\rfloor = 7$
# so the second epoch is kept apart.
#
# Why $+1$: with `add_extra_token_to_sequence` each window reads $L + 1$ tokens, so that the
# inputs are tokens $0..L-1$ and the labels tokens $1..L$ of the same window, with no label
# missing at the end. Consecutive windows share that one token (the last label of one is the
# first input of the next), so $S$ windows cover $S L + 1$ tokens, not $S (L + 1)$. An empty
# split asked for samples would need infinitely many epochs; tinytron stops with a one-line
# error naming the dataset and the split.
#
# <details><summary>Megatron detail: an empty split</summary>
#
# Megatron's loop never ends there.
#
# </details>

# %%
def get_num_epochs(tokens_per_epoch: int, num_samples: Optional[int], seq_length: int,
                   extra: int = 1, what: str = "dataset") -> int:
    """Smallest E >= 1 with E * tokens_per_epoch >= num_samples * seq_length + extra."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + extra
    if tokens_per_epoch <= extra and num_samples > 0:
        # Megatron's epoch loop never ends here (an empty split asked for samples).
        raise ValueError(f"{what} holds {tokens_per_epoch} tokens but {num_samples} samples of "
                         f"{seq_length} tokens were requested: the split is empty")
    return max(1, -(-needed // tokens_per_epoch))


def needs_separate_final_epoch(num_epochs: int, tokens_per_epoch: int, num_samples: int,
                               seq_length: int, extra: int = 1) -> tuple[bool, int]:
    """(separate?, samples before the final epoch) by the 80% rule."""
    if num_epochs == 1:
        return False, 0
    before_last = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - extra) // seq_length
    assert 0 <= from_last <= per_epoch + 1
    return from_last < int(0.80 * per_epoch), before_last

# %% [markdown]
# ## The document index and the shuffle index
#
# The document index is the split's sequence ids repeated $E$ times and shuffled with
# `numpy.random.RandomState(seed)`; the shuffle index is `arange(num_samples)` shuffled with the
# *same* generator, continuing its stream. The order of the draws is part of the format: first
# the document shuffle(s) (first $E-1$ epochs, then the last one when separate), then the sample
# shuffle(s) (`_build_document_index`, `:640`; `_build_shuffle_index`, `:674`). A permutation of
# $n$ items drawn by `RandomState.shuffle` depends only on $n$ and the stream, not on the dtype.
#
# That is why `shuffle_index_dtype` can pick the narrower type freely: a trillion-token corpus
# of 4,097-token windows has about 244 million samples, so a `uint32` shuffle index is about
# 0.98 GB where `int64` would be 1.95 GB, in every process that maps it, and only above
# $2^{32} - 2$ samples is `int64` needed (`gpt_dataset.py:693`).
#
# Why shuffle twice: the document shuffle mixes *which text* is next to which, so a window that
# spans a boundary joins two unrelated documents rather than two chapters of one book; the
# sample shuffle mixes *when* each window is seen, so consecutive steps are not consecutive
# text. Either alone leaves a pattern: documents shuffled but samples in order feed the model
# one document's windows in a row; samples shuffled but documents in order make every
# boundary window join the same two neighbors, epoch after epoch. Why numpy's legacy
# `RandomState` and not `default_rng`: the order of the draws and the generator are part of
# the format — the same seed must give the same arrays as Megatron's, bit for bit, or a run
# resumed from a Megatron checkpoint would see different data.

# %%
def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """The sequence ids tiled num_epochs times, shuffled (int32)."""
    if not separate_final_epoch or num_epochs == 1:
        doc_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(doc_index)
        return doc_index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def shuffle_index_dtype(total_size: int):
    """uint32, or int64 from 2**32 - 2 samples on (gpt_dataset.py:693)."""
    return np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """arange(total_size) with [0, num_samples) and [num_samples, total) shuffled separately."""
    dtype = shuffle_index_dtype(total_size)
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))

# %% [markdown]
# ## The sample index: the loop first
#
# Megatron's C++ (`helpers.cpp:145`) walks the shuffled sequences with a token budget of
# $L+1$ per sample and records where each sample starts: `(position in the document index,
# token offset in that sequence)`. Because every sample re-uses the last token of the previous
# one (the label of its last input), sample $k$ simply starts at token $kL$ of the
# concatenated stream. What the C++ records is the sequence holding the *boundary token*, the
# last token that sample $k-1$ reads: token $kL$ with the extra token, token $kL - 1$ without
# it; and the offset $kL - c_j$, where $c_j$ is the first token of position $j$.
#
# Worked example: lengths in document-index order `4, 3, 5` ($c = 0, 4, 7, 12$), $L = 3$:
# $(12-1)//3 = 3$ samples starting at tokens $0, 3, 6, 9$ → rows `(0,0) (0,3) (1,2) (2,2)`.
# Sample 1 reads tokens 3..6: the last token of sequence 0 and all of sequence 1.
#
# Two corner rules of the C++ are kept: row 0 is always `(0, 0)` (even when the first sequence
# is empty), and a partial last sample (validation only, when not dropped) ends at
# `(last position, len - 1)`. Without the extra token a sample that ends exactly at a sequence
# end is recorded as `(j, len_j)` rather than `(j+1, 0)`, because the boundary token is then
# the last token of $j$. An empty sequence never holds a boundary, so the walk steps over it.
#
# The loop below is that rule said once per sample: move on to the next sequence while the
# current one ends at or before the boundary, then record. It is the definition the fast
# version is tested against (identical arrays, in the tests and in the demo), and it is too
# slow to use: a Python step per sample and per sequence, about 0.11 s of CPU time per 50,000
# samples on one thread (measured on a prefix of `benchmarks/bench_data.py`'s corpus), so
# seconds for its million samples against the version below's milliseconds, and most of an
# hour at a billion. The C++ is this same walk, compiled.

# %%
def _num_samples(total: int, seq_length: int, drop_last: bool, extra: int) -> int:
    """Samples in the whole stream; a kept partial one rounds up through a float32 as the C++."""
    if drop_last:
        return (total - extra) // seq_length
    return math.ceil(float(np.float32(total - extra)) / seq_length)


def build_sample_index_loop(sizes, document_index, seq_length: int, num_epochs: int,
                            tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                            add_extra_token: int = 1) -> np.ndarray:
    """Naive first: the sample index one sample at a time (int64; build_sample_index's oracle)."""
    total = num_epochs * tokens_per_epoch
    num_samples = _num_samples(total, seq_length, drop_last_partial_sequence, add_extra_token)
    last, shift = len(document_index) - 1, 1 - add_extra_token
    rows, j, start = [], 0, 0  # j: position in the document index, start: its first token
    for k in range(num_samples + 1):
        boundary = k * seq_length - shift  # the last token sample k - 1 reads
        while j < last and start + int(sizes[document_index[j]]) <= boundary:
            start += int(sizes[document_index[j]])
            j += 1
        rows.append((j, k * seq_length - start))
    rows[0] = (0, 0)
    if num_samples * seq_length - shift > total - 1:  # the kept partial sample
        rows[-1] = (last, int(sizes[document_index[last]]) - add_extra_token)
    return np.array(rows, dtype=np.int64).reshape(-1, 2)

# %% [markdown]
# ### The same walk as two running sums
#
# Follow the two columns from sample to sample. The position goes up by one each time a
# sequence ends at or before the boundary; the offset goes up by $L$ every sample and comes
# down by the length of each sequence left behind. So both columns are running sums
# (`np.cumsum`) of a step array, and the only question is *at which sample* each sequence's
# step falls: sequence $j$ ends at token $e_j = c_{j+1}$, and the first sample whose boundary
# $kL - s$ ($s = 1$ without the extra token, else 0) reaches it is
# $f_j = \lceil (e_j + s) / L \rceil$, one integer division for all sequences at once.
#
# In the example, $e = 4, 7$ (the last sequence's end needs no step) give $f = 2, 3$. Position
# steps `[0, 0, 1, 1]` sum to `[0, 0, 1, 2]`; offset steps `[0, 3, 3-4, 3-3]` sum to
# `[0, 3, 2, 2]`: the four rows again. Several sequences can end before the same boundary (an
# empty one, or two shorter than $L$ in a row), so their steps are added with `np.add.at`,
# which sums repeated indices where plain `d[f] += x` would keep only one; a step that falls
# past the last sample goes to one spare slot at the end, cut off afterwards.
#
# The two sums become one. While the table is `int32` (positions and lengths below $2^{31}$,
# the usual case) each row is 8 bytes, the size of one `uint64`. Put the position step in the
# low 32 bits and the offset step in the high 32 bits of one `uint64` step and run one
# `cumsum`: unsigned sums wrap around modulo $2^{64}$, so the total is exactly
# $\text{position} + 2^{32}\cdot\text{offset}$ modulo $2^{64}$, whatever the partial sums
# carried on the way, and viewing the result as pairs of `int32` reads the two columns with
# no copy (on a big-endian machine the two halves swap, and the code swaps with them).
# Otherwise the two sums run separately in `int64`.
#
# Why this form, and pure numpy rather than a compiled helper: per sequence it is a gather of
# lengths, one `cumsum` and one division; per sample one fill, one in-place `cumsum`, and a
# scatter-add at the sequence ends, with no Python-level loop and few temporaries. On the
# benchmark's 1.07 million samples it takes 4–6.5 ms of CPU time where Megatron's compiled
# walk takes 5.7–7.3 ms (the [next page's](index_tables.py) summary has the measurement). A
# compiled helper of our own (Megatron compiles `helpers.cpp` with pybind11 on first use) would
# need a compiler on every machine that opens a dataset, and would have little left to win:
# the walk is a small part of the build (that summary again).
#
# <details><summary>Megatron detail: an earlier, slower form</summary>
#
# An earlier form of this
# page spread the positions with `np.repeat` and then gathered each sample's first token and
# wrote the two columns one by one: `np.repeat` alone took 3.4 ms and the whole function 2–3×
# the C++.
#
# </details>
#
# First the running sum itself: a step per sample, the jumps added at the samples where
# sequences end, one spare slot for the jumps past the last sample, one `cumsum`.

# %%
def _running_sum(n: int, step, at: np.ndarray, jumps, dtype) -> np.ndarray:
    """cumsum over n samples of `step` per sample after the first plus `jumps` at samples `at`."""
    d = np.full(n + 1, step, dtype=dtype)  # slot n: the spare for steps past the last sample
    d[0] = 0
    np.add.at(d, at, jumps)  # repeated samples add up
    return np.cumsum(d, out=d)[:n]


# %% [markdown]
# Then the table: $f_j$ for every sequence end, and the two columns as one packed `uint64` sum
# (or two `int64` sums when the numbers do not fit 32 bits).

# %%
def build_sample_index(sizes, document_index, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                       add_extra_token: int = 1) -> np.ndarray:
    """[(doc position, offset)] of every sample start: helpers.cpp build_sample_idx, vectorized."""
    total = num_epochs * tokens_per_epoch
    num_samples = _num_samples(total, seq_length, drop_last_partial_sequence, add_extra_token)
    sizes = np.asarray(sizes)
    num_docs, n, shift = len(document_index), num_samples + 1, 1 - add_extra_token
    lengths = np.take(sizes, document_index).astype(np.int64)  # (cumsum(dtype=) casts slowly)
    last_length = int(lengths[-1])
    first = np.cumsum(lengths)  # each sequence's end ...
    assert first[-1] == total, (first[-1], total)
    first += shift + seq_length - 1
    first //= seq_length  # ... then f_j, the first sample whose boundary lies past it
    np.minimum(first, n, out=first)  # steps past the last sample land in the spare slot n
    at = first[:-1]
    if max(num_docs, int(sizes.max()) if len(sizes) else 0) > np.iinfo(np.int32).max:
        out = np.empty((n, 2), dtype=np.int64)
        out[:, 0] = _running_sum(n, 0, at, 1, np.int64)
        out[:, 1] = _running_sum(n, seq_length, at, -lengths[:-1], np.int64)
    else:  # one uint64 sum: the position in one 32-bit half, the offset in the other
        pos, off = np.uint64(0), np.uint64(32)  # int32 pairs read the low half first ...
        if sys.byteorder == "big":
            pos, off = off, pos  # ... on a little-endian machine
        steps = lengths.view(np.uint64)  # in place: one array fewer to allocate and fill
        steps <<= off
        np.subtract(np.uint64(1) << pos, steps, out=steps)  # +1 position, -length offset
        packed = _running_sum(n, np.uint64(seq_length) << off, at, steps[:-1], np.uint64)
        out = packed.view(np.int32).reshape(n, 2)
    if num_samples * seq_length - shift > total - 1:  # the kept partial sample: the last row
        out[-1] = (num_docs - 1, last_length - add_extra_token)
    out[0] = (0, 0)
    return out

# %% [markdown]
# Checked against the loop above (`tests/test_data_gpt.py`, random corpora with empty
# sequences, both extra-token settings and the kept partial sample), against a step-by-step
# Python transcription of the C++ (`_reference.py`), against Megatron's own compiled
# `helpers.cpp` (`tests/test_data_megatron_helpers.py`: identical arrays in hundreds of random
# corpora, and in `benchmarks/bench_data.py` at a million samples), and end to end against
# Megatron's own `GPTDataset` and `BlendedDataset` (`tests/test_data_megatron_compat.py`: the
# same tokens, labels, masks and positions for every sample of every split, blends included).

# %% [markdown]
# The three builders together, in the order that fixes the random stream: count the epochs,
# decide on the separate final epoch, then one `RandomState(seed)` draws the document
# shuffle(s) first and the sample shuffle(s) after, with the sample index (which draws nothing)
# built between them (`_build_document_sample_shuffle_indices`, `gpt_dataset.py:381`). Swap
# two of these calls and every table is still a valid permutation — and none of them is
# Megatron's any more, which only the parity tests would notice. For the three-document example
# this function returns exactly the arrays of the tables at the top of the page.

# %%
def build_document_sample_shuffle_indices(sizes: np.ndarray, documents: np.ndarray,
                                          num_samples: Optional[int], seq_length: int,
                                          seed: int = 1234, add_extra_token: int = 1,
                                          drop_last_partial_sequence: bool = True,
                                          what: str = "dataset"):
    """The three tables of gpt_dataset.py:381, in Megatron's RNG stream order."""
    tokens_per_epoch = int(np.asarray(sizes)[documents].sum(dtype=np.int64))
    num_epochs = get_num_epochs(tokens_per_epoch, num_samples, seq_length, add_extra_token, what)
    if tokens_per_epoch <= add_extra_token:
        raise ValueError(f"{what} holds {tokens_per_epoch} tokens: too few for one sample")
    separate, before_last = (needs_separate_final_epoch(num_epochs, tokens_per_epoch, num_samples,
                                                        seq_length, add_extra_token)
                             if num_samples is not None else (False, 0))
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(np.asarray(sizes), document_index, seq_length, num_epochs,
                                      tokens_per_epoch, drop_last_partial_sequence, add_extra_token)
    n = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before_last if separate else n, n, rng)
    return document_index, sample_index, shuffle_index

# %% [markdown]
# ## A cache key that notices new data
#
# The tables are saved as `.npy` files named by the md5 of a JSON description
# (`megatron/core/datasets/megatron_dataset.py:57-71`). Megatron's description holds the dataset
# *path*, the sample count and the config, but nothing about the file contents: re-run
# preprocessing into the same prefix and training silently uses stale indices (wrong windows, or
# reads past the end). Ours adds the data's identity: the `.bin` and `.idx` sizes and a BLAKE2
# hash of the `.idx` (small: 12 bytes per sequence). The three tables depend on the data only
# through the sequence lengths, which the `.idx` holds, so this key changes exactly when the
# cached tables would be wrong. Modification times are deliberately left out: two byte-identical
# copies of a dataset (one per node, or restored from a backup) must share one cache, and a
# `touch` must not trigger a rebuild.
#
# Files are written to temporary names and renamed, the description last, so a reader that sees
# the description sees complete arrays. With `torch.distributed` initialized only global rank 0
# builds; the others wait at a barrier and memory-map the files (`gpt_dataset.py:441-551`).
#
# Why cache at all: building the tables is a shuffle of every sequence id and a pass over every
# sample, seconds to minutes for a large corpus, and it would otherwise run again on every
# restart and in every process that opens the dataset. Loading is `np.load(mmap_mode="r")`:
# no copy, so eight processes on one node share one page cache. Why rank 0 alone builds: two
# ranks writing the same file at once could leave one rank reading the other's half-written
# array; with one writer, temporary names and the description renamed last, a reader either
# sees all four files complete or goes on waiting. A rank that finds no cache and is not rank
# 0 was not made to wait, and stops with an error that says so rather than build its own copy.

# %% [markdown]
# That bookkeeping — the description, its md5, the four file names, the writes under temporary
# names and the rank-0 rule — is in `tinytron.data._dataset_cache`; the class below calls its
# `describe` and `load_or_build`, and `data_identity` is importable from this page.
#
# What the key looks like, for the 3-document corpus of the worked example below: the
# description is a JSON object of 14 fields, among them `"num_samples": 4`,
# `"sequence_length": 3`, `"random_seed": 1234`, `"index_split": "train"`, `"num_indices": 3`
# and `"data": {"idx_blake2b": ..., "idx_size": ..., "bin_size": ...}`; its md5 (32 hex digits)
# starts every file name, as in `<md5>-GPTDataset-train-sample_index.npy`. Ask for 5 samples
# instead of 4, or re-run preprocessing so that one document gets one token longer, and the md5
# changes, so the old files are simply never looked at again; copy the dataset to another disk
# byte for byte and the md5 stays, so the cache built on the first is used on the second.

# %% [markdown]
# ## The config
#
# Names and defaults follow `GPTDatasetConfig` (`gpt_dataset.py:25`) and its parent
# `BlendedMegatronDatasetConfig`. Instead of a tokenizer object the config takes the two ids the
# dataset needs, `eod_id` and `pad_id` (Megatron's `-1` sentinel when the tokenizer has no pad).
# Two integers rather than a tokenizer object keep the config a plain dataclass that pickles
# to `DataLoader` workers and prints in the cache description; they are also all the dataset
# uses a tokenizer for.
# Every field that changes which windows come out, or in what order, is also a field of the
# cache key above; the mask options (`reset_position_ids` and the rest) change only what is
# computed from a window, so they are not.

# %%
@document_fields
@dataclass
class GPTDatasetConfig:
    """Everything that decides which samples a GPTDataset yields."""

    sequence_length: int
    """Tokens per sample input (the sample reads sequence_length + 1)."""
    random_seed: int = 1234
    """Seed of the document and shuffle permutations."""
    blend: Optional[tuple] = None
    """(prefixes, weights or None) for one distribution split into train/valid/test."""
    blend_per_split: Optional[list] = None
    """One (prefixes, weights) per split, instead of `blend` + `split`."""
    split: Optional[str] = "969,30,1"
    """Train/valid/test weights."""
    path_to_cache: Optional[str] = None
    """Where index .npy files go (default: <prefix>/cache/GPTDataset_indices)."""
    mmap_bin_files: bool = True
    """Memory-map the .bin (else seek + read)."""
    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples each blended component builds."""
    eod_id: int = 0
    """End-of-document token id."""
    pad_id: int = PAD_SENTINEL
    """Pad token id (-1 when the tokenizer has none)."""
    reset_position_ids: bool = False
    """Restart positions after each EOD."""
    reset_attention_mask: bool = False
    """Block attention across EODs."""
    eod_mask_loss: bool = False
    """Zero the loss at EOD inputs."""
    create_attention_mask: bool = True
    """Return the [1, s, s] boolean mask (True = masked)."""
    drop_last_partial_validation_sequence: bool = True
    """Drop the last partial valid sample (else pad it)."""
    add_extra_token_to_sequence: bool = True
    """Read seq_length + 1 tokens so labels need no padding."""
    split_matrix: Optional[list] = field(init=False, default=None)
    """Book-ends derived from `split`."""

    def __post_init__(self):
        check_fields(self)  # sequence_length="512" or eod_id="0" stop here, not 13 frames down
        check_range(self, "sequence_length", 2)
        check_range(self, "mid_level_dataset_surplus", 0)
        _check_blends(self)
        if self.blend_per_split is None:
            self.split_matrix = convert_split_vector_to_split_matrix(
                parse_and_normalize_split(self.split))


# %% [markdown]
# ## GPTDataset
#
# A sample is read by following the three tables: `j = shuffle[i]`; rows `j` and `j+1` of the
# sample index give start and end; the tokens are the tail of the first sequence, any middle
# sequences whole, and the head of the last one plus the extra token (`gpt_dataset.py:298`).
# The dataset keeps one flat memory-mapped view of the `.bin` and each sequence's token offset,
# so a window is one slice when it lies in one sequence and a short concatenation otherwise.
# `tokens`, `labels`, `loss_mask`, `position_ids` and the attention mask come from
# [chapter 00's](../00_overview/batch.py)
# `get_ltor_masks_and_position_ids` and `mask_padding`; like Megatron they are computed once and
# reused when no EOD-dependent option is on (`gpt_dataset.py:131-137`).
#
# The class is small on purpose: its constructor describes the dataset (the cache key), loads or
# builds the three tables, and attaches the token views; `query_tokens` and `__getitem__` are
# the two functions of the next cells. `__len__` is the sample index's rows minus one, as in
# Megatron (`gpt_dataset.py:223`; its `defer_npy_index_mmap` branch above computes the same
# count without the table, a mode tinytron does not have), which for the worked example is 7,
# not the 4 asked for: the training loop asks for only the first $S$. Pickling drops the token
# views, so a `DataLoader` worker re-opens the memory map in its own process instead of
# receiving a copy of the corpus through a pipe.
#
# The call that builds the tables for one split, that pickling, and the one-line description a
# dataset prints come first, as a mixin.

# %%
class _GPTDatasetPlumbing:
    """Mixin for GPTDataset: build the tables, pickle without the token views, print a summary."""

    def _build(self):
        """The three tables for this split (the last valid sample kept partial if asked)."""
        drop = (self.config.drop_last_partial_validation_sequence
                if self.index_split == Split.valid else True)
        return build_document_sample_shuffle_indices(
            self.dataset.sequence_lengths, self.indices, self.num_samples,
            self.config.sequence_length, self.config.random_seed, self.extra, drop,
            what=f"dataset {self.dataset_path!r} split {self.index_split.name!r}")

    def __getstate__(self):
        """Pickle without the token views; the IndexedDataset re-opens its files."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_tokens", "_offsets")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        _attach_tokens(self)

    def __repr__(self) -> str:
        tokens = int(np.asarray(self.dataset.sequence_lengths)[self.indices].sum(dtype=np.int64))
        return (f"GPTDataset(path={self.dataset_path!r}, split={self.index_split.name}, "
                f"sequences={len(self.indices)}, tokens={tokens}, samples={len(self)}, "
                f"sequence_length={self.config.sequence_length})")


# %% [markdown]
# The class: describe, load or build, attach; then the two reads.

# %%
class GPTDataset(_GPTDatasetPlumbing, torch.utils.data.Dataset):
    """Megatron's GPTDataset: a split of an IndexedDataset as shuffled seq_length+1 windows.

    Example (most code builds it through `build_train_valid_test_datasets` instead)::

        cfg = GPTDatasetConfig(sequence_length=128, split="90,5,5")
        indexed = IndexedDataset("data/corpus_text_document")
        ids = split_indices(cfg.split_matrix[0], len(indexed))      # the train split's sequences
        train = GPTDataset(indexed, "data/corpus_text_document", ids, 1000, Split.train, cfg)
        train[0]["tokens"].shape                                    # torch.Size([128])
    """

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: Optional[str],
                 indexed_indices: np.ndarray, num_samples: Optional[int], index_split: Split,
                 config: GPTDatasetConfig):
        self.dataset, self.dataset_path, self.indices = indexed_dataset, dataset_path, indexed_indices
        self.num_samples, self.index_split, self.config = num_samples, index_split, config
        self.extra = int(config.add_extra_token_to_sequence)
        describe(self)  # unique_identifiers, unique_description and its md5 (the cache key)
        self.cache_hit = False
        self.document_index, self.sample_index, self.shuffle_index = load_or_build(self, self._build)
        _attach_tokens(self)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def query_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + extra token ids of sample idx (int64; pad id where short)."""
        return _window_tokens(self, idx)

    def __getitem__(self, idx: Optional[int]) -> dict:
        """tokens, labels, loss_mask, position_ids (+ attention_mask) of sample idx."""
        return _sample(self, idx)


# %% [markdown]
# Reading the tokens of sample `idx`: the shuffle index picks the row of the sample index, two
# consecutive rows give where the window starts and ends, and the window is cut out of the
# memory-mapped `.bin`. The class's `query_tokens` is this function; `_attach_tokens` makes the
# flat views it slices, once when the dataset is built and again after unpickling.

# %%
def _attach_tokens(ds: GPTDataset) -> None:
    """Plain ndarray views of the mapped .bin: numpy's memmap subclass costs ~5 us per slice."""
    tok = ds.dataset._tokens  # None for the file reader (mmap=False)
    ds._tokens = None if tok is None else tok.view(np.ndarray)
    ds._offsets = ds.dataset._token_offsets if ds._tokens is not None else None
    ds._cached_masks = None


def _window_tokens(ds: GPTDataset, idx: int) -> np.ndarray:
    """The seq_length + extra token ids of sample idx of `ds` (int64; pad id where short)."""
    j = int(ds.shuffle_index[idx])
    d0, o0 = ds.sample_index[j].tolist()
    d1, o1 = ds.sample_index[j + 1].tolist()
    doc, extra = ds.document_index, ds.extra
    if d0 == d1:
        parts = [_read(ds, int(doc[d0]), o0, o1 - o0 + extra)]
    else:
        parts = [_read(ds, int(doc[d0]), o0, None)]
        parts += [_read(ds, int(s), 0, None) for s in doc[d0 + 1:d1]]
        parts.append(_read(ds, int(doc[d1]), 0, o1 + extra))
    out = np.concatenate(parts, dtype=np.int64) if len(parts) > 1 else parts[0].astype(np.int64)
    need = ds.config.sequence_length + extra
    if len(out) < need:
        out = np.concatenate([out, np.full(need - len(out), ds.config.pad_id, np.int64)])
    return out


def _read(ds: GPTDataset, seq: int, offset: int, length: Optional[int]) -> np.ndarray:
    """Tokens of one sequence: a slice of the flat mmap, or the dataset's file reader."""
    if ds._offsets is None:
        return ds.dataset.get(seq, offset, length)
    start = int(ds._offsets[seq]) + offset
    if length is None:
        length = int(ds.dataset.sequence_lengths[seq]) - offset
    return ds._tokens[start:start + length]


# %% [markdown]
# And the sample itself: the shift into tokens and labels, the masks and positions, padding
# masked out of the loss (`idx=None` is Megatron's padding sample: all loss zero). The class's
# `__getitem__` is this function.
#
# For the worked example's window 2, `text = [t1, t2, u0, u1]` (the last two tokens of sequence
# 1, the first two of sequence 2): `tokens = [t1, t2, u0]`, `labels = [t2, u0, u1]`, and the
# loss mask is all ones unless `eod_mask_loss` zeroes the position whose input is the EOD
# (`t2`, when sequence 1 ends with one). Padding appears only in a kept partial validation
# window, whose missing tokens are the pad id; `mask_padding` zeroes the loss where the label
# is pad and maps pad ids to 0, so a `-1` sentinel never reaches the embedding lookup. The masks and
# positions depend only on where EODs are when one of the three reset/mask options is on;
# otherwise they are the same for every window, so they are computed once and copied.

# %%
def _sample(ds: GPTDataset, idx: Optional[int]) -> dict:
    """tokens, labels, loss_mask, position_ids (+ attention_mask) of sample idx of `ds`."""
    cfg = ds.config
    text_np = _window_tokens(ds, 0 if idx is None else idx)
    if cfg.pad_id < 0 and np.dtype(ds.dataset.dtype).kind == "u":
        has_pad = bool(text_np[-1] == cfg.pad_id)  # only padding (at the end) can hold -1
    else:
        has_pad = bool((text_np == cfg.pad_id).any())
    text = torch.from_numpy(text_np)
    if ds.extra:
        tokens, labels = text[:-1], text[1:]
    else:
        tokens, labels = text, torch.roll(text, -1)
        labels[-1] = cfg.pad_id
        has_pad = True
    attention_mask, loss_mask, position_ids = _masks(ds, tokens)
    if has_pad:  # chapter 00's rule; a no-op (skipped) when no pad id is present
        tokens, labels, loss_mask = mask_padding(tokens, labels, loss_mask, cfg.pad_id)
    if idx is None:
        loss_mask = torch.zeros_like(loss_mask)
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
              "position_ids": position_ids}
    if cfg.create_attention_mask:
        sample["attention_mask"] = attention_mask
    return sample


# %% [markdown]
# The masks and positions, from chapter 00. When no option depends on where the EODs are, they
# are the same for every window: the first sample computes them and later ones copy the loss
# mask (the one that `mask_padding` may change) and share the rest.

# %%
def _masks(ds: GPTDataset, tokens: torch.Tensor):
    """Chapter 00's masks and positions, computed once when they do not depend on EODs."""
    cfg = ds.config
    cacheable = not (cfg.reset_position_ids or cfg.reset_attention_mask or cfg.eod_mask_loss)
    if cacheable and ds._cached_masks is not None:
        mask, loss_mask, pos = ds._cached_masks
        return mask, torch.from_numpy(loss_mask.numpy().copy()), pos  # 3x cheaper than clone
    out = get_ltor_masks_and_position_ids(tokens, cfg.eod_id, cfg.reset_position_ids,
                                          cfg.reset_attention_mask, cfg.eod_mask_loss,
                                          cfg.create_attention_mask)
    if cacheable:
        ds._cached_masks = out
        return out[0], out[1].clone(), out[2]
    return out

# %% [markdown]
# ## Next
#
# The three tables are built, cached and read. The [next page](index_tables.py) draws them for a
# tiny corpus, checks them against Megatron's loop and the worked examples of this page, and
# closes the topic with its summary and exercises.

# %% [markdown]
# # 04 · Data: GPTDataset's three index tables
#
# The [previous page](preprocess.py) wrote a corpus as a `.bin` of tokens and an `.idx` of
# sequence lengths. This page turns that pile of variable-length sequences into a fixed,
# shuffled list of `seq_length + 1`-token windows — the same windows in the same order as
# Megatron, built with a few numpy calls instead of a C++ extension. The
# [next page](gpt_dataset.py) caches them on disk and reads samples through them.
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
# first epoch but one: the partial epoch does not leak into the first steps. The demo at the
# end of the page checks every one of these numbers.

# %%
from __future__ import annotations

import math
import sys
from typing import Optional

import numpy as np

__all__ = [
    "get_num_epochs", "needs_separate_final_epoch", "build_document_index", "build_sample_index",
    "build_sample_index_loop", "build_shuffle_index", "shuffle_index_dtype",
    "build_document_sample_shuffle_indices",
]

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
# walk takes 5.7–7.3 ms (the [summary of 04.5](index_tables.py) has the measurement). A
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
# ## Demo: the three documents, built
#
# The worked example at the top of the page, run: sequences of 5, 3 and 4 tokens, windows of
# $L = 3$, $S = 4$ samples, seed 1234. The asserts are the numbers worked by hand there — two
# epochs with the second kept apart, the document index `[0, 1, 2 | 1, 2, 0]`, the eight rows
# of the sample index and the shuffle `[2, 1, 0 | 3, 5, 4, 6]` — and the loop and the running
# sums agree on the smaller example of the sample-index section.

# %%
if __name__ == "__main__":
    assert get_num_epochs(12, 4, 3) == 2 and needs_separate_final_epoch(2, 12, 4, 3) == (True, 3)
    doc, smp, shuf = build_document_sample_shuffle_indices(
        np.array([5, 3, 4]), np.arange(3, dtype=np.int32), 4, 3, seed=1234)
    print("document index:", doc.tolist())
    print("sample index:  ", smp.tolist())
    print("shuffle index: ", shuf.tolist())
    assert doc.tolist() == [0, 1, 2, 1, 2, 0]
    assert smp.tolist() == [[0, 0], [0, 3], [1, 1], [2, 1], [3, 0], [4, 0], [4, 3], [5, 2]]
    assert shuf.tolist() == [2, 1, 0, 3, 5, 4, 6]
    fast = build_sample_index(np.array([4, 3, 5]), np.arange(3), 3, 1, 12)
    assert fast.tolist() == [[0, 0], [0, 3], [1, 2], [2, 2]]
    assert np.array_equal(build_sample_index_loop(np.array([4, 3, 5]), np.arange(3), 3, 1, 12), fast)

# %% [markdown]
# ## Next
#
# The three tables are built. The [next page](gpt_dataset.py) cuts the corpus into splits,
# caches the tables under a key that notices new data, and reads a sample through them; the
# one after, [04.5](index_tables.py), draws them and checks them against Megatron's loop.

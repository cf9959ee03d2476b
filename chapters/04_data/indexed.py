# %% [markdown]
# # 04 · Data: the `.bin` / `.idx` indexed dataset
#
# Megatron's on-disk token format, byte for byte: a raw token file plus a small index that says
# where every sequence starts. You will build the writer, the zero-copy reader, the checks that
# turn a corrupt file into a clear error, and a writer that a crash cannot leave half-done.

# %%
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from tinytron.data._index_checks import (IndexedDatasetError, as_tokens, check_bin_size,
                                         check_dtype, check_files, check_index_size,
                                         check_tables)

__all__ = [
    "INDEX_HEADER", "DType", "IndexedDatasetError", "IndexedDataset", "IndexedDatasetBuilder",
    "get_idx_path", "get_bin_path", "write_index_bytes", "optimal_dtype", "hexdump_index",
]

# %% [markdown]
# ## Why two files
#
# Training reads random windows of a corpus of billions of tokens. Parsing text at that point
# would be far too slow, so the corpus is tokenized once, ahead of time
# (`tinytron-preprocess`, [next page](preprocess.py)) into two files that share a path prefix `P`:
#
# * `P.bin` — every sequence's token ids, concatenated, little-endian, in one dtype. No header,
#   no separators: the file is exactly `Σ length · itemsize` bytes.
# * `P.idx` — the table of contents:
#
# | offset | size | field |
# |---|---|---|
# | 0 | 9 B | magic `MMIDIDX\x00\x00` |
# | 9 | 8 B | version, `<Q` = 1 |
# | 17 | 1 B | dtype code, `<B` |
# | 18 | 8 B | sequence count $N$, `<Q` |
# | 26 | 8 B | document count $D+1$, `<Q` |
# | 34 | $4N$ | sequence lengths, int32 |
# | $34+4N$ | $8N$ | sequence pointers (byte offsets into `.bin`), int64 |
# | $34+12N$ | $8(D+1)$ | document indices: sequence id where each document starts; first 0, last $N$ |
#
# Worked example: the sequences `[5, 6, 7]`, `[8, 9]` (document 0) and `[3]` (document 1) in
# uint16 give lengths `3, 2, 1`, pointers `0, 6, 10` (bytes: 3 tokens × 2 bytes = 6) and document
# indices `0, 2, 3`. The index is $34 + 12 + 24 + 24 = 94$ bytes, the `.bin` is 12 bytes.
#
# **Sequences and documents.** The index knows two levels. A *sequence* is one contiguous run
# of tokens, the unit of `ds[i]`; a *document* is one or more consecutive sequences, the unit
# that the sampler of [the GPT dataset](gpt_dataset.py) shuffles. For GPT pretraining each
# document is one sequence (the whole text, ending in the end-of-document token); a corpus
# split into sentences (Megatron's `--split-sentences`) has many sequences per document.
#
# **The dtype.** Token ids are stored in the smallest type that holds the vocabulary: uint16
# when every id is below 65,500, else int32 (`optimal_dtype`, Megatron's `:107`). For a 32,000
# token vocabulary that is 2 bytes per token: a corpus of 1T tokens is a 2 TB `.bin` instead of
# 4 TB, and every read moves half the bytes. A 128K vocabulary (Llama 3) needs int32.
#
# The dtype code table is Megatron's (`megatron/core/datasets/indexed_dataset.py:50`); the
# writer is `_IndexWriter` (`:122`, `write` at `:175`, pointers at `:213`), the reader
# `_IndexReader` (`:233`), the builder `IndexedDatasetBuilder` (`:937`).
#
# ```mermaid
# flowchart LR
#   T["token ids per sequence"] -->|add_item| B["P.bin.partial"]
#   T -->|lengths| L["lengths list"]
#   E["end_document"] --> D["document indices"]
#   L --> F["finalize"]
#   D --> F
#   F -->|"write + fsync"| I["P.idx.partial"]
#   I -->|"rename .bin, then .idx"| DONE["P.bin + P.idx"]
# ```

# %%
INDEX_HEADER = b"MMIDIDX\x00\x00"
_FIXED_HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype + 8 N + 8 (D+1)


class DType:
    """Megatron's dtype code table (indexed_dataset.py:50)."""

    codes = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
             6: np.float64, 7: np.float32, 8: np.uint16}

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        """The code of a numpy dtype; ValueError for a dtype with no code."""
        dt = np.dtype(dtype)
        for code, candidate in cls.codes.items():
            if np.dtype(candidate) == dt:
                return code
        raise ValueError(f"dtype {dt} has no MMIDIDX code; use one of "
                         f"{[np.dtype(d).name for d in cls.codes.values()]}")

    @classmethod
    def dtype_from_code(cls, code: int):
        """The numpy dtype of a code; ValueError for an unknown code."""
        if code not in cls.codes:
            raise ValueError(f"unknown dtype code {code} (known: {sorted(cls.codes)})")
        return cls.codes[code]


# %% [markdown]
# Three one-line helpers follow: the dtype rule of the paragraph above, and the two file names
# of a prefix. Every later cell names the files through them, so `P` never appears with a
# hand-written suffix.

# %%
def optimal_dtype(vocab_size: Optional[int]):
    """uint16 when every token id fits below 65500, else int32 (indexed_dataset.py:107)."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def get_idx_path(path_prefix: str) -> str:
    """The index file of a prefix."""
    return str(path_prefix) + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """The token file of a prefix."""
    return str(path_prefix) + ".bin"


# %% [markdown]
# ## Writing the index
#
# The whole `.idx` is a pure function of (dtype, lengths, document indices), so it is built as
# one byte string. The pointers are a running sum of `length · itemsize`: a cumulative sum in
# numpy rather than Megatron's per-sequence Python loop. In the worked example the byte
# lengths are `3·2, 2·2, 1·2 = 6, 4, 2`; each pointer is the sum of the lengths before it,
# `0, 6, 6 + 4 = 10`, which is `cumsum([6, 4])` shifted right by one with a leading 0.
#
# A multimodal index (Megatron's `multimodal=True`, for corpora that mix modalities)
# appends one more table, an int8 *mode* per sequence, after the document indices: $N$ more
# bytes. Nothing in the header says it is there; the reader must be told, which is why the
# size check below allows exactly $N$ extra bytes only when it is.

# %%
def write_index_bytes(dtype, sequence_lengths, document_indices, sequence_modes=None) -> bytes:
    """The exact bytes of an MMIDIDX version-1 index."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    doc = np.asarray(document_indices, dtype=np.int64)
    parts = [INDEX_HEADER, struct.pack("<Q", 1), struct.pack("<B", DType.code_from_dtype(dtype)),
             struct.pack("<Q", len(lengths)), struct.pack("<Q", len(doc)),
             lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(),
             doc.astype("<i8").tobytes()]
    if sequence_modes is not None:
        parts.append(np.asarray(sequence_modes, dtype=np.int8).tobytes())
    return b"".join(parts)

# %% [markdown]
# Reading the fixed header back is the inverse, with a check per field: the 9 magic bytes, the
# version, the dtype code (through the code table), then the two counts that size the rest of
# the file. In the worked example the header decodes to uint16, $N = 3$, $D + 1 = 3$, and the
# file must then be $34 + 12 \cdot 3 + 8 \cdot 3 = 94$ bytes long.

# %%
def _parse_header(idx_path: str, raw: memoryview) -> tuple:
    """Check the fixed 34-byte header; return (dtype, N, D+1)."""
    if len(raw) < _FIXED_HEADER_BYTES:
        raise IndexedDatasetError(f"{idx_path}: truncated index, {len(raw)} bytes is shorter "
                                  f"than the {_FIXED_HEADER_BYTES}-byte header")
    if bytes(raw[:9]) != INDEX_HEADER:
        raise IndexedDatasetError(f"{idx_path}: bad magic {bytes(raw[:9])!r}, "
                                  f"expected {INDEX_HEADER!r} (not an MMIDIDX index)")
    version, code = struct.unpack_from("<QB", raw, 9)
    if version != 1:
        raise IndexedDatasetError(f"{idx_path}: unsupported version {version}, expected 1")
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError as err:
        raise IndexedDatasetError(f"{idx_path}: {err}") from None
    n, d = struct.unpack_from("<QQ", raw, 18)
    return dtype, n, d


# %% [markdown]
# ## A builder a crash cannot corrupt
#
# Preprocessing a large corpus takes hours, and jobs get killed. What matters is what a killed
# job leaves behind: a later training run opens whatever pair it finds under the prefix.
# tinytron writes `P.bin.partial` and `P.idx.partial`, flushes both to disk, and only then
# renames them into place.
#
# <details><summary>Megatron detail: the builder writes in place</summary>
#
# Megatron's builder
# writes straight into `P.bin` and writes `P.idx` in `finalize` (`indexed_dataset.py:937`). A job
# killed in between leaves a `.bin` with no index, or a half-written `.idx` next to a full `.bin`,
# or, when a run overwrites an old prefix, the old `.idx` next to a new `.bin`.
#
# </details>
#
# The old index (if any) is removed before the first rename, so at every instant the prefix is
# one of three states, and only complete pairs open:
#
# | moment of the kill | on disk under `P` | opens? |
# |---|---|---|
# | while tokens are appended | old pair (or nothing), plus `P.bin.partial` | the old pair, unchanged |
# | after the old `.idx` was removed | old or new `.bin`, no `.idx` | no: `FileNotFoundError` names `P.idx` |
# | after both renames | new `.bin` + new `.idx` | the new pair |
#
# `os.replace` is atomic on POSIX file systems, and the `fsync` before it makes sure the bytes
# the new name points to are on disk, not only in the page cache.

# %%
def move_pair_into_place(tmp_bin: str, bin_path: str, idx_path: str, index: bytes) -> None:
    """Write the index beside the finished .bin.partial, then rename both (the .idx last)."""
    tmp_idx = idx_path + ".partial"
    with open(tmp_idx, "wb") as f:
        f.write(index)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(idx_path):
        os.remove(idx_path)  # from here until the last rename the prefix does not open
    os.replace(tmp_bin, bin_path)
    os.replace(tmp_idx, idx_path)


# %% [markdown]
# **Merging.** The preprocessing workers each write a partial pair, and one builder then
# appends them all (`add_index`): their tokens are copied in 16 MB chunks, their lengths
# appended, and their document indices offset by the sequences already written. Worked
# example: the builder holds 3 sequences in 2 documents (document indices `0, 2, 3`); appending
# a dataset with indices `0, 1, 4` adds `1 + 3, 4 + 3`, giving `0, 2, 3, 4, 7`: 7 sequences in
# 4 documents. Pairs of different dtypes cannot be merged, and the error names both.

# %%
class IndexMerge:
    """Mixin for IndexedDatasetBuilder: append a whole finished pair."""

    def add_index(self, path_prefix: str) -> None:
        """Append a whole finished dataset (merging partial outputs)."""
        other = IndexedDataset(path_prefix, multimodal=self.multimodal)
        if np.dtype(other.dtype) != np.dtype(self.dtype):
            raise IndexedDatasetError(f"{get_idx_path(path_prefix)}: dtype {np.dtype(other.dtype)} "
                                      f"differs from the builder's {np.dtype(self.dtype)}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        if self.multimodal:
            self.sequence_modes.extend(other.sequence_modes.tolist())
        with open(get_bin_path(path_prefix), "rb") as src:
            while chunk := src.read(1 << 24):
                self.data_file.write(chunk)


# %% [markdown]
# Documents come in two shapes. A GPT corpus ends each document after one sequence
# (`end_document` after one `add_item`); a sentence-split corpus hands over a whole document's
# tokens with its sequence lengths at once (`add_document`). Both only move the document table.

# %%
class DocumentAppends(IndexMerge):
    """Mixin for IndexedDatasetBuilder: close documents, or append a whole one."""

    def add_document(self, tokens, lengths: list[int], modes=None) -> None:
        """Append several sequences that form one document."""
        arr = as_tokens(tokens, self.dtype)
        if sum(lengths) != arr.size:
            raise ValueError(f"lengths {lengths} sum to {sum(lengths)}, not {arr.size} tokens")
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        """Close the current document (after one or more add_item)."""
        self.document_indices.append(len(self.sequence_lengths))


# %% [markdown]
# The builder itself appends: each `add_item` writes one sequence's tokens and remembers its
# length, `end_document` records where the document ends, and `finalize` writes the index and
# calls `move_pair_into_place`.
#
# It also refuses a token id its dtype cannot hold: `add_item([70000])` on a `uint16` file
# raises a `ValueError` naming the id and the dtype.
#
# <details><summary>Megatron detail: ids that do not fit wrap around</summary>
#
# Megatron's
# builder casts with numpy, which wraps around: in a `uint16` file 70 000 becomes 4 464 and -1
# becomes 65 535, and the corpus is wrong without a word.
#
# </details>
#
# That check, and every check of the reader below, is in the chapter's private module
# `tinytron.data._index_checks` (`chapters/04_data/_index_checks.py`), so that the classes
# read as what they do.

# %%
class IndexedDatasetBuilder(DocumentAppends):
    """Append sequences to `P.bin`; `finalize` writes `P.idx` (indexed_dataset.py:937).

    Example::

        builder = IndexedDatasetBuilder(get_bin_path("data/tiny"), dtype=np.uint16)
        for doc in ([5, 6, 7, 0], [8, 9, 0]):
            builder.add_item(doc)
            builder.end_document()
        builder.finalize(get_idx_path("data/tiny"))    # data/tiny.bin + data/tiny.idx
    """

    def __init__(self, bin_path: str, dtype=np.int32, multimodal: bool = False):
        DType.code_from_dtype(dtype)  # reject a dtype with no code before writing anything
        self.bin_path = str(bin_path)
        self._tmp_bin = self.bin_path + ".partial"
        self.data_file = open(self._tmp_bin, "wb")
        self.dtype = np.dtype(dtype).type
        self.multimodal = multimodal
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: Optional[list[int]] = [] if multimodal else None

    def add_item(self, tokens, mode: int = 0) -> None:
        """Append one sequence."""
        arr = as_tokens(tokens, self.dtype)
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))
        if self.multimodal:
            self.sequence_modes.append(mode)

    def finalize(self, idx_path: str) -> None:
        """Write the index, then move both files into place (the .idx last)."""
        self.data_file.flush()
        os.fsync(self.data_file.fileno())
        self.data_file.close()
        move_pair_into_place(self._tmp_bin, self.bin_path, str(idx_path), write_index_bytes(
            self.dtype, self.sequence_lengths, self.document_indices, self.sequence_modes))


# %% [markdown]
# ## Reading: zero-copy views
#
# A training run reads a few thousand tokens at a time from anywhere in the corpus. The reader
# therefore never loads a file: it maps both with `np.memmap` and makes numpy views on the
# mapped bytes. The operating system pages in only what a read touches, and keeps hot pages
# cached across the DataLoader's workers. Opening a 1 GB index costs milliseconds, and one
# sample is one slice. The files are mapped read-only, so every sample is a read-only view:
# code that writes into a sample raises instead of changing the corpus (or, with a private
# mapping, silently changing what the next read of that sample returns). A caller that needs
# to modify tokens copies them first; [the GPT dataset](gpt_dataset.py) does so anyway when it
# builds a sample (its concatenation and int64 cast are copies).
#
# The read of sequence `i` from `offset` for `length` tokens: the `.bin` starts sequence `i`
# at byte `pointer[i]`, which is token `pointer[i] / itemsize`, so the tokens are
# `tokens[pointer[i] / itemsize + offset :][:length]`. In the worked example sequence 0 starts
# at byte 0 and `get(0, offset=1, length=2)` is `tokens[1:3] = [6, 7]`; sequence 2 starts at
# byte 10, token 5, so `get(2)` is `tokens[5:6] = [3]`. Megatron's `get` is the same arithmetic
# (`indexed_dataset.py:843`); without the map (`mmap=False`) it is one seek and one read.

# %%
class CorpusShape:
    """Mixin for IndexedDataset: the counts, and every token as one array."""

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def document_count(self) -> int:
        """The number of documents D."""
        return len(self.document_indices) - 1

    @property
    def token_array(self) -> np.ndarray:
        """All tokens of the .bin as one flat (memory-mapped) array."""
        if self._tokens is None:
            return np.fromfile(self._bin_path, dtype=self.dtype)
        return self._tokens


# %% [markdown]
# The counts above are the index's; the reads below are the arithmetic of the worked example,
# with a plain file read in place of the slice when the files are not mapped.

# %%
class SequenceReads(CorpusShape):
    """Mixin for IndexedDataset: sequences as slices of the mapped tokens (or file reads)."""

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """`length` tokens of sequence `idx` starting `offset` tokens in (indexed_dataset.py:843)."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        start = int(self._token_offsets[idx]) + offset
        if self._tokens is not None:
            return self._tokens[start:start + length]
        return self._read_file(start, length)

    def _read_file(self, start: int, length: int) -> np.ndarray:
        """The non-mmap reader: seek + readinto (Megatron's _FileBinReader)."""
        out = np.empty(length, dtype=self.dtype)
        with open(self._bin_path, "rb", buffering=0) as f:
            f.seek(start * out.itemsize)
            f.readinto(memoryview(out).cast("B"))
        return out

    def __getitem__(self, idx):
        """One sequence, or a list of sequences for a slice."""
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))


# %% [markdown]
# ## Opening: errors that say what is wrong
#
# A corrupt pair must fail when it is opened, with the file and the problem in the message,
# not later as a wrong sample or a crash deep inside training. tinytron checks, on open,
# everything that is cheap to check, and raises `IndexedDatasetError` naming the file.
#
# <details><summary>Megatron detail: two asserts</summary>
#
# Megatron only asserts the magic and
# version (`indexed_dataset.py:266-269`) and that `len(lengths) == document_indices[-1]`
# (`:673`).
#
# </details>
#
# | check | what it catches | message starts (after the file name) |
# |---|---|---|
# | magic, version, dtype code | not an MMIDIDX index, a newer format | `bad magic`, `unsupported version`, `unknown dtype code` |
# | file size against the header's $N$, $D+1$ | a truncated or appended-to `.idx` | `truncated index`, `oversized index` |
# | document indices from 0 to $N$, never decreasing | a corrupt document table | `inconsistent document indices` |
# | pointers = running sum of `length · itemsize` | a pointer table out of step with the lengths | `inconsistent pointer for sequence i` |
# | `.bin` size = last pointer + last length | a short `.bin`, or an `.idx` of another `.bin` | `data file is … bytes, shorter than …` |
# | the caller's expected dtype | a uint16 corpus read as int32 | `dtype mismatch` |
#
# The pointer check is a cumulative sum over all $N$ sequences, done in blocks of $2^{22}$ so
# that a 100M-sequence index needs no 800 MB temporary. The dataset pickles as its prefix, so
# a DataLoader worker re-opens the files instead of receiving gigabytes.

# %%
_CHECK_BLOCK = 1 << 22  # sequences per block of the pointer check


class TableLoading(SequenceReads):
    """Mixin for IndexedDataset: the checked views of the index tables and of the `.bin`."""

    def _load_tables(self, idx_path, raw, n, d) -> None:
        """Zero-copy views of the three tables, after checking the file is long enough."""
        check_index_size(idx_path, len(raw), _FIXED_HEADER_BYTES + 12 * n + 8 * d, n, d,
                         self.multimodal)
        off = _FIXED_HEADER_BYTES
        self.sequence_lengths = np.frombuffer(raw, np.int32, n, off)
        self.sequence_pointers = np.frombuffer(raw, np.int64, n, off + 4 * n)
        self.document_indices = np.frombuffer(raw, np.int64, d, off + 12 * n)
        self.sequence_modes = (np.frombuffer(raw, np.int8, n, off + 12 * n + 8 * d)
                               if self.multimodal else None)
        check_tables(idx_path, self.sequence_lengths, self.sequence_pointers,
                     self.document_indices, np.dtype(self.dtype).itemsize, _CHECK_BLOCK)

    def _open_bin(self, bin_path) -> None:
        """Check the .bin size against the index, then map it (or keep a file handle)."""
        itemsize = np.dtype(self.dtype).itemsize
        actual = check_bin_size(bin_path, self.sequence_lengths, self.sequence_pointers, itemsize)
        self._bin_path = bin_path
        self._tokens = (np.memmap(bin_path, mode="r", dtype=self.dtype) if self.mmap and actual
                        else np.zeros(0, self.dtype) if self.mmap else None)
        self._token_offsets = self.sequence_pointers // itemsize


# %% [markdown]
# The dataset opens in that order: the header, the caller's dtype, the tables, then the `.bin`.
# Each step runs only when the one before found nothing wrong, so the first error names the
# first thing broken.

# %%
class IndexedDataset(TableLoading):
    """A memory-mapped `.bin`/`.idx` pair: `ds[i]`, `ds.get(i, offset, length)`.

    Example::

        ds = IndexedDataset("data/corpus_text_document")   # the prefix, without .bin/.idx
        ds        # IndexedDataset('data/corpus_text_document', documents=..., tokens=..., ...)
        ds[0]     # the first sequence's token ids (a read-only numpy view)
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True,
                 dtype_code: Optional[int] = None):
        self.path_prefix = str(path_prefix)
        self.multimodal, self.mmap = multimodal, mmap
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        check_files(idx_path, bin_path, _FIXED_HEADER_BYTES)
        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        raw = memoryview(self._idx_map)
        self.dtype, n, d = _parse_header(idx_path, raw)
        check_dtype(idx_path, self.dtype, dtype_code, DType)
        self._load_tables(idx_path, raw, n, d)
        self._open_bin(bin_path)

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.path_prefix!r}, documents={self.document_count}, "
                f"sequences={len(self)}, tokens={int(self.sequence_lengths.sum(dtype=np.int64))}, "
                f"dtype={np.dtype(self.dtype).name})")

    def __getstate__(self):
        """Pickle the prefix, not the mapped files (a spawned DataLoader worker re-opens them)."""
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state):
        self.__init__(*state)


# %% [markdown]
# ## Reading an index by eye
#
# The annotator walks the same layout table the reader uses and prints each field with its
# offset, hex bytes and decoded value: the page's first demo shows a real file. It is the
# tool to reach for when a corpus fails to open: the offsets tell which table a bad value is
# in, and the little-endian bytes can be compared with what the lengths imply (a pointer of
# `06 00 00 00 00 00 00 00` is byte 6, three uint16 tokens after the start).

# %%
def hexdump_index(idx_path: str, max_rows_per_table: int = 4) -> str:
    """An annotated hex dump of an `.idx` file: offset, bytes, field, decoded value."""
    raw = Path(idx_path).read_bytes()
    dtype, n, d = _parse_header(str(idx_path), memoryview(raw))
    fields = [(0, 9, "magic", repr(raw[:9])), (9, 8, "version", 1),
              (17, 1, "dtype code", f"{raw[17]} = {np.dtype(dtype).name}"),
              (18, 8, "sequence count N", n), (26, 8, "document count D+1", d)]
    off = _FIXED_HEADER_BYTES
    for name, size, count, fmt in (("length", 4, n, "<i"), ("pointer", 8, n, "<q"),
                                   ("doc index", 8, d, "<q")):
        for i in range(count):
            if i < max_rows_per_table or i == count - 1:
                fields.append((off + i * size, size, f"{name}[{i}]",
                               struct.unpack_from(fmt, raw, off + i * size)[0]))
            elif i == max_rows_per_table:
                fields.append((off + i * size, 0, f"... {count - max_rows_per_table - 1} more", ""))
        off += size * count
    lines = [f"{o:08x}  {raw[o:o + s].hex(' '):<26}  {name:<20} {value}" for o, s, name, value in fields]
    lines.append(f"{len(raw):08x}  (end of file, {len(raw)} bytes)")
    return "\n".join(lines)

# %% [markdown]
# ## Demo: the worked example, on disk
#
# The three sequences of the worked example, written by the builder and read back: the dump
# must show the 94 bytes computed above (lengths `3, 2, 1`, pointers `0, 6, 10`, document
# indices `0, 2, 3`), and a partial read must be the slice the arithmetic predicts.

# %%
if __name__ == "__main__":
    import tempfile

    tmp = tempfile.mkdtemp()
    prefix = os.path.join(tmp, "tiny")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    builder.add_item([5, 6, 7])
    builder.add_item([8, 9])
    builder.end_document()
    builder.add_item([3])
    builder.end_document()
    builder.finalize(get_idx_path(prefix))
    print(hexdump_index(get_idx_path(prefix)))
    ds = IndexedDataset(prefix)
    print("sequences:", [ds[i].tolist() for i in range(len(ds))], "documents:", ds.document_indices)
    assert os.path.getsize(get_idx_path(prefix)) == 94 and os.path.getsize(get_bin_path(prefix)) == 12
    assert ds.sequence_pointers.tolist() == [0, 6, 10] and ds.document_indices.tolist() == [0, 2, 3]
    assert ds.get(0, offset=1, length=2).tolist() == [6, 7]

# %% [markdown]
# ## Demo: a corrupt pair is named, not silently misread
#
# The same pair with the `.bin` cut from 12 to 10 bytes, as a copy interrupted mid-file would
# leave it. The index still says the last sequence ends at byte 12; the open must refuse and
# name the `.bin`.

# %%
if __name__ == "__main__":
    with open(get_bin_path(prefix), "r+b") as f:
        f.truncate(10)  # lose the last token
    try:
        IndexedDataset(prefix)
        raise AssertionError("a short .bin must not open")
    except IndexedDatasetError as err:
        print("error:", err)
        assert "shorter" in str(err) and "tiny.bin" in str(err)

# %% [markdown]
# ## Summary
#
# * `.bin` is raw tokens; `.idx` is a 34-byte header and three little-endian tables; pointers are
#   byte offsets, document indices are sequence ids from 0 to $N$.
# * The reader is zero-copy; the checks on open turn silent corruption into a named error.
# * Writes go to `.partial` files renamed into place, so a killed job never leaves a prefix that
#   opens as complete.
# * Token ids that do not fit the dtype are refused at write time instead of wrapping around.
#
# ## How production does it
#
# * Megatron: `megatron/core/datasets/indexed_dataset.py` — `_IndexWriter` (`:122`),
#   `_IndexReader` (`:233`), the bin readers for mmap, plain files, S3 and MSC (NVIDIA's
#   Multi-Storage Client, one file-like API over object stores) (`:389-586`),
#   `IndexedDataset` (`:611`), `IndexedDatasetBuilder` (`:937`).
# * NeMo and many other trainers read the same files through Megatron's class.
# * nanoGPT's `train.bin` is the same idea with no index: one flat uint16 array read with
#   `np.memmap`, documents separated only by the end-of-text token, and windows taken at
#   random offsets; without document boundaries there is no per-document shuffle or mask.
#
# ## Exercises
#
# 1. Add the multimodal `sequence_modes` table to the demo and check the file grows by $N$ bytes.
#    <details><summary>Answer</summary>
#
#    One int8 mode per sequence after the document indices:
#    $N = 3$ more bytes, so `write_index_bytes` gives 97 bytes instead of 94. Open it with
#    `IndexedDataset(prefix, multimodal=True)`; without the flag the size check calls it oversized.
#
#    </details>
#
# 2. Time opening a 100k-sequence index with and without the pointer check; is it worth it?
#    <details><summary>Hint</summary>
#
#    Time `IndexedDataset(prefix)` with `check_tables` replaced
#    by a no-op. The check is one vectorised cumulative sum over $N$ int32 lengths, once per open;
#    compare it with what one wrong pointer costs: a silently wrong sample in every epoch.
#
#    </details>
#
# 3. Why must the old `.idx` be removed *before* the new `.bin` is renamed into place?
#    <details><summary>Hint</summary>
#
#    Walk the table of kill moments in `move_pair_into_place`
#    with the two lines swapped: between the `.bin` rename and the `.idx` rename the prefix
#    would hold the new `.bin` beside the old `.idx`, a pair that opens (if the sizes happen to
#    agree) and reads wrong tokens.
#
#    </details>
#
# 4. A corpus of 2 billion sequences: how large is its `.idx`, and would the pointer check's
#    temporary fit in memory without the blocks?
#    <details><summary>Answer</summary>
#
#    With one sequence per document, $D + 1 = N + 1$ and the
#    index is $34 + 12N + 8(N + 1)$ = 40,000,000,042 bytes, 40 GB (37.3 GiB). Without blocks
#    each int64 temporary of the check (the byte lengths, their cumulative sum) is $8N$ = 16 GB,
#    and it holds several at once; with blocks of $2^{22}$ sequences each is 32 MiB.
#
#    </details>

# %% [markdown]
# # 04 · Data: GPTDataset, its splits, cache and samples
#
# [04.3](gpt_indices.py) built the three index tables — document, sample and shuffle — that turn
# a split of the corpus into shuffled `seq_length + 1`-token windows. This page wraps them in
# Megatron's `GPTDataset`: it cuts the corpus into train, validation and test splits by
# sequence, builds the tables once per split and caches them on disk under a key that notices
# new data, and reads sample `i` as the dict of tokens, labels, loss mask and positions that
# Megatron's own dataset returns for the same index.
#
# ```mermaid
# flowchart LR
#   C["GPTDatasetConfig<br/>split, seed, seq_length"] --> S["split_indices:<br/>the split's sequence ids"]
#   S --> K["describe: the cache key<br/>config + data identity"]
#   K -->|"files there"| M["np.load, memory-mapped"]
#   K -->|"none, rank 0"| B["build the three tables,<br/>save under the key"]
#   M --> G["dataset[i]: three lookups,<br/>tokens, labels, masks"]
#   B --> G
# ```

# %%
from __future__ import annotations

import numbers
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

import numpy as np
import torch

from tinytron._fields import check_fields, check_range, document_fields
from tinytron.data._dataset_cache import (_is_rank_zero, _save_atomic,  # noqa: F401 (re-exported)
                                          data_identity, describe, load_or_build)
from tinytron.data.gpt_indices import build_document_sample_shuffle_indices
from tinytron.data.indexed import IndexedDataset
from tinytron.overview.batch import PAD_SENTINEL, get_ltor_masks_and_position_ids, mask_padding

__all__ = [
    "Split", "parse_and_normalize_split", "convert_split_vector_to_split_matrix", "split_indices",
    "GPTDatasetConfig", "checked_blend", "data_identity", "GPTDataset",
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

# %% [markdown]
# The weights become book-ends by a running sum, and book-ends become sequence ids by rounding
# $lo \cdot n$ and $hi \cdot n$. Two neighboring splits round the same number for their shared
# end, so no sequence is lost between them or counted in both. With `969,30,1` and 1,000
# sequences the book-ends are $(0, .969), (.969, .999), (.999, 1)$ and the ids are 0..968,
# 969..998 and 999; with `100,0,0` the second and third book-ends are empty, and `None`.

# %%
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
# The config holds either one blend cut by `split` or one blend per split, never both. These
# checks run when a config is made: the field types and ranges, each blend through
# `checked_blend` with its name, and `split` turned into its book-ends.

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


def _check_config(cfg) -> None:
    """GPTDatasetConfig.__post_init__: types, ranges, blends; split_matrix from split."""
    check_fields(cfg)  # sequence_length="512" or eod_id="0" stop here, not 13 frames down
    check_range(cfg, "sequence_length", 2)
    check_range(cfg, "mid_level_dataset_surplus", 0)
    _check_blends(cfg)
    if cfg.blend_per_split is None:
        cfg.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(cfg.split))

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
# What the key looks like, for the 3-document corpus of [04.3's](gpt_indices.py) worked
# example: the description is a JSON object of 14 fields, among them `"num_samples": 4`,
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
    split_matrix: Optional[list] = field(init=False, default=None)  # the book-ends of `split`

    __post_init__ = _check_config  # types, ranges, blends; split_matrix from split

# %% [markdown]
# A config is checked once, when it is made, by `_check_config` above: a string where an
# integer belongs (`sequence_length="512"`, read from a YAML file without a type), a
# `sequence_length` below 2, a negative surplus or a blend of the wrong shape stops there with
# the field named, instead of as an index error deep inside the builder. After the check,
# `split_matrix` holds the book-ends of `split`, or stays `None` when `blend_per_split` names
# the three splits' data itself.

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

# %% [markdown]
# The window itself. When both ends lie in one sequence (the common case, for sequences longer
# than a window) it is one slice of the flat view, with no copy until the cast to `int64`;
# otherwise it is the tail of the first sequence, the middle ones whole and the head of the
# last. A dataset opened with `mmap_bin_files=False` has no flat view, and `_read` asks the
# `IndexedDataset`'s file reader instead: one seek and read per piece.

# %%
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
# ## Demo: the three documents as a dataset
#
# [04.3's](gpt_indices.py) worked example on disk: sequences of 5, 3 and 4 tokens whose tokens
# say where they come from (sequence $s$ holds $10s, 10s+1, \dots$), windows of 3, 4 samples
# asked for, seed 1234. The asserts are this page's claims: 7 samples, not 4; sample 0 is
# window 2, the last two tokens of sequence 1 and the first two of sequence 2, shifted by one
# into tokens and labels; the description has 14 fields; the same key is a cache hit, and
# asking for 5 samples is a new key, so a new set of files.

# %%
if __name__ == "__main__":
    import json
    import tempfile

    from tinytron.data.indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path

    tmp = tempfile.mkdtemp()
    prefix = os.path.join(tmp, "three")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for s, n in enumerate([5, 3, 4]):
        builder.add_item(np.arange(n) + 10 * s)
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    indexed = IndexedDataset(prefix)
    cfg = GPTDatasetConfig(sequence_length=3, split="100,0,0", path_to_cache=os.path.join(tmp, "c"))
    ids = split_indices(cfg.split_matrix[0], len(indexed))
    ds = GPTDataset(indexed, prefix, ids, 4, Split.train, cfg)
    print(ds)
    sample = ds[0]
    print({k: v.tolist() for k, v in sample.items() if k != "attention_mask"})
    assert len(ds) == 7 and ds.query_tokens(0).tolist() == [11, 12, 20, 21]
    assert sample["tokens"].tolist() == [11, 12, 20] and sample["labels"].tolist() == [12, 20, 21]
    assert len(json.loads(ds.unique_description)) == 14 and len(ds.unique_description_hash) == 32
    again = GPTDataset(indexed, prefix, ids, 4, Split.train, cfg)
    five = GPTDataset(indexed, prefix, ids, 5, Split.train, cfg)
    assert again.cache_hit and not ds.cache_hit and not five.cache_hit
    assert again.unique_description_hash == ds.unique_description_hash
    assert five.unique_description_hash != ds.unique_description_hash

# %% [markdown]
# The printed sample is the worked window, with `sequence_length = 3` tokens and as many
# labels; the loss mask is all ones (no EOD is masked, no pad is present) and the positions
# run 0, 1, 2. The dataset reports 7 samples because its tables cover two whole epochs; the
# training loop reads only the first 4 of the shuffle, all but one from the first epoch.

# %% [markdown]
# ## What matches Megatron, and what does not
#
# Everything a training step sees is Megatron's: for the same `.bin`/`.idx`, config and seed,
# every split holds the same sequence ids, every sample the same tokens, labels, loss mask,
# positions and attention mask, in the same order (`tests/test_data_megatron_compat.py` checks
# every sample of every split against Megatron's own `GPTDataset`, blends included). What
# differs is around that:
#
# * the config takes `eod_id` and `pad_id` instead of a tokenizer object;
# * the cache key adds the data's identity, so re-preprocessing into the same prefix rebuilds
#   the tables where Megatron would reuse stale ones, and the file names differ from Megatron's
#   (a Megatron cache is not read, and tinytron's is not read by Megatron);
# * the tables are built with numpy, not with the compiled `helpers.cpp`;
# * an empty split asked for samples and a `split` with a minus sign stop with an error that
#   names them, where Megatron loops forever or reads `-1` as `1`;
# * there is no `defer_npy_index_mmap` mode: the tables are always memory-mapped at once.

# %% [markdown]
# ## Next
#
# In short: a split is a range of sequence ids; its three tables are built once, by rank 0,
# and memory-mapped by every process under an md5 of the config and the data; a sample is the
# three lookups of [04.3](gpt_indices.py), one slice of the `.bin` in the common case, and
# the shift into tokens and labels with chapter 00's masks.
#
#
# The three tables are built, cached and read. The [next page](index_tables.py) draws them for a
# tiny corpus, checks them against Megatron's loop and the worked examples of
# [04.3](gpt_indices.py), and closes the topic with its summary and exercises.

# %% [markdown]
# # 04 · Data: blending datasets and the dataset builder
#
# Training corpora are mixtures: 70% web, 20% code, 10% books. Megatron's `BlendedDataset`
# interleaves several GPTDatasets deterministically so that *every prefix* of the stream tracks
# the weights — and `BlendedMegatronDatasetBuilder` turns `--data-path 0.7 web 0.3 code` and a
# `--split` into train/valid/test datasets. You will build both, fix the two ways Megatron's
# version fails (extreme weights, empty splits), and plot the realized mixture over time.

# %%
from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from tinytron.data._blend_cache import check_sizes, describe, load_or_build
from tinytron.data._blend_plot import plot_blend_ratios
from tinytron.data._data_path import parse_data_path
from tinytron.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split, split_indices
from tinytron.data.indexed import IndexedDataset

__all__ = [
    "normalize", "build_blending_indices", "build_exhaustive_blending_indices",
    "get_size_per_split_per_dataset", "parse_data_path", "BlendedDataset",
    "BlendedMegatronDatasetBuilder", "plot_blend_ratios",
]

# %% [markdown]
# ## The greedy "largest error" rule
#
# With normalized weights $w_i$, position $k$ of the blend goes to the dataset whose count lags
# its target the most: $\arg\max_i\; w_i \cdot \max(k, 1) - c_i(k)$ (lowest index on ties), and
# that dataset's count goes up by one (`build_blending_indices`, `helpers.cpp:77`). No random
# numbers: the same weights always give the same interleaving. How close does a prefix stay?
# Write $e_i = w_i k - c_i$. The errors sum to 0, the chosen one is the largest (so $\ge 0$) and
# drops by 1, hence no $e_i$ ever falls below $-1$: no dataset is ever a whole sample *ahead*
# of its weight, and none is more than $N-1$ samples *behind*. For two datasets that means
# within one sample both ways at every prefix. With more datasets Megatron's rule can lag by a
# little more than one sample (1.7 samples for weights `.171/.003/.817/.003/.003/.003`, a test
# pins this); we keep the rule as it is, because changing it would change which samples
# Megatron-compatible runs see.
#
# Worked example, $w = (0.25, 0.75)$: $k=0$: errors $(0.25, 0.75)$ → B; $k=1$: $(0.25, -0.25)$ → A;
# $k=2$: $(-0.5, 0.5)$ → B; $k=3$: $(-0.25, 0.25)$ → B; $k=4$: $(0, 0)$, a tie, goes to the
# lower index → A; so `B A B B A B B B A B B B`: one A in every four after the start.
#
# Without weights (`--data-path p1 p2`), the weights are the dataset sizes and the *exhaustive*
# variant uses every sample of every dataset exactly once (`helpers.cpp:22`).
#
# Why no randomness: the order must be the same on every rank and in every run without any
# communication. Each data-parallel rank computes the blend on its own and takes its slice of
# it; a run resumed from a checkpoint at step 1,000 must see exactly the samples the
# uninterrupted run would have seen from step 1,000 on. A pure function of the weights and the
# size gives both for free.
#
# Both loops give arrays identical to Megatron's compiled `helpers.cpp` (checked by the opt-in
# `tests/test_data_megatron_helpers.py`). Each step is one argmax over the datasets, a loop
# over positions that cannot be vectorized
# (each choice depends on the previous counts); plain Python floats keep it at well under a
# microsecond per dataset and position, and give the C++'s double-precision ties bit for bit.

# %%
def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum (float64)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative, finite and not all zero, got {list(weights)}")
    return (w / w.sum()).tolist()


# %% [markdown]
# One step of the rule, for any set of candidates: the largest $w_i k - c_i$, the first on ties.
# Both the weighted and the exhaustive blends below call it.

# %%
def _greedy_pick(w: list, counts: list, candidates, kk: float) -> int:
    """The candidate with the largest w_i * kk - count_i; the first one on ties (strict >)."""
    best, best_err = -1, -math.inf
    for i in candidates:
        err = w[i] * kk - counts[i]
        if err > best_err:
            best, best_err = i, err
    return best


# %% [markdown]
# The weighted blend: one pick per position. Two datasets, the common case, take an unrolled
# loop that makes the same picks about four times faster.

# %%
def build_blending_indices(weights: Sequence[float], size: int):
    """(dataset_index int16, dataset_sample_index int64) for `size` positions, greedy rule."""
    w = [float(x) for x in weights]
    if len(w) == 2:
        return _blend_two(w[0], w[1], size)
    counts = [0] * len(w)
    datasets = range(len(w))
    picks, ranks = [0] * size, [0] * size
    for k in range(size):
        best = _greedy_pick(w, counts, datasets, k if k > 1 else 1.0)
        picks[k], ranks[k] = best, counts[best]
        counts[best] += 1
    return np.array(picks, dtype=np.int16), np.array(ranks, dtype=np.int64)


def _blend_two(w0: float, w1: float, size: int):
    """The same rule unrolled for two datasets (the common case; ~4x faster)."""
    c0 = c1 = 0
    picks, ranks = [0] * size, [0] * size
    for k in range(size):
        kk = k if k > 1 else 1.0
        if w1 * kk - c1 > w0 * kk - c0:
            picks[k], ranks[k] = 1, c1
            c1 += 1
        else:
            ranks[k] = c0
            c0 += 1
    return np.array(picks, dtype=np.int16), np.array(ranks, dtype=np.int64)


# %% [markdown]
# The exhaustive variant walks the same rule with weights proportional to the sizes, and drops
# a dataset from the candidates once all its samples have been placed. Example: sizes 2 and 6
# (weights 0.25 and 0.75) give `B A B B A B B B`, the worked example's first eight picks, after
# which both are spent; sizes 1 and 6 give `B A B B B B B`: once A's single sample is placed,
# A leaves the candidates and B fills the rest.

# %%
def build_exhaustive_blending_indices(sizes: Sequence[int]):
    """Every sample of every dataset exactly once, interleaved by the same greedy rule."""
    sizes = [int(s) for s in sizes]
    if any(s <= 0 for s in sizes):
        raise ValueError(f"every dataset in an exhaustive blend needs samples, got sizes {sizes}")
    total = sum(sizes)
    w = [s / total for s in sizes]
    counts, unspent = [0] * len(sizes), list(range(len(sizes)))
    picks, ranks = [0] * total, [0] * total
    for k in range(total):
        best = _greedy_pick(w, counts, unspent, k if k > 1 else 1.0)
        picks[k], ranks[k] = best, counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return np.array(picks, dtype=np.int16), np.array(ranks, dtype=np.int64)

# %% [markdown]
# ## How many samples each component builds
#
# For a split that must deliver $N$ samples, dataset $i$ is *used* for $\lceil N w_i\rceil$ of
# them and *built* with a small surplus, $\lceil\lceil N w_i\rceil (1 + 0.005)\rceil$, so that the
# greedy order never asks a component for a sample it does not have
# (`_get_size_per_split_per_dataset`, `blended_megatron_dataset_builder.py:553`). The blend's size
# is the sum of the targets, which can exceed $N$ by up to one per dataset.
#
# Extreme weights: with $0.001/0.999$ the small component can be asked for more samples than
# one pass over it holds. Each component is built for the number of samples it will be asked
# for, so a small dataset simply repeats for as many epochs as it needs (the test builds one
# that needs more than one pass). A split that holds *no* sequences but is asked for samples
# is different: no number of epochs helps, and here it raises a `ValueError` naming the
# dataset and the split. The blend also checks, before training starts, that no component is
# asked for more samples than it built.
#
# <details><summary>Megatron detail: where blends used to break</summary>
#
# A blend that built
# each component for a single epoch then indexed past its end (`IndexError`, Megatron-LM
# issue #705). Megatron at e03878b5f builds each component for the samples it will be asked
# for, as here; on an empty split its epoch loop spins forever.
#
# </details>

# %%
def get_size_per_split_per_dataset(weights: Sequence[float], sizes: Sequence[Optional[int]],
                                   surplus: float = 0.0) -> list[list[Optional[int]]]:
    """[dataset][split] sample counts: ceil(ceil(N * w) * (1 + surplus))."""
    if not math.isclose(sum(weights), 1.0, rel_tol=1e-9):
        raise ValueError(f"weights must be normalized, sum is {sum(weights)}")
    return [[None if n is None else int(math.ceil(math.ceil(n * w) * (1 + surplus)))
             for n in sizes] for w in weights]


# %% [markdown]
# `--data-path` itself, `p1 p2 ...` or `w1 p1 w2 p2 ...` exactly as Megatron's command line takes
# it, is parsed by `parse_data_path` in the chapter's private module `tinytron.data._data_path`
# (`chapters/04_data/_data_path.py`); a malformed list (odd pairs, numbers where paths belong,
# weights mixed with bare paths) is a one-line `ValueError` naming `--data-path`.
#
# ## BlendedDataset
#
# `blend[k]` returns sample `dataset_sample_index[k]` of dataset `dataset_index[k]`, with a
# `dataset_id` key added (`blended_dataset.py:97-110`). So the whole blend is two arrays of
# the blend's length, and a read is two lookups and a read of the component. In the worked
# example, `dataset_index = [1, 0, 1, 1, 0, …]` and `dataset_sample_index = [0, 0, 1, 2, 1, …]`:
# position 3 is sample 2 of B, because two B samples came before it.
#
# Computing the arrays is a loop over every position, seconds for a 100M-sample blend, so
# they are cached like [GPTDataset's](gpt_dataset.py) tables: under a key built from the blend's
# description and its components' own keys (which include their data), so that a change of
# weights, size, split or any component's data makes a new key instead of reusing a stale
# table. Rank 0 builds and saves; the others load. The key, the cache files and the check that
# no component is asked for more samples than it built are in the private module
# `tinytron.data._blend_cache` (`chapters/04_data/_blend_cache.py`).

# %%
class BlendedDataset(torch.utils.data.Dataset):
    """Several datasets interleaved by weight (blended_dataset.py:24)."""

    def __init__(self, datasets: list, weights: Optional[Sequence[float]], size: Optional[int],
                 config: GPTDatasetConfig):
        if not datasets or len(datasets) >= 32767:
            raise ValueError(f"a blend needs 1..32766 datasets, got {len(datasets)}")
        self.datasets, self.size, self.config = datasets, size, config
        self.split = datasets[0].index_split
        if weights is None:
            weights = [len(d) for d in datasets]
        self.weights = normalize(weights) if size is not None else [int(w) for w in weights]
        self.unique_description, self.unique_description_hash = describe(self, self.weights, size)
        self.dataset_index, self.dataset_sample_index = load_or_build(self, self._build)
        check_sizes(self)

    def _build(self):
        if self.size is not None:
            return build_blending_indices(self.weights, self.size)
        return build_exhaustive_blending_indices(self.weights)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict:
        i = int(self.dataset_index[idx])
        return {"dataset_id": i, **self.datasets[i][int(self.dataset_sample_index[idx])]}

# %% [markdown]
# ## The builder
#
# `BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()` returns
# `[train, valid, test]` (`blended_megatron_dataset_builder.py:77`):
#
# ```mermaid
# flowchart TD
#   C["config.blend: prefixes, weights"] -->|"one prefix, no weights"| S["GPTDataset per split"]
#   C -->|"several prefixes"| M["per prefix: GPTDataset per split, target x weight + surplus"]
#   M --> B["BlendedDataset per split, size = sum of targets"]
#   P["config.blend_per_split"] --> Q["per split: its own blend"]
# ```
#
# Worked example, the demo's blend: `--data-path 0.999 big 0.001 small`, `--split 98,2,0`,
# 3,000 train and 100 valid samples. Train: `big` is used for $\lceil 2997 \rceil = 2997$
# samples and built for $\lceil 2997 \cdot 1.005 \rceil = 3012$; `small` is used for
# $\lceil 3 \rceil = 3$ and built for $\lceil 3 \cdot 1.005 \rceil = 4$; the train blend has
# $2997 + 3 = 3000$ samples. Valid: $\lceil 99.9 \rceil = 100$ and $\lceil 0.1 \rceil = 1$, a blend
# of 101 samples, one more than asked (the ceilings). Test: the split is 0%, so `None`.
#
# **Ranks.** With `torch.distributed` initialized, global rank 0 builds (and caches) first,
# everyone meets at a barrier, then the other ranks that need data load the cached tables;
# ranks for which `is_built_on_rank()` is False get `None` (`build_generic_dataset`, `:491`).
# Every rank must meet the *same* barriers, data or not, or the world hangs: a rank without
# data still calls `_generic` once per dataset it would have built, with nothing to make.
#
# The rank rule comes first: `_generic` makes one dataset on rank 0, meets the barrier, then
# makes it on the other ranks that hold data; every rank calls it the same number of times.

# %%
def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class RankZeroFirst:
    """Mixin for BlendedMegatronDatasetBuilder: rank 0 builds, barrier, then the other ranks."""

    def _built_here(self) -> bool:
        return not _dist() or self.is_built_on_rank()

    def _generic(self, make: Callable, count: int = 1):
        """Rank 0 builds first, barrier, then the other ranks (they hit the cache)."""
        if not _dist():
            return make()
        out = None
        rank = torch.distributed.get_rank()
        if rank == 0 and self.is_built_on_rank():
            out = make()
        for _ in range(count):
            torch.distributed.barrier()
        if rank != 0 and self.is_built_on_rank():
            out = make()
        return out


# %% [markdown]
# Per prefix, the split's sequences become a `GPTDataset`. A split that holds no sequences
# but is asked for samples is refused here: tinytron raises a `ValueError` naming the dataset,
# the split and the sample count.
#
# <details><summary>Megatron detail: an empty split</summary>
#
# Megatron's epoch loop over an
# empty split never ends: no number of epochs yields a sample.
#
# </details>

# %%
class RankOrderedBuilds(RankZeroFirst):
    """Mixin for BlendedMegatronDatasetBuilder: one prefix's splits, rank 0 first, then the rest."""

    def _build_splits(self, prefix: str, split, sizes) -> list:
        """GPTDatasets of one prefix, one per non-empty split."""
        if not self._built_here():
            self._generic(lambda: None, count=sum(s is not None for s in split))
            return [None] * 3
        indexed = IndexedDataset(prefix, mmap=self.config.mmap_bin_files)
        n = len(indexed.sequence_lengths)
        out = []
        for i, sp in enumerate(Split):
            if split[i] is None:
                out.append(None)
                continue
            ids = split_indices(split[i], n)
            if len(ids) == 0 and sizes[i]:
                raise ValueError(f"dataset {prefix!r} split {sp.name!r} holds no sequences "
                                 f"({n} sequences, split {self.config.split!r}) but {sizes[i]} "
                                 f"samples were requested")
            out.append(self._generic(lambda: None) if len(ids) == 0 else self._generic(
                lambda ids=ids, i=i, sp=sp: self.cls(indexed, prefix, ids, sizes[i], sp, self.config)))
        return out


# %% [markdown]
# One distribution, `_build_blend`: a single unweighted prefix is its own dataset; several
# prefixes each build their splits with the surplus, and a `BlendedDataset` per split mixes
# them. Without weights the blend is exhaustive, and its size is capped by what the
# components hold.

# %%
class BlendBuilds(RankOrderedBuilds):
    """Mixin for BlendedMegatronDatasetBuilder: the three splits of one distribution."""

    def _build_blend(self, blend, split, sizes) -> list:
        """One distribution: a single prefix directly, several as BlendedDatasets."""
        prefixes, weights = blend
        if len(prefixes) == 1 and weights is None:
            return self._build_splits(prefixes[0], split, sizes)
        if weights is not None:
            weights = normalize(weights)
            if any(sizes[i] is None for i in range(3) if split[i] is not None):
                raise ValueError("a weighted blend needs a sample count for every non-empty split")
            target = get_size_per_split_per_dataset(weights, sizes)
            buffered = get_size_per_split_per_dataset(weights, sizes,
                                                      self.config.mid_level_dataset_surplus)
        else:
            buffered = [[None] * 3 for _ in prefixes]
        per_prefix = [self._build_splits(p, split, buffered[j]) for j, p in enumerate(prefixes)]
        out = []
        for i in range(3):
            parts = [pp[i] for pp in per_prefix]
            if split[i] is None:
                out.append(None)
            elif not self._built_here() or any(p is None for p in parts):
                out.append(self._generic(lambda: None))  # every rank meets the same barriers
            else:
                w_i = weights if weights is not None else [len(p) for p in parts]
                size_i = (sum(t[i] for t in target) if weights is not None
                          else None if sizes[i] is None else min(sizes[i], sum(w_i)))
                out.append(self._generic(lambda: BlendedDataset(parts, w_i, size_i, self.config)))
        return out


# %% [markdown]
# The builder: `build` walks the splits (with `blend_per_split`, one blend per split, a single
# prefix taken as is) and hands each distribution to `_build_blend`.

# %%
class BlendedMegatronDatasetBuilder(BlendBuilds):
    """Build the train/valid/test datasets of a config (blended_megatron_dataset_builder.py:29)."""

    def __init__(self, cls, sizes: Sequence[Optional[int]], is_built_on_rank: Callable[[], bool],
                 config: GPTDatasetConfig):
        if len(sizes) != 3:
            raise ValueError(f"sizes must list train, valid and test sample counts, got {sizes}")
        if config.blend is None and config.blend_per_split is None:
            raise ValueError("config needs blend or blend_per_split")
        self.cls, self.sizes, self.is_built_on_rank, self.config = cls, list(sizes), is_built_on_rank, config

    def build(self) -> list:
        """[train, valid, test] datasets (None where a split is empty or not built here)."""
        if self.config.blend_per_split is None:
            return self._build_blend(self.config.blend, self.config.split_matrix, self.sizes)
        out = []
        for i, blend in enumerate(self.config.blend_per_split):
            split, sizes = [None] * 3, [0] * 3
            split[i], sizes[i] = (0.0, 1.0), self.sizes[i]
            if blend is not None and len(blend[0]) == 1:  # one prefix: its weight is ignored
                out.append(self._build_splits(blend[0][0], split, sizes)[i])  # (:251-255)
                continue
            out.append(None if blend is None else self._build_blend(blend, split, sizes)[i])
        return out


# %% [markdown]
# ## Drawing the realized mixture
#
# The demo draws, for a blend, each component's running fraction against its weight, and the
# worst $|c_i - w_i k|$ over the components at every prefix, for the greedy order and for a
# random order with the same weights. The drawing function, `plot_blend_ratios`, is in the
# private module `tinytron.data._blend_plot` (`chapters/04_data/_blend_plot.py`). What to
# expect: the greedy curve stays at or below one sample at every $k$; the random one wanders
# like $\sqrt{k}$: in the demo's draw (seed 0) it is 19 samples off at $k = 2000$ and 30 at its
# worst.

# %% [markdown]
# ## Demo: a three-way blend, its running ratios, and the extreme 0.001/0.999 case
#
# Three checks in one run. The worked example's twelve picks must be `BABBABBBABBB`. A
# 0.5/0.3/0.2 blend of 2,000 samples must stay within one sample of its weights at every
# prefix (it stays within 0.6). And the extreme blend of the builder's worked example, built
# on two small corpora written here, must deliver its 3,000 train samples, 2,997 of them from
# `big` and 3 from `small`, with no test split.

# %%
if __name__ == "__main__":
    import tempfile

    import matplotlib.pyplot as plt

    from tinytron.data.indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path

    worked = "".join("AB"[i] for i in build_blending_indices([0.25, 0.75], 12)[0])
    print("w = (0.25, 0.75):", worked)
    assert worked == "BABBABBBABBB"
    w = normalize([0.5, 0.3, 0.2])
    di, dsi = build_blending_indices(w, 2000)
    print("first 20 picks:", di[:20].tolist())
    counts = np.cumsum(np.eye(3, dtype=np.int64)[di], axis=0)
    err = counts - np.outer(np.arange(1, 2001), w)
    print("max |count - w*k| over all prefixes:", round(float(np.abs(err).max()), 3))
    plot_blend_ratios(di, w, ["web", "code", "books"])
    plt.show()
    assert np.abs(err).max() <= 1.0

# %% [markdown]
# The extreme blend: two small corpora written here, `big` and `small`, blended 0.999/0.001
# by the builder.

# %%
if __name__ == "__main__":
    tmp = tempfile.mkdtemp()
    rng = np.random.default_rng(0)
    prefixes = []
    for name, n_docs in (("big", 400), ("small", 40)):
        p = os.path.join(tmp, name)
        b = IndexedDatasetBuilder(get_bin_path(p), dtype=np.uint16)
        for _ in range(n_docs):
            b.add_item(rng.integers(0, 1000, rng.integers(5, 60)))
            b.end_document()
        b.finalize(get_idx_path(p))
        prefixes.append(p)
    prefixes_w, weights = parse_data_path(["0.999", prefixes[0], "0.001", prefixes[1]])
    cfg = GPTDatasetConfig(sequence_length=16, blend=(prefixes_w, weights), split="98,2,0",
                           path_to_cache=os.path.join(tmp, "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [3000, 100, None],
                                                       lambda: True, cfg).build()
    print("train:", len(train), "samples; per dataset:", np.bincount(train.dataset_index).tolist())
    assert test is None and len(train) == math.ceil(3000 * 0.999) + math.ceil(3000 * 0.001)
    assert train[5]["tokens"].shape == (16,)

# %% [markdown]
# ## Summary
#
# * The greedy largest-error rule makes every prefix of the blend track the weights within one
#   sample, with no randomness.
# * Components are built with a 0.5% surplus; the blend checks that none is oversampled.
# * An empty split asked for samples is an error that names the dataset and the split.
# * The blend is two index arrays, cached under a key that includes every component's data, so
#   every rank and every resumed run reads the same order.
#
# ## How production does it
#
# * Megatron: `megatron/core/datasets/blended_dataset.py` (`:24`),
#   `blended_megatron_dataset_builder.py` (`build` `:77`, splits `:416`, sizes `:553`),
#   `helpers.cpp:22,77` (the two blending loops, in C++).
# * torchtitan and Hugging Face `datasets.interleave_datasets` sample the mixture *randomly*;
#   the realized ratios then drift by $O(\sqrt{k})$ samples instead of staying within one.
#
# ## Exercises
#
# 1. Plot `count − w·k` for a random (multinomial) mixture of the same weights and compare.
#    <details><summary>Hint</summary>
#
#    Draw the picks with `np.random.default_rng(0).choice(3,
#    2000, p=w)` and compute `err` as the demo does; `plot_blend_ratios` draws both orders. The
#    greedy error stays at or below one sample; the random one grows like $\sqrt{k}$.
#
#    </details>
#
# 2. Why does position $k = 0$ use $\max(k, 1) = 1$? What would change with $k$ itself?
#    <details><summary>Answer</summary>
#
#    With $k = 0$ every error $w_i \cdot 0 - 0$ is 0, a tie
#    that the lowest index wins whatever the weights. With $\max(k, 1)$ the first pick goes to
#    the largest weight. For $w = (0.25, 0.75)$ the rule gives `BABBABBBABBB`; with $k$ itself
#    the twelve picks are `ABBBABBBABBB`: the 25% dataset opens the blend.
#
#    </details>
#
# 3. Find weights for which the 0.5% surplus is not enough for a 10-sample split.
#    <details><summary>Answer</summary>
#
#    There are none. Below 200 used samples the surplus
#    $\lceil c (1 + 0.005) \rceil$ is $c + 1$: one spare sample per component, and the greedy
#    rule never puts a dataset a whole sample ahead of its weight. A search over every weight
#    pair and triple on a 0.01 grid (`build_blending_indices` against
#    `get_size_per_split_per_dataset`) finds no component asked for more than it built.
#
#    </details>
#
# 4. Resume a run from a checkpoint with one more dataset in `--data-path`. Which cached tables
#    are reused, which are rebuilt, and does the resumed run see the samples the old one would
#    have?
#    <details><summary>Hint</summary>
#
#    Follow the keys: every weight changes when one is added,
#    so each component's sample count (`get_size_per_split_per_dataset`) and with it its
#    `GPTDataset` key change, and so does the blend's own key (`_blend_cache.describe`). Then
#    compare `build_blending_indices` for the old and new weights from position 0.
#
#    </details>

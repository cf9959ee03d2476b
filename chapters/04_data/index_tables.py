# %% [markdown]
# # 04 · Data: the three index tables, drawn and checked
#
# [04.3](gpt_indices.py) built GPTDataset's document, sample and shuffle indices, and the
# [previous page](gpt_dataset.py) cached them and read samples through them. This page draws
# them for a corpus small enough to read by eye, and checks every number of [04.3's](gpt_indices.py)
# worked examples against Megatron's loop, this chapter's own loop and a reference reader. You will build the drawing, `plot_index_tables`, and run the checks.

# %%
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from tinytron.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split
from tinytron.data.gpt_indices import (build_document_sample_shuffle_indices, build_sample_index,
                                       build_sample_index_loop, get_num_epochs,
                                       needs_separate_final_epoch)
from tinytron.data.indexed import IndexedDataset, get_bin_path, get_idx_path

__all__ = ["plot_index_tables"]

# %% [markdown]
# ## Drawing the three tables
#
# The picture of the demo's corpus: the top row is the document index as a token stream (one
# color per sequence, dashed lines at the epoch ends), the rows below are the windows of the
# sample index, each labeled `s{i}→#{k}`: window $i$ is read at step $k$ of the shuffle
# index. Windows overlap by one token, a window that crosses a color is a window that crosses a
# document boundary, and the step numbers jump around: that is the shuffle.

# %% tags=["hide-input"]
def plot_index_tables(sizes, document_index, sample_index, shuffle_index, seq_length: int,
                      tokens_per_epoch: Optional[int] = None):
    """The token stream colored by sequence, sample windows below it, and the shuffle order."""
    import matplotlib.pyplot as plt

    lengths = np.asarray(sizes)[document_index]
    cum = np.concatenate([[0], np.cumsum(lengths)])
    fig, ax = plt.subplots(figsize=(10, 3.2))
    cmap = plt.get_cmap("tab10")
    for j, (lo, n) in enumerate(zip(cum[:-1], lengths)):
        ax.barh(2, n, left=lo, color=cmap(int(document_index[j]) % 10), edgecolor="k")
        ax.text(lo + n / 2, 2, f"seq {document_index[j]}", ha="center", va="center", fontsize=8)
    for i in range(len(sample_index) - 1):
        start = cum[sample_index[i][0]] + sample_index[i][1]
        ax.barh(1 - 0.35 * (i % 2), seq_length + 1, left=start, height=0.3, color="0.8", edgecolor="k")
        order = int(np.flatnonzero(np.asarray(shuffle_index) == i)[0])
        ax.text(start + (seq_length + 1) / 2, 1 - 0.35 * (i % 2), f"s{i}→#{order}",
                ha="center", va="center", fontsize=7)
    if tokens_per_epoch:
        for e in range(1, int(cum[-1] // tokens_per_epoch) + 1):
            ax.axvline(e * tokens_per_epoch, color="k", ls="--", lw=1)
            ax.text(e * tokens_per_epoch - 0.5, 1.45, f"end of epoch {e}", ha="right", fontsize=7)
    ax.set_yticks([2, 0.8], ["document index\n(shuffled seqs)", "sample index\n(window → read at step #)"])
    ax.set_xlabel("token position in the concatenated stream")
    ax.set_title(f"three index tables, seq_length={seq_length}")
    fig.tight_layout()
    return fig

# %% [markdown]
# ## Demo: a tiny corpus, its three tables, and Megatron's loop
#
# Five sequences of 7, 3, 9, 5 and 6 tokens (30 per epoch), whose tokens say where they come
# from (sequence $s$ holds $100s, 100s+1, ...$), windows of 4 tokens and 8 samples: two epochs.
# The printed sample windows can be checked by eye — a window that jumps from 6 to 100 crossed
# from sequence 0 into sequence 1. Then the asserts: the sample index equals the transcription
# of Megatron's C++ loop and [04.3's](gpt_indices.py) own loop, the worked examples of that page
# give the arrays worked by hand, every window equals the reference reader's, and a second
# dataset with the same key is a cache hit with the same shuffle.

# %%
if __name__ == "__main__":
    import tempfile

    import matplotlib.pyplot as plt

    from tinytron.data._reference import reference_sample_idx, reference_sample_tokens
    from tinytron.data.indexed import IndexedDatasetBuilder

    tmp = tempfile.mkdtemp()
    prefix = os.path.join(tmp, "tiny")
    b = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for s, n in enumerate([7, 3, 9, 5, 6]):
        b.add_item(np.arange(n) + 100 * s)  # sequence s holds 100s, 100s+1, ...
        b.end_document()
    b.finalize(get_idx_path(prefix))
    ds_ix = IndexedDataset(prefix)
    cfg = GPTDatasetConfig(sequence_length=4, split="100,0,0", path_to_cache=os.path.join(tmp, "c"))
    ds = GPTDataset(ds_ix, prefix, np.arange(5, dtype=np.int32), 8, Split.train, cfg)
    print("document index:", ds.document_index.tolist())
    print("sample index:  ", ds.sample_index.tolist())
    print("shuffle index: ", ds.shuffle_index.tolist())
    for i in range(3):
        print(f"sample {i}:", ds.query_tokens(i).tolist())

# %% [markdown]
# The picture of these three tables, then the checks: Megatron's loop, [04.3's](gpt_indices.py) loop, the
# worked examples, every window against the reference reader, and the cache.

# %%
if __name__ == "__main__":
    plot_index_tables(ds_ix.sequence_lengths, ds.document_index, ds.sample_index, ds.shuffle_index, 4,
                      tokens_per_epoch=30)
    plt.show()
    ref = reference_sample_idx(ds_ix.sequence_lengths, ds.document_index, 4, 2, 30)  # E = 2 epochs
    assert np.array_equal(ref, ds.sample_index)
    worked = build_sample_index(np.array([4, 3, 5]), np.arange(3), 3, 1, 12)  # the prose example
    assert worked.tolist() == [[0, 0], [0, 3], [1, 2], [2, 2]]
    loop = build_sample_index_loop(np.array([4, 3, 5]), np.arange(3), 3, 1, 12)
    assert np.array_equal(loop, worked)  # the loop first, the running sums after: one table
    loop = build_sample_index_loop(ds_ix.sequence_lengths, ds.document_index, 4, 2, 30)
    assert np.array_equal(loop, ds.sample_index)
    three = build_document_sample_shuffle_indices(np.array([5, 3, 4]), np.arange(3, dtype=np.int32),
                                                  4, 3, seed=1234)  # the 3-document example
    assert [t.tolist() for t in three] == [
        [0, 1, 2, 1, 2, 0], [[0, 0], [0, 3], [1, 1], [2, 1], [3, 0], [4, 0], [4, 3], [5, 2]],
        [2, 1, 0, 3, 5, 4, 6]]
    assert get_num_epochs(12, 4, 3) == 2 and needs_separate_final_epoch(2, 12, 4, 3) == (True, 3)
    assert all(np.array_equal(ds.query_tokens(i), reference_sample_tokens(
        ds_ix, ds.document_index, ds.sample_index, ds.shuffle_index, i, 4)) for i in range(len(ds)))
    again = GPTDataset(ds_ix, prefix, np.arange(5, dtype=np.int32), 8, Split.train, cfg)
    assert again.cache_hit and np.array_equal(again.shuffle_index, ds.shuffle_index)
    sample = ds[0]
    assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])

# %% [markdown]
# ## Summary
#
# * Document index: sequence ids × epochs, shuffled (the last epoch apart under the 80% rule).
# * Sample index: sample $i$ starts at token $iL$ of that stream; two running sums, packed
#   into one `cumsum`, build it, tested against the loop that walks it sample by sample.
# * The whole build takes about Megatron's time (0.94× in the median); about 85% of either
#   build is the two `RandomState` shuffles.
#   <details><summary>Megatron detail: the measurement</summary>
#
#   Measured with
#   `OMP_NUM_THREADS=1 python benchmarks/bench_data.py --rounds 9`: 100M tokens, 1.07M samples
#   of 1,024, CPU time against megatron-core 0.16.1, identical arrays, five runs on a shared
#   2-core machine at load 5–8. The whole build, nine rounds alternating in one process, takes
#   0.94× Megatron's time (median; 0.76–0.96×); built once per fresh process, as a training run
#   builds it, 0.94× (median of 25 pairs, noisier: 0.83–1.20× per run). The sample index is
#   4–6.5 ms against 5.7–7.3 ms for the compiled `build_sample_idx`; the rest, about 85% of
#   either build, is the two `RandomState` shuffles, the same numpy calls on both sides.
#   Shuffling an `int64` copy to reach numpy's faster loop for 8-byte items (the same
#   permutation) gave nothing in the median: the loop is faster, but twice the bytes move.
#
#   </details>
#
# * Shuffle index: a permutation of samples from the same RNG stream, drawn after the documents.
# * Cached on disk under a key that includes the data's own identity.
#   <details><summary>Megatron detail: the cache key</summary>
#
#   That identity is tinytron's
#   addition: Megatron's key (`megatron_dataset.py:57-71`) holds the path and the config, so
#   rewriting a prefix in place keeps its stale tables.
#
#   </details>
#
# * The class only describes, loads or builds, and reads; the cache's bookkeeping lives in
#   `tinytron.data._dataset_cache`.
#
# ## How production does it
#
# * Megatron: `megatron/core/datasets/gpt_dataset.py` (`GPTDataset` `:101`, lookup `:298`, build
#   `:381`), `helpers.cpp:145` (`build_sample_idx`, compiled with pybind11 on first use),
#   `megatron_dataset.py:57-71` (the cache description).
# * torchtitan streams Hugging Face datasets and packs on the fly instead: no index files, but no
#   exact resume by sample count either.
#
# ## Exercises
#
# 1. Change one sequence's length in the tiny corpus, re-run: which cache files are rebuilt?
#    <details><summary>Hint</summary>
#
#    The `.idx` holds the lengths, so its BLAKE2 hash and with it
#    the description's md5 change (`data_identity`, `describe`). Every file name starts with
#    that md5: all four files (the description and the three tables) are written anew, and the
#    old ones are never read again.
#
#    </details>
#
# 2. Show that with `add_extra_token_to_sequence=False` consecutive samples no longer overlap.
#    <details><summary>Hint</summary>
#
#    Build the dataset with the flag off and compare
#    `query_tokens(i)` of windows $i$ and $i + 1$ in sample-index order (not shuffled order):
#    each now reads $L$ tokens, not $L + 1$, and the next starts right after it
#    (`build_sample_index` with `add_extra_token=0`).
#
#    </details>
#
# 3. Set $S$ so that the final epoch holds exactly 80% of an epoch's samples: separate or not?
#    <details><summary>Answer</summary>
#
#    Not separate: the rule is a strict `from_last <
#    int(0.80 * per_epoch)`. With $T = 16$, $L = 3$ an epoch holds $(16 - 1)//3 = 5$ samples and
#    80% of that is 4; $S = 9$ gives $E = 2$ and $S_{last} = 9 - 5 = 4$, so
#    `needs_separate_final_epoch(2, 16, 9, 3)` is `(False, 5)`; $S = 8$ ($S_{last} = 3$) is
#    `(True, 5)`.
#
#    </details>
#
# 4. In the three-document example ask for $S = 3$ instead of 4: how many epochs, which
#    document index, and why is the shuffle index now a single permutation?
#    <details><summary>Answer</summary>
#
#    $3 \cdot 3 + 1 = 10 \le 12$ tokens, so $E = 1$. The
#    document index is one shuffle, `[0, 1, 2]`, with $(12 - 1)//3 = 3$ windows, rows
#    `(0,0) (0,3) (1,1) (2,1)`. With one epoch there is no final epoch to keep apart
#    (`needs_separate_final_epoch` returns `(False, 0)`), so the shuffle index is one
#    permutation of the 3 windows: `[1, 2, 0]`.
#
#    </details>

# %% [markdown]
# # 04 · Data: the whole pipeline in one call
#
# The pieces of this chapter, assembled the way a trainer uses them: a config with Megatron's
# flag names, the datasets built where Megatron builds them, data loaders that resume from
# `consumed_samples`, and `get_batch` at every step. You will run it end to end on the Python
# standard library's own source code.

# %%
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from tinytron._fields import check_choice, check_fields, check_range, document_fields
from tinytron.data._data_path import path_list
from tinytron.data._pipeline_plot import plot_dataset_ranks
from tinytron.data.blended import BlendedMegatronDatasetBuilder, parse_data_path
from tinytron.data.gpt_dataset import GPTDataset, GPTDatasetConfig, parse_and_normalize_split
from tinytron.data.gpt_indices import get_num_epochs, shuffle_index_dtype
from tinytron.data.samplers import build_pretraining_data_loader, cyclic_iter
from tinytron.overview.batch import PAD_SENTINEL

__all__ = ["DataConfig", "build_train_valid_test_datasets", "build_data_iterators",
           "is_dataset_built_on_rank", "builds_datasets", "get_train_valid_test_num_samples",
           "index_bytes", "batch_bytes"]

# %% [markdown]
# ## Building where Megatron builds
#
# Datasets exist only on the ranks that read data: tensor-parallel rank 0 of the first and the
# last pipeline stage (`is_dataset_built_on_rank`, `pretrain_gpt.py:254`). The first stage
# embeds the tokens, the last computes the loss from the labels; the other TP ranks receive
# the batch by broadcast ([`get_batch`](distribute.py)) and middle stages need none. Global
# rank 0 builds the index caches first; the others meet it at a barrier and memory-map them.

# %%
def builds_datasets(tp_rank: int, pp_rank: int, pp_size: int) -> bool:
    """Megatron's rule: TP rank 0 of the first or the last pipeline stage."""
    return tp_rank == 0 and pp_rank in (0, pp_size - 1)


def is_dataset_built_on_rank(grid) -> bool:
    """The rule for this rank of a process-group grid."""
    return builds_datasets(grid.rank("tp"), grid.rank("pp"), grid.size("pp"))


# %% [markdown]
# Drawn for 8 ranks at TP 2 × PP 2 × DP 2, from the same rank layout the process groups are
# built from ([appendix A](../parallel/grid.py)), and next to it TP 2 × PP 4, where the middle
# stages build nothing. In the first layout ranks 0, 2, 4 and 6 build: TP rank 0 of each stage
# of each of the two data-parallel replicas, so each replica reads its own data twice (once for
# the tokens of the first stage, once for the labels of the last). With PP 4, 4 of the 8 ranks
# hold no dataset at all. (The drawing helper is in the private module
# `tinytron.data._pipeline_plot`.)

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.parallel.grid import rank_layout

    plot_dataset_ranks(((2, 2), (2, 4)), builds_datasets)
    plt.show()
    assert [r for r, c in enumerate(rank_layout(8, tp=2, pp=2).coords)
            if builds_datasets(c["tp"], c["pp"], 2)] == [0, 2, 4, 6]

# %% [markdown]
# ## How many samples each split needs
#
# The builder is asked for a number of *samples* per split, derived from the run's length
# (`get_train_valid_test_num_samples`, `megatron/training/training.py:4119`): training consumes
# `train_iters · global_batch_size` samples (or `train_samples` when given); every
# `eval_interval` iterations, and once at the end, an evaluation reads `eval_iters` global
# batches, so validation needs $(\lfloor \text{train\_iters} / \text{eval\_interval} \rfloor + 1)
# \cdot \text{eval\_iters} \cdot \text{GBS}$; the test split is read once, `eval_iters` batches.
#
# For the book's running example (GBS 1024, sequences of 4096 tokens, so 4.2M tokens per step;
# see [the front page](../index.md)), take a run of 23,000 iterations, about one pass over the
# train split of a 100B-token corpus, evaluating every 1000 iterations for Megatron's default
# 100 batches.

# %%
def get_train_valid_test_num_samples(train_iters: int, global_batch_size: int,
                                     eval_interval: int, eval_iters: int,
                                     train_samples: Optional[int] = None) -> list[int]:
    """[train, valid, test] samples the datasets must provide, by Megatron's rule."""
    for name, value in (("train_iters", train_iters), ("global_batch_size", global_batch_size),
                        ("eval_interval", eval_interval)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    train = train_samples if train_samples is not None else train_iters * global_batch_size
    evaluations = train_iters // eval_interval + 1  # every eval_interval, and once at the end
    return [train, evaluations * eval_iters * global_batch_size, eval_iters * global_batch_size]


# %% [markdown]
# The answer for that run: 23,552,000 train samples ($23{,}000 \cdot 1024$), 2,457,600 valid
# ($24$ evaluations $\cdot\, 100 \cdot 1024$: at iterations 1000, 2000, …, 23000 and once more
# at the end) and 102,400 test. The builder then builds each split's index tables for exactly
# that many samples, and the blend asks each component for its weight's share of them.

# %%
if __name__ == "__main__":
    samples = get_train_valid_test_num_samples(23_000, 1024, eval_interval=1000, eval_iters=100)
    print("samples per split (train, valid, test):", [f"{n:,}" for n in samples])
    assert samples == [23_552_000, 24 * 100 * 1024, 100 * 1024]

# %% [markdown]
# ## The running example: the size of each index for 100B tokens
#
# What these samples cost on disk and in host memory. With the default split `969, 30, 1`,
# the train split holds 96.9B tokens; take documents of 1,000 tokens on average (web text),
# so 96.9M documents. The [`.bin`](indexed.py) stores every token in the smallest dtype that
# holds the vocabulary (int32 for 128,256 ids); the `.idx` stores 12 bytes per sequence and 8
# per document. The [three index tables](gpt_dataset.py) of the train split: the document index
# (int32, one entry per document per epoch), the sample index (one `(document position, offset)`
# pair per sample, int32) and the shuffle index (uint32 per sample). All four files are
# memory-mapped: resident on disk and in the page cache, read a window at a time.

# %%
def index_bytes(num_tokens: int, num_documents: int, seq_length: int, num_samples: int,
                vocab_size: int) -> dict[str, int]:
    """Bytes of the .bin/.idx of one split and of its three GPTDataset index tables."""
    epochs = get_num_epochs(num_tokens, num_samples, seq_length)
    samples = (epochs * num_tokens - 1) // seq_length  # every sample of every epoch
    big = num_documents > np.iinfo(np.int32).max  # then the sample index needs int64
    return {"epochs": epochs,
            ".bin": num_tokens * (2 if vocab_size < 65500 else 4),
            ".idx": 34 + 12 * num_documents + 8 * (num_documents + 1),
            "document index": 4 * num_documents * epochs,
            "sample index": (samples + 1) * 2 * (8 if big else 4),
            "shuffle index": samples * np.dtype(shuffle_index_dtype(samples)).itemsize}


if __name__ == "__main__":
    sizes = index_bytes(96_900_000_000, 96_900_000, 4096, samples[0], 128_256)
    for name, size in sizes.items():
        print(f"{name:15s} {size:>15,}" + ("" if name == "epochs" else f" bytes = {size / 1e9:7.2f} GB"))
    assert sizes["epochs"] == 1 and sizes[".bin"] == 387_600_000_000
    assert abs(sizes["sample index"] / sizes["shuffle index"] - 2) < 1e-6  # two int32 vs one uint32

# %% [markdown]
# What the demo prints for the train split: one epoch covers the 23.6M samples, the `.bin` is
# 387.6 GB (int32 tokens), the `.idx` 1.94 GB, and the three GPTDataset tables 0.39, 0.19 and
# 0.09 GB. The tables are small next to the corpus, but they are built once, on global rank 0,
# and every other rank waits at the barrier while they are: the reason they are cached.

# %% [markdown]
# ## One config
#
# The fields are Megatron's data flags (`megatron/training/arguments.py`, data group) with their
# defaults; `data_path` takes the `w1 p1 w2 p2` syntax — as a list, or as one string split on
# whitespace the way Megatron's command line splits it (`"0.3 wiki 0.7 code"`) — or the per-split
# paths replace it. The sequence length and batch sizes belong to the model and the schedule
# and are passed in.
#
# The flags fall into four groups, each read by one page of this chapter: *where the tokens
# are* (`data_path` or the per-split paths, `split`, `mmap_bin_files`: [the blend](blended.py)
# and [the reader](indexed.py)); *how samples are cut* (`reset_position_ids`,
# `reset_attention_mask`, `eod_mask_loss`, `create_attention_mask_in_dataloader`:
# [the GPT dataset](gpt_dataset.py)); *in which order they are read* (`seed`,
# `dataloader_type`: [the samplers](samplers.py)); and *plumbing* (`data_cache_path`,
# `num_workers`, `mid_level_dataset_surplus`).
#
# Every field is checked on construction: `num_workers="2"` or a split of `"a,b"` fails here,
# naming the field, instead of when the datasets are built.
#
# <details><summary>Megatron detail: argparse checks</summary>
#
# Megatron's argparse converts and
# checks each flag on the command line; a config built in Python skips that, hence the checks
# here.
#
# </details>
#
# ```mermaid
# flowchart TB
#   C["DataConfig"] --> B["BlendedMegatronDatasetBuilder (rank 0 builds the cache)"]
#   B --> D["train / valid / test datasets"]
#   D --> L["DataLoader + sampler from consumed_samples"]
#   L --> I["iterator on TP rank 0"]
#   I --> G["get_batch: TP broadcast, CP slice"]
# ```

# %% [markdown]
# A path argument arrives as a list, or as one string that the command line would split; the
# normalization (`path_list`) and the `--data-path` parser sit in the chapter's private module
# `tinytron.data._data_path`. The checks come first, as a mixin:

# %%
class DataConfigChecks:
    """Mixin for DataConfig: the checks on construction, and the blend the paths describe."""

    def __post_init__(self):
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            setattr(self, name, path_list(name, getattr(self, name)))
        check_fields(self)
        check_choice(self, "dataloader_type", ("single", "cyclic"))
        check_range(self, "num_workers", 0)
        check_range(self, "mid_level_dataset_surplus", 0)
        parse_and_normalize_split(self.split)  # "a,b" fails now, not when datasets are built

    def blend(self):
        """(blend, blend_per_split) for GPTDatasetConfig."""
        per_split = [self.train_data_path, self.valid_data_path, self.test_data_path]
        if any(p for p in per_split):
            if self.data_path:
                raise ValueError("give data_path or train/valid/test_data_path, not both")
            return None, [parse_data_path(p) if p else None for p in per_split]
        if not self.data_path:
            raise ValueError("DataConfig needs data_path (or train/valid/test_data_path)")
        return parse_data_path(self.data_path), None


# %% [markdown]
# The fields, with Megatron's flag names and defaults:

# %%
@document_fields
@dataclass
class DataConfig(DataConfigChecks):
    """Megatron's data flags."""
    data_path: Optional[list] = None
    """`--data-path`: prefixes, or `w1 p1 w2 p2 ...` (a list, or one whitespace-separated string)."""
    train_data_path: Optional[list] = None
    """`--train-data-path` (with valid/test, replaces data_path + split)."""
    valid_data_path: Optional[list] = None
    """`--valid-data-path`."""
    test_data_path: Optional[list] = None
    """`--test-data-path`."""
    split: str = "969, 30, 1"
    """`--split`: train, valid, test weights."""
    data_cache_path: Optional[str] = None
    """`--data-cache-path`: where index files are cached."""
    dataloader_type: str = "single"
    """`--dataloader-type`: single (sequential) or cyclic (random)."""
    num_workers: int = 2
    """`--num-workers` of the DataLoader."""
    seed: int = 1234
    """`--seed`: the dataset shuffles."""
    mid_level_dataset_surplus: float = 0.005
    """`--mid-level-dataset-surplus`."""
    reset_position_ids: bool = False
    """`--reset-position-ids`."""
    reset_attention_mask: bool = False
    """`--reset-attention-mask`."""
    eod_mask_loss: bool = False
    """`--eod-mask-loss`."""
    create_attention_mask_in_dataloader: bool = True
    """False = `--no-create-attention-mask-in-dataloader`."""
    mmap_bin_files: bool = True
    """False = `--no-mmap-bin-files`."""
    sft: bool = False
    """`--sft`: data paths are chat JSONL files, packed by the SFT dataset (prompt tokens: no loss)."""
    extra: dict = field(default_factory=dict)
    """Room for site-specific flags (ignored here)."""


# %% [markdown]
# ## The two calls a trainer makes
#
# `build_train_valid_test_datasets` turns the config and those sample counts into the three
# datasets (on the ranks that build them); `build_data_iterators` wraps each in a loader for
# this data-parallel rank that starts at its `consumed_samples`. A trainer passes the checkpoint's
# train `consumed_samples` (0 for a new run) and starts validation and test at 0. On ranks that
# build nothing the datasets are `None`, and so are their iterators: exactly the ranks whose
# `get_batch` receives by broadcast or needs no data.

# %%
def build_train_valid_test_datasets(cfg: DataConfig, seq_length: int,
                                    num_samples: Sequence[Optional[int]],
                                    is_built_on_rank: Callable[[], bool], eod_id: int,
                                    pad_id: int = PAD_SENTINEL) -> list:
    """[train, valid, test] GPT datasets (None where empty or not built on this rank).

    Example (one process; under torch.distributed pass `is_dataset_built_on_rank(grid)`)::

        cfg = DataConfig(data_path="0.3 data/wiki_text_document 0.7 data/code_text_document",
                         split="90,5,5")
        train, valid, test = build_train_valid_test_datasets(
            cfg, seq_length=128, num_samples=[1000, 50, 50], is_built_on_rank=lambda: True,
            eod_id=tokenizer.eod)
    """
    blend, per_split = cfg.blend()
    gcfg = GPTDatasetConfig(
        sequence_length=seq_length, random_seed=cfg.seed, blend=blend, blend_per_split=per_split,
        split=cfg.split, path_to_cache=cfg.data_cache_path, mmap_bin_files=cfg.mmap_bin_files,
        mid_level_dataset_surplus=cfg.mid_level_dataset_surplus, eod_id=eod_id, pad_id=pad_id,
        reset_position_ids=cfg.reset_position_ids, reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=cfg.create_attention_mask_in_dataloader)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), is_built_on_rank, gcfg).build()


# %% [markdown]
# The second call: one loader per dataset, each from its own `consumed_samples`, and an
# iterator over it (a cyclic one for the random sampler, which restarts every epoch).

# %%
def build_data_iterators(cfg: DataConfig, datasets: Sequence, consumed_samples: Sequence[int],
                         micro_batch_size: int, grid) -> list:
    """Iterators over each dataset for this DP rank, resumed at its consumed_samples.

    Example::

        train_it, valid_it, test_it = build_data_iterators(cfg, [train, valid, test], [0, 0, 0],
                                                           micro_batch_size=4, grid=grid)
        batch = get_batch(train_it, grid, micro_batch_size=4, seq_length=128)
    """
    out = []
    for ds, consumed in zip(datasets, consumed_samples):
        loader = build_pretraining_data_loader(
            ds, consumed, micro_batch_size, max(grid.rank("dp"), 0), grid.size("dp"),
            cfg.dataloader_type, cfg.num_workers)
        if loader is None:
            out.append(None)
        else:
            out.append(cyclic_iter(loader) if cfg.dataloader_type == "cyclic" else iter(loader))
    return out


# %% [markdown]
# ## Memory: the pinned batches in flight
#
# The data pipeline's share of the *resident vs flowing* ledger lives on the host. The index
# files above are memory-mapped, so the operating system pages them in and out. What the
# pipeline allocates itself are batches: each loader's `num_workers` processes keep
# `prefetch_factor` (2) batches ready each, and with `pin_memory` (on whenever CUDA is present;
# [the samplers page](samplers.py)) every batch is copied into *pinned* (page-locked) host
# memory, from which the copy to the GPU runs asynchronously. That is
# `num_workers · prefetch_factor + 1` batches per loader, allocated and freed batch after batch:
# flowing memory, but host memory, which no GPU ledger counts.
#
# One micro-batch of the running example (mbs 2, 4096 tokens) is 0.2 MB of int64 tokens,
# labels and positions and fp32 loss mask, and 32 MB more for the bool attention mask
# `[2, 1, 4096, 4096]`. That mask is why Megatron lets a run skip it
# (`--no-create-attention-mask-in-dataloader`): causal attention kernels build it themselves.
# With Megatron's 2 workers and prefetch factor 2 that is 5 batches in flight per loader: the
# demo below prints 32.22 MiB per micro-batch and 161.1 MiB of pinned host memory per loader
# with the mask, 0.22 and 1.1 MiB without it.

# %%
def batch_bytes(micro_batch_size: int, seq_length: int, attention_mask: bool = True) -> int:
    """Bytes of one micro-batch as the loader yields it (int64 ids, fp32 loss mask, bool mask)."""
    per_row = seq_length * (8 + 8 + 8 + 4)  # tokens, labels, position_ids, loss_mask
    mask = micro_batch_size * seq_length * seq_length if attention_mask else 0
    return micro_batch_size * per_row + mask


if __name__ == "__main__":
    in_flight = DataConfig().num_workers * 2 + 1  # Megatron's 2 workers, prefetch_factor 2
    for mask in (True, False):
        one = batch_bytes(2, 4096, mask)
        print(f"attention mask {'on ' if mask else 'off'}: {one / 2**20:6.2f} MiB per micro-batch, "
              f"{in_flight} in flight per loader: {in_flight * one / 2**20:6.1f} MiB pinned")
    assert batch_bytes(2, 4096) - batch_bytes(2, 4096, False) == 32 * 2**20

# %% [markdown]
# ## Demo: the standard library, end to end on one process
#
# Thirty modules of Python's own standard library, preprocessed into two corpora with the
# byte tokenizer, blended 0.7/0.3, split 90/10/0 and read through `get_batch` from
# `consumed_samples = 8`: the first row of the batch must be train sample 8, and there is no
# test split.

# %%
if __name__ == "__main__":
    import os
    import tempfile

    import torch

    from tinytron.data.distribute import get_batch
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus
    from tinytron.overview.batch import ByteTokenizer
    from tinytron.parallel.grid import ParallelGrid

    tmp = tempfile.mkdtemp()
    files = stdlib_corpus(30)
    a = preprocess(["--input", *files[:15], "--output-prefix", f"{tmp}/a", "--workers", "1",
                         "--no-progress"])
    b = preprocess(["--input", *files[15:], "--output-prefix", f"{tmp}/b", "--workers", "1",
                         "--no-progress"])
    cfg = DataConfig(data_path=["0.7", a, "0.3", b], split="90,10,0", num_workers=0,
                     data_cache_path=os.path.join(tmp, "cache"))
    grid = ParallelGrid.single()
    tok = ByteTokenizer()
    train, valid, test = build_train_valid_test_datasets(
        cfg, seq_length=64, num_samples=[40, 8, None],
        is_built_on_rank=lambda: is_dataset_built_on_rank(grid), eod_id=tok.eod, pad_id=tok.pad)
    train_it, valid_it, _ = build_data_iterators(cfg, [train, valid, test], [8, 0, 0], 4, grid)
    batch = get_batch(train_it, grid, micro_batch_size=4, seq_length=64)
    print({k: tuple(v.shape) for k, v in batch.items() if v is not None})
    print("row 0:", repr(tok.decode(batch["tokens"][0])[:60]))
    assert torch.equal(batch["tokens"][0], train[8]["tokens"])  # resumed at consumed_samples = 8
    assert batch["attention_mask"].shape == (4, 1, 64, 64) and test is None

# %% [markdown]
# ## Demo: two ranks, TP 2 and then CP 2
#
# The same files and the same calls in a real two-rank gloo world, once as TP 2 and once as
# CP 2 (`tinytron.data._workers.pipeline_demo`). Under TP 2 only rank 0 builds datasets and
# holds an iterator; rank 1 receives the very same micro-batch by broadcast. Under CP 2 both
# ranks are TP rank 0 of their group and read the same sample (there is one data-parallel
# replica), then each keeps its two chunks of the sequence: rank 0 positions 0-15 and 48-63,
# rank 1 positions 16-47, so the causal-attention work is balanced.

# %%
if __name__ == "__main__":
    from tinytron.data import _workers
    from tinytron.launch import run_on_ranks

    out = run_on_ranks(_workers.pipeline_demo, 2, ["0.7", a, "0.3", b], os.path.join(tmp, "cache"),
                       timeout=120)
    for layout in ("tp2", "cp2"):
        for r in out:
            o = r[layout]
            print(f"{layout} rank {o['rank']}: built datasets={o['built']}, iterator="
                  f"{o['has_iterator']}, tokens {o['tokens']}, positions {o['positions'][0]}.."
                  f"{o['positions'][-1]} ({len(o['positions'])})")
    tp = [r["tp2"] for r in out]
    assert [o["built"] for o in tp] == [True, False] and all(o["tp_agree"] for o in tp)
    assert tp[0]["row0"] == tp[1]["row0"] == tp[0]["sample0"][:64]  # the broadcast, intact
    cp = [r["cp2"] for r in out]
    assert all(o["built"] and o["tokens"] == (4, 32) for o in cp)
    assert cp[0]["positions"] == [*range(16), *range(48, 64)] and cp[1]["positions"] == [*range(16, 48)]
    whole = cp[0]["row0"][:16] + cp[1]["row0"] + cp[0]["row0"][16:]  # chunks 0 | 1, 2 | 3
    assert whole == cp[0]["sample0"][:64]  # the two halves put back together: the sample

# %% [markdown]
# ## Summary
#
# * `DataConfig` speaks Megatron's flags; one call builds all splits where Megatron would
#   (TP rank 0 of the first and last stages), with the sample counts the run's length implies.
# * The running example's train split: 23.6M samples, a 388 GB `.bin`, index tables of a few
#   hundred MB; the loader's pinned batches are host memory that flows.
# * Loaders start at `consumed_samples`, so a resumed run sees exactly the batches it would
#   have seen.
# * Only TP rank 0 of the first and last stages builds datasets; every other rank's iterator is
#   `None`, and `get_batch` gives it what it needs.
#
# ## How production does it
#
# * Megatron: `pretrain_gpt.py:332` (`train_valid_test_datasets_provider`),
#   `megatron/training/training.py:4157-4300` (building loaders and iterators).
# * torchtitan gives every rank its own loader (no broadcast within TP) and saves the loader's
#   state in the checkpoint (`StatefulDataLoader`) instead of a sample count.
#
# ## Exercises
#
# 1. Switch `dataloader_type` to `cyclic` and resume at `consumed_samples = 12`: which rows?
#    <details><summary>Answer</summary>
#
#    The demo's train blend holds $28 + 12 = 40$ samples, a
#    step is $4 \cdot 1 = 4$, so `active` is 40: epoch 0, offset 12, three steps in. The rank's
#    bucket of 40 is permuted by `randperm` seeded 0 and the first 12 entries skipped: the
#    batch holds train samples 20, 25, 24 and 1, the fourth micro-batch of the uninterrupted
#    cyclic run (which starts 4, 16, 21, 5).
#
#    </details>
#
# 2. Point `data_path` at your own JSONL after `tinytron-preprocess --input my.jsonl ...`.
#    <details><summary>Hint</summary>
#
#    The command prints the prefix it wrote,
#    `<output-prefix>_text_document`; that prefix, without `.bin`/`.idx`, is what `data_path`
#    takes, and its last line gives the `eod_id` and `pad_id` to pass.
#
#    </details>
#
# 3. At TP 2 × PP 4 half the ranks build no dataset. How many times is each sample read from
#    disk per step at TP 8 × PP 8 × DP 16, and does that matter next to the step time?
#    <details><summary>Answer</summary>
#
#    Twice: in each of the 16 replicas only TP rank 0 of the
#    first and of the last stage read (`builds_datasets`), 32 of the 1,024 ranks. For the
#    running example (GBS 1024, 4,097 int32 tokens a sample) that is
#    $1024 \cdot 2 \cdot 4097 \cdot 4$ = 33.6 MB per step, from the page cache or disk, next to a
#    step of about 2 s: negligible.
#
#    </details>

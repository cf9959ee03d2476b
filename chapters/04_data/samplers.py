# %% [markdown]
# # 04 · Data: samplers and exact resume
#
# Which sample indices each data-parallel rank reads, micro-batch by micro-batch — and why
# restarting from a checkpoint's `consumed_samples` gives exactly the batches an uninterrupted
# run would have seen, for any number of DP ranks.

# %%
from __future__ import annotations

from typing import Iterator

import torch

from tinytron.data._sampler_checks import check_common, check_consumed, check_one_step

__all__ = ["MegatronPretrainingSampler", "MegatronPretrainingRandomSampler",
           "build_pretraining_data_loader", "cyclic_iter"]

# %% [markdown]
# ## The sequential sampler
#
# The dataset's order is already random (its shuffle index), so the sampler only has to walk
# it: global indices `consumed, consumed+1, ...` are cut into chunks of `mbs · dp`, and DP rank
# $r$ takes the slice `[r·mbs, (r+1)·mbs)` of each chunk (`MegatronPretrainingSampler`,
# `megatron/training/datasets/data_samplers.py:115`). So in micro-batch $m$ of the run, rank $r$
# row $j$ reads sample
#
# $$\text{consumed}_0 + m\cdot \text{mbs}\cdot \text{dp} + r\cdot \text{mbs} + j.$$
#
# Everything is a function of `consumed_samples`, which the checkpoint stores: a resumed run
# starts the same walk at the same place. Worked example, mbs 2, dp 2, consumed 8: rank 0 gets
# `[8, 9]`, `[12, 13]`, …; rank 1 gets `[10, 11]`, `[14, 15]`, ….
#
# Why a count and not the loader's state: the count is one integer that every rank agrees on
# (each step consumes exactly `global batch` samples), it survives a change of the number of
# DataLoader workers, and it needs no per-rank file. A run that stopped after 1,000 steps of
# global batch 512 resumes at `consumed_samples = 512,000`, whatever it ran on before.
# The arguments that cannot describe a walk (a rank outside `[0, dp)`, no samples left) are
# refused by one-line errors in the chapter's private module `tinytron.data._sampler_checks`.
#
# ```mermaid
# flowchart LR
#   S["consumed_samples"] --> CH
#   subgraph CH ["chunk m: mbs x dp consecutive indices"]
#     A["rank 0: mbs rows"] --- B["rank 1: mbs rows"] --- C["..."] --- D["rank dp-1: mbs rows"]
#   end
#   CH --> N["chunk m+1"]
# ```

# %%
class MegatronPretrainingSampler:
    """Sequential micro-batches of sample indices for one DP rank, from consumed_samples."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        check_common(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        check_consumed(consumed_samples, total_samples)
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_times_data_parallel_size
        lo = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + step <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += step
        if start < self.total_samples and not self.drop_last:
            yield list(range(min(start + lo, self.total_samples),
                             min(start + lo + self.micro_batch_size, self.total_samples)))

# %% [markdown]
# ## The cyclic random sampler
#
# `--dataloader-type cyclic` re-permutes the samples every epoch with `torch.randperm` seeded by
# the epoch number (`MegatronPretrainingRandomSampler`, `data_samplers.py:314`). The usable part
# of an epoch is `active = total − total mod (mbs·dp)`; `epoch = consumed // active` and the
# offset into the epoch must be a whole number of `mbs·dp` steps. With `data_sharding` (default
# on) each rank permutes its own contiguous bucket of `(total // (mbs·dp))·mbs` samples and skips
# `offset / dp` of them; without it one global permutation is strided over the ranks.
#
# Worked example, 10 samples, mbs 2, dp 2: a step is 4 samples, `active` is 8 (the last 2 are
# never used), and with sharding each rank owns a bucket of $(10 // 4) \cdot 2 = 4$ samples,
# rank 0 `[0, 4)` and rank 1 `[4, 8)`. Resuming at `consumed_samples = 4` is epoch 0, offset 4:
# each rank re-creates its epoch-0 permutation and skips its first $4 / 2 = 2$ entries. At
# `consumed_samples = 8` it is epoch 1, offset 0: a new permutation, seeded by 1.
#
# Without sharding, tinytron strides only the first `active` entries of the permutation: every
# rank yields the same number of micro-batches.
#
# <details><summary>Megatron detail: the strided permutation</summary>
#
# Without sharding,
# Megatron strides the *whole* permutation of `(total // mbs)·mbs` indices, so when that is not
# a multiple of `mbs·dp` some ranks get one more micro-batch than others in the last step of an
# epoch (their `consumed_samples` then disagree). All earlier batches are identical to
# Megatron's.
#
# </details>
#
# First the order of one epoch, for one rank: the rank's bucket permuted (with sharding), or
# its stride of the global permutation (without), minus what was already consumed.

# %%
class EpochOrder:
    """Mixin for MegatronPretrainingRandomSampler: one rank's sample order in one epoch."""

    def _epoch_order(self, offset: int) -> list[int]:
        """This rank's remaining sample indices of the current epoch."""
        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.data_sharding:
            steps = self.total_samples // self.micro_batch_times_data_parallel_size
            bucket = steps * self.micro_batch_size
            start = self.data_parallel_rank * bucket
            perm = torch.randperm(bucket, generator=g).tolist()
            return [start + x for x in perm[offset // self.data_parallel_size:]]
        full = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        active = self.total_samples - self.last_batch_size
        perm = torch.randperm(full, generator=g).tolist()[:active]
        return perm[offset:][self.data_parallel_rank::self.data_parallel_size]


# %% [markdown]
# The sampler turns `consumed_samples` into the epoch and the offset, refuses an offset that
# is not a whole number of steps, and counts up as it yields.

# %%
class MegatronPretrainingRandomSampler(EpochOrder):
    """Epoch-seeded random micro-batches for one DP rank; tracks consumed_samples itself."""

    def __init__(self, dataset, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True):
        check_common(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset, self.total_samples = dataset, total_samples
        self.consumed_samples, self.micro_batch_size = consumed_samples, micro_batch_size
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        check_one_step(total_samples, self.micro_batch_times_data_parallel_size)
        self.epoch = 0

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        active = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active
        offset = self.consumed_samples % active
        if offset % self.micro_batch_times_data_parallel_size:
            raise ValueError(f"consumed_samples={self.consumed_samples} is not a whole number of "
                             f"steps of mbs*dp={self.micro_batch_times_data_parallel_size} into the epoch")
        batch = []
        for idx in self._epoch_order(offset):
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []

# %%
def cyclic_iter(iterable):
    """Iterate forever, restarting the iterable at its end (training.py:4103)."""
    while True:
        yield from iterable

# %% [markdown]
# ## The data loader
#
# `build_pretraining_data_loader` (`data_samplers.py:19`) puts the sampler in a `DataLoader` as a
# `batch_sampler`, so the loader collates one micro-batch per step. The cyclic type restarts the
# sampler every epoch (`cyclic_iter`, `training.py:4103`).

# %%
def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  dataloader_type: str = "single", num_workers: int = 0,
                                  data_sharding: bool = True):
    """A DataLoader over `dataset` yielding this DP rank's micro-batches from consumed_samples."""
    if dataset is None:
        return None
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                             data_parallel_rank, data_parallel_size)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed_samples,
                                                   micro_batch_size, data_parallel_rank,
                                                   data_parallel_size, data_sharding)
    else:
        raise ValueError(f"dataloader_type {dataloader_type!r}: expected 'single' or 'cyclic'")
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(),  # CPU: nothing to pin
                                       persistent_workers=num_workers > 0)

# %% [markdown]
# ## Demo: stop at step 3, resume, and compare with the uninterrupted run
#
# For DP sizes 1, 2 and 4 and both samplers: run the uninterrupted stream, then stop after
# every step in turn and resume from the `consumed_samples` at that point; every resumed rank
# must see exactly the micro-batches the uninterrupted run gave it from there on (for the
# cyclic sampler, across epoch boundaries too), and the ranks' slices of a step must be
# disjoint.

# %%
if __name__ == "__main__":
    mbs, total = 2, 40
    for dp in (1, 2, 4):
        for cls in ("single", "cyclic"):
            def stream(consumed, steps):
                """Micro-batches per rank for `steps` global steps from `consumed`."""
                out = []
                for r in range(dp):
                    s = (MegatronPretrainingSampler(total, consumed, mbs, r, dp) if cls == "single"
                         else MegatronPretrainingRandomSampler(None, total, consumed, mbs, r, dp))
                    it = iter(s) if cls == "single" else cyclic_iter(s)
                    out.append([next(it) for _ in range(steps)])
                return out
            steps = total // (mbs * dp) - 1 if cls == "single" else 12  # cyclic: past epoch ends
            full = stream(0, steps)
            for stop in range(1, steps):
                resumed = stream(stop * mbs * dp, steps - stop)
                assert all(full[r][stop:] == resumed[r] for r in range(dp)), (dp, cls, stop)
            step0 = sorted(i for r in range(dp) for i in full[r][0])
            assert len(set(step0)) == mbs * dp  # DP slices are disjoint
        print(f"dp={dp}: rank 0's first cyclic micro-batches {stream(0, 2)[0]}; resume exact at every step")
    print("sequential and cyclic samplers resume exactly for dp 1, 2, 4")

# %% [markdown]
# ## Summary
#
# * The sequential sampler is a pure function of `consumed_samples`: resume is exact.
# * The cyclic sampler derives `epoch` and its offset from `consumed_samples` and re-seeds
#   `randperm` with the epoch: resume is exact at every step boundary.
#
# ## How production does it
#
# * Megatron: `megatron/training/datasets/data_samplers.py` (`:19`, `:115`, `:314`);
#   `training.py:4103` (`cyclic_iter`), `:4256` (iterators).
# * torchtitan checkpoints the dataloader's own state (`StatefulDataLoader`) instead of deriving
#   it from a sample count.
#
# ## Exercises
#
# 1. Resume the sequential sampler with a *different* DP size. Which samples does the global
#    batch hold? Is that still exact?
#    <details><summary>Hint</summary>
#
#    Write out the formula above for both DP sizes from the same
#    `consumed_samples`: a step covers the consecutive indices `consumed` to `consumed + mbs·dp`
#    whatever the split over ranks. With the same global batch size the same samples are read,
#    only cut among the ranks differently.
#
#    </details>
#
# 2. Why must the random sampler's offset be a multiple of `mbs·dp`?
#    <details><summary>Hint</summary>
#
#    Look at `_epoch_order`: with sharding each rank skips
#    `offset // dp` entries of its own bucket, which counts whole micro-batches per rank only
#    when the offset is a whole number of steps; anything else would skip a different number of
#    samples on different ranks.
#
#    </details>

# %% [markdown]
# # 04 · Data: `get_batch` across tensor, context and pipeline parallelism
#
# One micro-batch leaves the data loader on a single rank and must reach every rank that needs
# it, in the shape that rank needs: whole on each tensor-parallel rank, cut into load-balanced
# pieces along the sequence for context parallelism, and only the tensors a pipeline stage
# actually uses. You will build Megatron's `get_batch` on top of the process-group grid.

# %%
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from tinytron.parallel.grid import ParallelGrid

__all__ = ["BATCH_KEYS", "stage_keys", "broadcast_from_tp_rank0", "get_batch_on_this_tp_rank",
           "thd_partitioned_indices", "get_batch_on_this_cp_rank", "get_batch", "check_token_ids",
           "TokenIdError"]

# %% [markdown]
# ## Who reads, who receives
#
# Only TP rank 0 of each model replica holds a data iterator; the dataset is built only there
# (`is_dataset_built_on_rank`, `pretrain_gpt.py:254`). It calls `next()` and broadcasts each
# tensor over its TP group, so the TP ranks — which split the *weights*, not the batch — all see
# identical tokens (`get_batch_on_this_tp_rank`, `megatron/core/utils.py:1979`). Receivers
# allocate `[mbs, seq]` buffers of the right dtype up front: int64 tokens, labels and positions,
# float32 loss mask, bool `[mbs, 1, seq, seq]` attention mask.
#
# Pipeline stages receive only what they use: the first stage embeds `tokens` (and needs
# `position_ids` and the mask); the last computes the loss from `labels` and `loss_mask` (and
# needs the mask for its attention); middle stages get their input from the previous stage and
# read nothing (`pretrain_gpt.py:76-100`). Packed SFT is the exception: every stage's attention
# needs the segment boundaries `cu_seqlens`, sent with a length prefix because their number
# varies per row.
#
# What the broadcast costs, for the running example's micro-batch (mbs 1, seq 4096): four int64
# or float32 tensors of 4,096 elements, 112 KB in all, and the bool mask of $4096^2$ elements,
# 16 MB: the mask is 99% of the bytes, which is why Megatron can leave it out of the batch
# (`create_attention_mask_in_dataloader`) and let the attention kernel apply causality itself.
#
# tinytron sends the mask as uint8 and casts it back on arrival: gloo cannot broadcast bool
# tensors. The values are the same; on NCCL the wire carries one byte per element either way.
#
# <details><summary>Megatron detail: the mask's dtype</summary>
#
# Megatron broadcasts the attention
# mask as `torch.bool` (`megatron/core/utils.py:2150`).
#
# </details>
#
# | stage | tokens | position_ids | labels | loss_mask | attention_mask | cu_seqlens, max_seqlen (SFT) |
# |---|---|---|---|---|---|---|
# | only (pp = 1) | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ |
# | first | ✓ | ✓ | – | – | ✓ | ✓ |
# | middle | – | – | – | – | – | ✓ |
# | last | – | – | ✓ | ✓ | ✓ | ✓ |
#
# ```mermaid
# flowchart LR
#   IT["data iterator (TP rank 0 only)"] -->|"next()"| R0["TP rank 0"]
#   R0 -->|"broadcast over the TP group"| R1["TP ranks 1 .. tp-1"]
#   R0 --> CP["CP slice: chunks r and 2cp-1-r"]
#   R1 --> CP
#   CP --> M["this pipeline stage's keys"]
# ```

# %%
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
_DTYPES = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
           "position_ids": torch.int64, "attention_mask": torch.bool}


def stage_keys(grid: ParallelGrid, create_attention_mask: bool = True) -> list[str]:
    """The batch tensors this pipeline stage uses (pretrain_gpt.py:76)."""
    first, last = grid.is_first_stage(), grid.is_last_stage()
    keys = []
    if first:
        keys += ["tokens", "position_ids"]
    if last:
        keys += ["labels", "loss_mask"]
    if (first or last) and create_attention_mask:
        keys.append("attention_mask")
    return keys


def broadcast_from_tp_rank0(t: Optional[torch.Tensor], shape, dtype, grid: ParallelGrid,
                            device) -> torch.Tensor:
    """TP rank 0 sends `t`; the others receive a tensor of `shape`/`dtype` (bool travels as uint8)."""
    wire = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool broadcast
    if grid.rank("tp") == 0:
        buf = t.to(device=device, dtype=wire).contiguous()
    else:
        buf = torch.empty(shape, dtype=wire, device=device)
    if grid.size("tp") > 1:
        dist.broadcast(buf, src=grid.ranks("tp")[0], group=grid.group("tp"))
    return buf.to(dtype) if wire != dtype else buf


def _broadcast_varlen(t: Optional[torch.Tensor], grid: ParallelGrid, device) -> torch.Tensor:
    """cu_seqlens: int64 length first, then the int32 [1, n] tensor (utils.py:1979)."""
    n = torch.tensor([t.numel() if grid.rank("tp") == 0 else 0], dtype=torch.int64, device=device)
    if grid.size("tp") > 1:
        dist.broadcast(n, src=grid.ranks("tp")[0], group=grid.group("tp"))
    flat = None if t is None else t.reshape(1, -1)
    return broadcast_from_tp_rank0(flat, (1, int(n.item())), torch.int32, grid, device)

# %% [markdown]
# The reader side keeps Megatron's contract: `next()` is called on TP rank 0 only, and a
# non-zero TP rank that is handed an iterator ignores it — reading there would silently consume
# samples meant for later steps.

# %%
def get_batch_on_this_tp_rank(data_iterator: Optional[Iterator], grid: ParallelGrid, *,
                              micro_batch_size: int, seq_length: int,
                              create_attention_mask: bool = True, is_sft: bool = False,
                              device=None, vocab_size: Optional[int] = None) -> dict:
    """The keys this stage uses, read on TP rank 0 and broadcast over the TP group.

    Given `vocab_size`, TP rank 0 checks the token and label ids of the batch as the iterator
    made it (on the host), before anything is copied to the device."""
    device = device or grid.device
    data = None
    keys = stage_keys(grid, create_attention_mask)
    if grid.rank("tp") == 0:
        if data_iterator is None:
            raise ValueError(f"TP rank 0 (global rank {grid.global_rank}) needs a data iterator")
        data = next(data_iterator)
        if vocab_size is not None:
            check_token_ids({k: data.get(k) for k in ("tokens", "labels") if k in keys},
                            vocab_size)
    shapes = {k: (micro_batch_size, seq_length) for k in BATCH_KEYS}
    shapes["attention_mask"] = (micro_batch_size, 1, seq_length, seq_length)
    batch = {k: None for k in BATCH_KEYS}
    for k in keys:
        if data is not None and data.get(k) is None:
            raise ValueError(f"the data iterator's batch has no {k!r} (keys: {sorted(data)})")
        batch[k] = broadcast_from_tp_rank0(None if data is None else data[k], shapes[k],
                                           _DTYPES[k], grid, device)
    if is_sft:
        cu = _broadcast_varlen(None if data is None else data["cu_seqlens"], grid, device)
        batch["cu_seqlens"] = cu
        batch["max_seqlen"] = (cu[0, 1:] - cu[0, :-1]).max()  # 0-d, as sft_dataset.py returns it
    return batch

# %% [markdown]
# ## The context-parallel slice
#
# Pretraining rows are cut into $2\cdot cp$ equal chunks along the sequence and CP rank $r$
# keeps chunks $r$ and $2cp-1-r$, so every rank does the same amount of causal-attention work
# ([Appendix A's](../parallel/context_parallel.py) `slice_batch_for_context_parallel`, Megatron's
# `get_pretrain_batch_on_this_cp_rank`, `utils.py:2308`). The attention mask is cut on its query
# dimension (dim 2) only: each rank's queries still see every key.
#
# Packed SFT rows are cut *per segment* instead: each conversation between consecutive
# `cu_seqlens` is split into $2\cdot cp$ chunks the same zig-zag way, so every rank holds a
# balanced piece of every conversation (Transformer Engine's `thd_get_partitioned_indices`,
# used at `utils.py:2256`). Every segment length must then be a multiple of $2\cdot cp$ — the
# SFT dataset pads conversations to that (`sft_dataset.py:91`).
#
# Worked example, cp = 2, `cu_seqlens = [0, 8, 12]`: segment 0 has chunks of 2 → rank 0 keeps
# 0,1,6,7; segment 1 has chunks of 1 → rank 0 keeps 8, 11. Rank 1: 2,3,4,5 and 9,10.

# %%
def thd_partitioned_indices(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices of packed segments that CP rank `cp_rank` holds (zig-zag per segment)."""
    cu = [int(x) for x in cu_seqlens.reshape(-1).tolist()]
    pieces = []
    for lo, hi in zip(cu[:-1], cu[1:]):
        n = hi - lo
        if n % (2 * cp_size):
            raise ValueError(f"packed segment [{lo}, {hi}) has {n} tokens, not a multiple of "
                             f"2*cp = {2 * cp_size}; pad conversations to a multiple of it")
        c = n // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(lo + chunk * c, lo + (chunk + 1) * c))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def get_batch_on_this_cp_rank(batch: dict, grid: ParallelGrid) -> dict:
    """Slice the sequence dimension for this CP rank (utils.py:2369)."""
    if grid.size("cp") == 1:
        return batch
    if batch.get("cu_seqlens") is None:
        from tinytron.parallel.context_parallel import slice_batch_for_context_parallel

        return slice_batch_for_context_parallel(batch, grid)
    index = thd_partitioned_indices(batch["cu_seqlens"], grid.size("cp"), grid.rank("cp"))
    out = dict(batch)
    for k in ("tokens", "labels", "loss_mask", "position_ids"):
        if out.get(k) is not None:
            out[k] = out[k].index_select(1, index.to(out[k].device))
    if out.get("attention_mask") is not None:
        out["attention_mask"] = out["attention_mask"].index_select(2, index.to(out["attention_mask"].device))
    return out

# %% [markdown]
# ## Putting it together
#
# `get_batch` (`pretrain_gpt.py:76`): middle pipeline stages return all-`None` at once (unless
# SFT, whose attention needs `cu_seqlens`), everyone else does the TP broadcast and then the CP
# slice. Megatron's kernels take `cu_seqlens` directly; the book's attention takes a mask, which
# a middle stage does not receive, so the trainer runs SFT on at most two pipeline stages.
# Sequence parallelism does not appear here at all: it splits the activations inside the
# model, after the embedding.
#
# Given a `vocab_size`, `get_batch` also checks every token and label id against it. An id the
# embedding cannot hold is otherwise an opaque index error, and a label beyond the vocabulary a
# finite, meaningless loss. The check runs on TP rank 0, on the batch as the data loader made
# it, *before* the copy to the device: there the ids are host memory and reading their minimum
# and maximum costs no device synchronization, where the same check after the copy would stall
# a GPU's stream on every micro-batch. The other TP ranks, waiting in the broadcast, fail with
# the broken group when rank 0 raises (torchrun then stops the job). Chapter 01's
# `gpt_forward_step` passes the model's `vocab_size`; the tokenizer's own size is checked once
# at the start against the data's [tokenizer sidecar](preprocess.py).
#
# <details><summary>Megatron detail: no id check</summary>
#
# Megatron's `get_batch`
# (`pretrain_gpt.py:76`) checks no ids.
#
# </details>

# %%
def get_batch(data_iterator: Optional[Iterator], grid: ParallelGrid, *, micro_batch_size: int,
              seq_length: int, create_attention_mask: bool = True, is_sft: bool = False,
              device=None, vocab_size: Optional[int] = None) -> dict:
    """This rank's micro-batch: TP rank 0 reads, TP broadcast, CP slice, PP-stage keys only.

    Example::

        batch = get_batch(train_iterator, grid, micro_batch_size=4, seq_length=128,
                          vocab_size=tokenizer.vocab_size)
        loss = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                     labels=batch["labels"])
    """
    if not (grid.is_first_stage() or grid.is_last_stage() or is_sft):
        return {k: None for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(data_iterator, grid, micro_batch_size=micro_batch_size,
                                      seq_length=seq_length,
                                      create_attention_mask=create_attention_mask,
                                      is_sft=is_sft, device=device, vocab_size=vocab_size)
    return get_batch_on_this_cp_rank(batch, grid)


class TokenIdError(ValueError):
    """A token or label id outside [0, vocab_size): the data and the model disagree."""


def check_token_ids(batch: dict, vocab_size: int) -> None:
    """TokenIdError naming the key and the id of a token or label outside [0, vocab_size)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # a CUDA graph's capture reads no values; its wrapper checks each host batch
    for key in ("tokens", "labels"):
        ids = batch.get(key)
        if ids is None or ids.numel() == 0:
            continue
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise TokenIdError(f"{key} hold id {bad}, outside the vocabulary [0, {vocab_size}) "
                               f"(vocab_size={vocab_size})")

# %% [markdown]
# ## Demo: four ranks, TP 2 × CP 2
#
# Each rank builds its grid, TP rank 0 of each CP slot reads the same micro-batch from its own
# iterator, and every rank reports which global positions it received
# (`tinytron.data._workers.get_batch_demo`).

# %%
if __name__ == "__main__":
    from tinytron.data._workers import get_batch_demo
    from tinytron.launch import run_on_ranks

    results = run_on_ranks(get_batch_demo, 4, 2, 2, 1, 16)
    for r in results:
        print(f"rank {r['rank']} tp={r['tp']} cp={r['cp']}: positions {r['positions']}")
    for r in results:
        assert r["tokens_equal_tp_peer"]
        expect = [p for c in (r["cp"], 3 - r["cp"]) for p in range(4 * c, 4 * c + 4)]
        assert r["positions"] == expect

# %% [markdown]
# ## Summary
#
# * One reader per TP group; the others receive by broadcast into pre-shaped buffers.
# * CP keeps chunks $r$ and $2cp-1-r$ of every row (of every segment for packed SFT).
# * Pipeline stages receive only the tensors they use.
#
# ## How production does it
#
# * Megatron: `pretrain_gpt.py:76` (`get_batch`), `megatron/core/utils.py:1979`
#   (`get_batch_on_this_tp_rank`), `:2256`-`:2369` (CP slicing, THD via Transformer Engine).
# * torchtitan gives every rank its own loader and shards the sequence with
#   `context_parallel(...)` buffers instead of a broadcast.
#
# ## Exercises
#
# 1. Packed SFT sends `cu_seqlens` after a length prefix. Why can the receivers not allocate it
#    up front like the other tensors, and what would a receiver do without the prefix?
#    <details><summary>Hint</summary>
#
#    The other tensors are `[mbs, seq_length]`, known on every
#    rank before anything arrives. The number of segment boundaries depends on how many
#    documents the packer put in the row, which only TP rank 0 has seen: see `_broadcast_varlen`
#    and what a broadcast needs the receiver's buffer to be.
#
#    </details>
#
# 2. What goes wrong if a TP rank other than 0 also calls `next()` on its own iterator?
#    <details><summary>Hint</summary>
#
#    See the contract above `get_batch_on_this_tp_rank` and
#    `is_dataset_built_on_rank` on the [pipeline page](pipeline.py): most non-zero TP ranks
#    have no iterator at all, and one that has one would consume samples meant for later steps,
#    so its stream drifts from rank 0's and from what `consumed_samples` says.
#
#    </details>

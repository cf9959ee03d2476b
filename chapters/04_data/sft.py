# %% [markdown]
# # 04 · Data: the SFT dataset
#
# Supervised fine-tuning reads chats, not a token stream. This page wraps
# [chapter 00's packer](../00_overview/sft.py)
# into a dataset with Megatron's indexing — one JSONL record per sample, its conversations
# packed into one row with `cu_seqlens` — and adds the padding that context parallelism needs.

# %%
from __future__ import annotations

import json
from typing import Optional, Sequence

import numpy as np
import torch

from tinytron.data._chat_jsonl import read_chat_jsonl
from tinytron.data._sft_plot import plot_packed_rows
from tinytron.overview.batch import ByteTokenizer
from tinytron.overview.sft import (block_causal_mask, pack_conversations, parse_chat_record,
                                   split_conversations)

__all__ = ["read_chat_jsonl", "pad_segments_for_context_parallel", "SFTDataset"]  # noqa: F401

# %% [markdown]
# ## One record, one row
#
# Megatron's `SFTDataset` (`megatron/training/datasets/sft_dataset.py:51`) maps sample `i` to
# record `indices[i % len(indices)]` of the JSONL file: a record holds one or more
# conversations (a new one starts at each `system` message), and they are packed into a single
# row of `seq_length + 1` tokens. Everything about a row — prompt-masked targets, the label
# shift, `cu_seqlens`, per-conversation positions, the block-causal mask — is
# [chapter 00's](../00_overview/sft.py) `pack_conversations`; this page only does the indexing and the CP padding.
#
# Why pack at all: chats are short and uneven. Padding each conversation to `seq_length` would
# spend most of a row on pad tokens; packing a record's conversations into one row, with
# `cu_seqlens` marking where each starts, fills it. The block-causal mask (or, on GPU, the
# varlen attention kernel reading `cu_seqlens`) keeps a conversation from attending to the one
# before it, and positions restart at 0 in each, so every conversation is trained exactly as if
# it were alone in its row. Worked example: conversations of 7 and 5 tokens in a 16-token row,
# `cu_seqlens = [0, 7, 12, 16]`, positions `0..6, 0..4, 0..3`; the last segment is padding.
#
# A record that does not fit in one row is a `ValueError` naming the record, or, with
# `truncate=True`, the conversations that do not fit are dropped whole (a half conversation
# teaches a wrong ending).
#
# <details><summary>Megatron detail: a record too long</summary>
#
# When a record does not fit in
# one row Megatron cuts it on the right, mid-conversation.
#
# </details>
#
# The records come from a JSONL file, one chat per line; `read_chat_jsonl`, in the chapter's
# private module `tinytron.data._chat_jsonl`, reads it and names the line of a malformed record.

# %% [markdown]
# ## Padding segments for context parallelism
#
# With CP each conversation is split into $2\cdot cp$ zig-zag chunks
# ([the `get_batch` page](distribute.py)), so its
# length must be a multiple of $2\cdot cp$. Megatron pads each conversation right after
# tokenizing it (`sft_dataset.py:127-131`). We pad the packed row instead: after the last token
# of every conversation segment, insert pad positions (token 0, label 0, loss 0, positions
# continuing), taken from the row's trailing padding. Nothing trainable changes: the label of a
# conversation's last token was the next conversation's role marker, a prompt token with loss 0,
# and becomes a pad, also loss 0.
#
# Worked example, cp = 2 (multiple of 4), segments of 7 and 5 tokens in a 16-token row:
# `cu_seqlens = [0, 7, 12, 16]` becomes `[0, 8, 16]` — one pad after the first conversation, three
# after the second, and the trailing pad segment is used up.
#
# tinytron pads the packed row, so that [chapter 00's](../00_overview/sft.py) packer stays the
# one place that builds a row. The trained tokens, their labels and their positions are the
# same as Megatron's; what differs is only where the pad tokens are taken from (the row's
# trailing padding, so a row that is already full cannot be padded and raises).
#
# <details><summary>Megatron detail: where the pads come from</summary>
#
# Megatron pads each
# conversation as it tokenizes it.
#
# </details>
#
# The row's last segment is either a conversation or the trailing padding; only a
# conversation gets pads, so the padding is recognized first.

# %%
def _is_pad_tail(row: dict, lo: int, hi: int) -> bool:
    """True for the row's trailing padding segment: pad tokens (mapped to 0), no loss.

    A conversation segment always starts with a role marker id, never 0."""
    return bool((row["tokens"][lo:hi] == 0).all() and (row["loss_mask"][lo:hi] == 0).all())


# %% [markdown]
# Then each conversation is copied with its pads after it, positions continuing, and what is
# left of `seq_length` becomes the new trailing padding.

# %%
def pad_segments_for_context_parallel(row: dict, multiple: int, seq_length: int) -> dict:
    """Insert pads so every conversation segment is a multiple of `multiple` tokens."""
    if multiple == 1:
        return row
    if seq_length % multiple:
        raise ValueError(f"seq_length {seq_length} must be a multiple of 2*cp = {multiple}")
    cu = row["cu_seqlens"].tolist()
    segments = list(zip(cu[:-1], cu[1:]))
    if _is_pad_tail(row, *segments[-1]):
        segments = segments[:-1]
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    parts = {k: [] for k in keys}
    new_cu = [0]
    for lo, hi in segments:
        pad = -(hi - lo) % multiple
        for k in keys:
            parts[k].append(row[k][lo:hi])
            if k != "position_ids":
                parts[k].append(row[k].new_zeros(pad))
        last = int(row["position_ids"][hi - 1])
        parts["position_ids"].append(torch.arange(last + 1, last + 1 + pad))
        new_cu.append(new_cu[-1] + hi - lo + pad)
    if new_cu[-1] > seq_length:
        raise ValueError(f"padding conversations to a multiple of {multiple} needs {new_cu[-1]} "
                         f"tokens, more than seq_length {seq_length}")
    tail = seq_length - new_cu[-1]
    for k in keys:
        parts[k].append(torch.arange(tail) if k == "position_ids" else row[k].new_zeros(tail))
    out = {k: torch.cat(parts[k]) for k in keys}
    if tail:
        new_cu.append(seq_length)
    out["cu_seqlens"] = torch.tensor(new_cu, dtype=torch.int32)
    out["max_seqlen"] = int((out["cu_seqlens"][1:] - out["cu_seqlens"][:-1]).max())
    if "attention_mask" in row:
        out["attention_mask"] = block_causal_mask(out["cu_seqlens"], seq_length)
    return out

# %% [markdown]
# ## The dataset
#
# Sample `i` is record `indices[i % len(indices)]`, so a split asked for more samples than it
# has records walks its records again, in the same order (Megatron's `:51`); there is no
# shuffle here, because [the blend](blended.py) and [the samplers](samplers.py) already decide
# the order. A record is packed when it is read, not ahead of time, so the dataset holds only
# the parsed records.

# %%
class SFTDataset(torch.utils.data.Dataset):
    """Chat records as packed rows (sft_dataset.py:51): sample i = record indices[i % len]."""

    def __init__(self, records, seq_length: int, tokenizer: Optional[ByteTokenizer] = None,
                 indices: Optional[Sequence[int]] = None, num_samples: Optional[int] = None,
                 context_parallel_size: int = 1, truncate: bool = False,
                 create_attention_mask: bool = True):
        self.records = read_chat_jsonl(records) if isinstance(records, str) else list(records)
        self.seq_length, self.tok = seq_length, tokenizer or ByteTokenizer()
        self.indices = np.arange(len(self.records)) if indices is None else np.asarray(indices)
        if len(self.indices) == 0:
            raise ValueError("SFTDataset split holds no records")
        self.num_samples = len(self.indices) if num_samples is None else int(num_samples)
        self.cp, self.truncate = context_parallel_size, truncate
        self.create_attention_mask = create_attention_mask

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        rec_id = int(self.indices[idx % len(self.indices)])
        rec = self.records[rec_id]
        conversations = split_conversations(parse_chat_record(rec))
        try:
            rows = pack_conversations(conversations, self.seq_length, self.tok, self.truncate)
        except ValueError as err:
            raise ValueError(f"SFT record {rec_id}: {err}") from None
        if len(rows) > 1 and not self.truncate:
            raise ValueError(f"SFT record {rec_id} needs {len(rows)} rows of seq_length "
                             f"{self.seq_length}; raise seq_length or pass truncate=True")
        if self.cp > 1:  # Megatron pads only under context parallelism (sft_dataset.py:127)
            rows[0] = pad_segments_for_context_parallel(rows[0], 2 * self.cp, self.seq_length)
        row = rows[0]
        if not self.create_attention_mask:
            row.pop("attention_mask", None)
        return row

# %% [markdown]
# ## Demo: two records, with and without CP padding
#
# Record 0 holds two conversations (a new one starts at the second `system` message), record 1
# one. Packed at `seq_length` 40 with and without CP 2: the padded row's segments must all be
# multiples of 4, the tokens that carry a loss must be the same, and sample 2 must wrap around
# to record 0.

# %%
if __name__ == "__main__":
    recs = [json.loads('{"messages": [{"role": "system", "content": "be brief"}, '
                       '{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, '
                       '{"role": "system", "content": ""}, {"role": "user", "content": "hi"}, '
                       '{"role": "assistant", "content": "yo"}]}'),
            {"messages": [{"role": "user", "content": "ok?"}, {"role": "assistant", "content": "ok"}]}]
    plain = SFTDataset(recs, seq_length=40)
    cp2 = SFTDataset(recs, seq_length=40, context_parallel_size=2)
    for name, ds in (("cp=1", plain), ("cp=2", cp2)):
        row = ds[0]
        print(f"{name}: cu_seqlens {row['cu_seqlens'].tolist()}, trained labels "
              f"{ds.tok.decode(row['labels'][row['loss_mask'] > 0])!r}")
    a, b = plain[0], cp2[0]
    assert a["loss_mask"].sum() == b["loss_mask"].sum()  # padding trains nothing new
    assert all(n % 4 == 0 for n in (b["cu_seqlens"][1:] - b["cu_seqlens"][:-1]).tolist())
    assert len(plain) == 2 and torch.equal(plain[2 % len(plain)]["tokens"], a["tokens"])

# %% [markdown]
# The same row drawn both ways: each conversation segment in its own color, the tokens that
# carry a loss marked, pads in gray. Under CP 2 every segment grows to a multiple of 4 and the
# trailing padding shrinks by as much; the trained tokens are the same.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    plot_packed_rows((("cp=1", a), ("cp=2", b)), seq_length=40)
    plt.show()

# %% [markdown]
# ## In the trainer: `[data] sft = true`
#
# Megatron makes SFT a mode of the same pretraining script: `--sft`
# (`megatron/training/arguments.py:3383`) swaps `GPTDataset` for `SFTDataset`
# (`pretrain_gpt.py:344-346`), and that dataset's low-level reader opens the JSONL file itself
# (`megatron/training/datasets/sft_dataset.py:35-41`). tinytron's trainer does the same with this
# page's class: `[data] sft = true` reads `data_path` as one chat JSONL file (or one per split
# with `train/valid/test_data_path`), cuts its records into train, valid and test by
# `[data] split` with the same rounding as a `.bin/.idx` prefix's documents, and packs each
# record into one row when the sampler asks for it. The glue — checking the paths, adapting a
# Hugging Face tokenizer to the packer's role ids — is in `tinytron.data._sft_build`.
#
# Why read the JSONL directly rather than preprocess it into `.bin/.idx`: the indexed format
# holds a flat stream of token ids per document and nothing else, so the roles that decide which
# tokens carry a loss would have to travel in a second, parallel file. The chats are small next
# to a pretraining corpus and are tokenized again each time a row is read; that costs
# microseconds per row here and keeps one source of truth for the mask.
#
# Chapter 01's `gpt_forward_step(..., sft=True)` asks `get_batch` for the row's block-causal
# mask and `cu_seqlens`, and its `sft_loss_func` reports, beside the loss, the tokens that
# carried one per sample. The JSONL log therefore shows, for every step, that only the
# assistant's tokens were trained on: with answers of 5 bytes (6 tokens with `<|end|>`) and
# prompts of any length, the logged value is 6 on every record (`tests/test_train_finetune.py`).
# One row per micro-batch (`micro_batch_size = 1`): rows cannot be stacked, their `cu_seqlens`
# differ; Megatron asks the same of packed sequences elsewhere (`arguments.py:562-563`).

# %% [markdown]
# ## Summary
#
# * One JSONL record is one packed row; its conversations are [chapter 00's](../00_overview/sft.py)
#   segments.
# * For CP each conversation is padded to a multiple of $2\cdot cp$ so `get_batch` can split it.
# * The trainer runs it as `[data] sft = true`, reading the chat JSONL as Megatron's `--sft` does.
#
# ## How production does it
#
# * Megatron: `megatron/training/datasets/sft_dataset.py` (`SFTLowLevelDataset` `:14`,
#   `SFTDataset` `:51`, padding and packing `:91`); packed (THD, see
#   [chapter 00](../00_overview/sft.py)) attention through Transformer Engine.
# * torchtune and TRL pack across records into fixed rows (`PackedDataset`, `packing=True`).
#
# ## Exercises
#
# 1. How many tokens does CP padding waste for cp = 4 on your chat data?
#    <details><summary>Hint</summary>
#
#    With cp = 4 each conversation is padded to a multiple of
#    $2 \cdot 4 = 8$: it wastes $-n \bmod 8$ tokens, 0 to 7, about 3.5 on average. Sum that over
#    the `cu_seqlens` segments of your rows, or compare `cu_seqlens` before and after
#    `pad_segments_for_context_parallel(row, 8, seq_length)`.
#
#    </details>
#
# 2. Change `__getitem__` to pack greedily across records. What breaks for exact resume?
#    <details><summary>Hint</summary>
#
#    Today sample `i` is a function of `i` alone (record
#    `indices[i % len(indices)]`), which is what lets the samplers resume from
#    `consumed_samples`. With greedy packing, which records row `i` holds depends on every row
#    before it.
#
#    </details>

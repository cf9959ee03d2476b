# %% [markdown]
# # 00 · SFT: chats packed into rows
#
# Supervised fine-tuning trains on conversations, and only the assistant's words are targets.
# Megatron packs several short conversations into one fixed-length row so no compute is wasted
# on padding, and records where each one starts (`cu_seqlens`) so attention never crosses from
# one conversation into another. This page builds that packer and draws its masks.
#
# What you will build: chat → tokens + targets (prompt masked), greedy packing into rows of
# `seq_length`, `cu_seqlens`, per-conversation positions, a block-diagonal causal mask, and
# checks that reject bad records instead of training on a silently wrong mask.

# %%
from __future__ import annotations

import torch

from tinytron.overview._chat import parse_chat_record
from tinytron.overview.batch import ByteTokenizer

__all__ = [
    "IGNORE_INDEX",
    "parse_chat_record",
    "split_conversations",
    "tokenize_conversation",
    "block_causal_mask",
    "pack_conversations",
    "sft_rows_from_jsonl",
]

# %% [markdown]
# ## From a chat to tokens and targets
#
# A JSONL line holds `{"messages": [{"role": ..., "content": ...}, ...]}`; one line may hold several
# conversations, each starting at a `system` message (Megatron splits them there,
# `megatron/training/datasets/sft_dataset.py:76-90`). Megatron renders a conversation with the
# tokenizer's chat template (`tokenize_conversation`,
# `megatron/core/tokenizers/text/libraries/sft_tokenizer.py:130`); this chapter's byte-level
# template writes each message as `<|role|> content <|end|>`. The *targets* copy the tokens where the model should learn (the
# assistant's content and its closing `<|end|>`) and hold `IGNORE_INDEX = -100` everywhere else
# (`sft_dataset.py:14`, the same value PyTorch's cross entropy ignores). The role marker that opens
# the assistant turn stays a prompt token: at inference it is given, not generated.
#
# Example: system "be brief", user "2+2?", assistant "4" tokenizes to
# `<|system|> b e ... <|end|> <|user|> 2 + 2 ? <|end|> <|assistant|> 4 <|end|>` and only `4 <|end|>`
# are targets.
#
# A record is one JSON object with a `messages` list of `{"role", "content"}` dicts, the format
# of Megatron's SFT dataset and of most chat corpora. `parse_chat_record`, in the chapter's
# private module `tinytron.overview._chat`, reads one and names what is wrong with a malformed
# one (not JSON, no `messages`, a message without a string `content`). A record may hold
# several conversations: a new one starts at every `system` message, which is how one JSONL
# line can carry a whole multi-session chat.

# %% tags=["hide-input"]
IGNORE_INDEX = -100  # label value that never contributes to the loss


def split_conversations(messages: list[dict]) -> list[list[dict]]:
    """Split a message list into conversations, a new one at every system message."""
    conversations: list[list[dict]] = []
    for m in messages:
        if m["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(m)
    return conversations


def tokenize_conversation(conversation: list[dict], tok: ByteTokenizer):
    """(tokens, targets) lists for one conversation; targets are IGNORE_INDEX outside assistant turns."""
    if not conversation:
        raise ValueError("empty conversation (no messages)")
    if not any(m["role"] == "assistant" for m in conversation):
        raise ValueError(f"conversation has no assistant message, nothing to learn: {conversation!r}")
    tokens: list[int] = []
    targets: list[int] = []
    for m in conversation:
        body = tok.encode(m["content"]) + [tok.end_of_turn]
        tokens += [tok.role_id(m["role"])] + body
        learn = m["role"] == "assistant"
        targets += [IGNORE_INDEX] + (body if learn else [IGNORE_INDEX] * len(body))
    return tokens, targets


# %% [markdown]
# ## Packing: `cu_seqlens` and a block-diagonal causal mask
#
# Each row holds `seq_length + 1` tokens and is then shifted, exactly like a pretraining sample:
# `tokens = row[:-1]`, `labels = targets[1:]` (`sft_dataset.py:164-165`). Conversations are
# placed one after another while they fit in `seq_length` inputs; the next one opens a new row.
# The rest of a row is padding. `cu_seqlens` (int32) lists the segment starts plus the end:
# for conversations of 8, 11 and 8 tokens in a 32-token row it is `[0, 8, 19, 27, 32]`, the last
# segment being the padding. Position ids restart at 0 in every segment.
#
# The attention mask allows query $q$ to see key $k$ only if $k \le q$ and both lie in the same
# segment: a block-diagonal of causal triangles, `True` = masked like the pretraining mask.
# Production kernels never build this `[s, s]` tensor: they take `cu_seqlens` directly, in the
# *THD* layout (all the sequences of a pack laid end to end along one token axis T, by H heads
# of D channels, instead of a padded `[batch, seq]` grid; `PackedSeqParams(qkv_format="thd")`,
# `pretrain_gpt.py:212-233`).
#
# Loss mask: zero where the label is pad or `IGNORE_INDEX` (`sft_dataset.py:170-171`). The label
# of a conversation's last input is the next conversation's first target, a role marker, which is
# always `IGNORE_INDEX`, so no loss crosses a boundary either.
#
# A conversation longer than `seq_length` raises `ValueError` unless `truncate=True` is passed,
# in which case it is cut on the right to `seq_length` tokens and placed alone in its row.
#
# <details><summary>Megatron detail: padding and truncation</summary>
#
# Two differences from
# Megatron, both documented here: Megatron folds the trailing padding into the last
# conversation's segment (we give it its own, so real tokens never see pads), and Megatron
# silently truncates an overlong pack on the right. Here a conversation longer than
# `seq_length` raises `ValueError` unless `truncate=True` is passed.
#
# </details>

# %% tags=["hide-input"]
def block_causal_mask(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[1, s, s] bool, True = masked: causal inside each cu_seqlens segment, blocked across them."""
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != seq_length:
        raise ValueError(f"cu_seqlens must start at 0 and end at {seq_length}: {cu_seqlens.tolist()}")
    if (cu_seqlens[1:] <= cu_seqlens[:-1]).any():
        raise ValueError(f"cu_seqlens must be strictly increasing: {cu_seqlens.tolist()}")
    q = torch.arange(seq_length, device=cu_seqlens.device)
    seg = torch.bucketize(q, cu_seqlens[1:].long(), right=True)
    masked = (q[None, :] > q[:, None]) | (seg[:, None] != seg[None, :])
    return masked.unsqueeze(0)


# %% [markdown]
# Packing itself is two steps. First the conversations are grouped, in order, into rows that
# hold at most `seq_length` tokens (the overlong-conversation check lives here):

# %% tags=["hide-input"]
def _fit_conversations(encoded, seq_length: int, truncate: bool):
    """Group (tokens, targets) pairs into rows of at most seq_length tokens, in order."""
    rows, current, used = [], [], 0
    for i, (tokens, targets) in enumerate(encoded):
        if len(tokens) > seq_length:
            if not truncate:
                raise ValueError(f"conversation {i} has {len(tokens)} tokens, longer than the row "
                                 f"(seq_length={seq_length}); pass truncate=True to cut it")
            tokens, targets = tokens[:seq_length], targets[:seq_length]
        if used + len(tokens) > seq_length:
            rows.append(current)
            current, used = [], 0
        current.append((tokens, targets))
        used += len(tokens)
    if current:
        rows.append(current)
    return rows


# %% [markdown]
# Then each group becomes one row: tokens and targets laid end to end, positions restarting per
# conversation, padding to `seq_length + 1`, the shift, the loss mask and `cu_seqlens`.

# %% tags=["hide-input"]
def _build_row(convs, seq_length: int, tok: ByteTokenizer) -> dict:
    """One packed row dict from conversations that fit in seq_length tokens."""
    tokens = [t for c in convs for t in c[0]]
    targets = [t for c in convs for t in c[1]]
    positions = [p for c in convs for p in range(len(c[0]))]
    cu = [0]
    for c in convs:
        cu.append(cu[-1] + len(c[0]))
    pad_len = seq_length + 1 - len(tokens)  # >= 1: the extra label slot is always pad or next
    tokens += [tok.pad] * pad_len
    targets += [tok.pad] * pad_len
    positions += list(range(pad_len))
    if cu[-1] < seq_length:
        cu.append(seq_length)
    inputs = torch.tensor(tokens[:-1], dtype=torch.long)
    labels = torch.tensor(targets[1:], dtype=torch.long)
    loss_mask = ((labels != tok.pad) & (labels != IGNORE_INDEX)).float()
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    return {
        "tokens": inputs.masked_fill(inputs == tok.pad, 0),  # pads become 0, as gpt_dataset.py:275
        "labels": labels.masked_fill(loss_mask == 0, 0),  # -100 and pad: keep ids in vocab range
        "loss_mask": loss_mask,
        "position_ids": torch.tensor(positions[:-1], dtype=torch.long),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        "attention_mask": block_causal_mask(cu_seqlens, seq_length),
    }


# %% [markdown]
# The two entry points: conversations already split, or JSONL records straight from a file.

# %% tags=["hide-input"]
def pack_conversations(conversations: list[list[dict]], seq_length: int,
                       tok: ByteTokenizer | None = None, truncate: bool = False) -> list[dict]:
    """Tokenize conversations and pack them greedily into rows of seq_length inputs."""
    if seq_length < 2:
        raise ValueError(f"seq_length must be >= 2, got {seq_length}")
    if not conversations:
        raise ValueError("no conversations to pack")
    tok = tok or ByteTokenizer()
    encoded = [tokenize_conversation(c, tok) for c in conversations]
    return [_build_row(r, seq_length, tok) for r in _fit_conversations(encoded, seq_length, truncate)]


def sft_rows_from_jsonl(lines, seq_length: int, tok: ByteTokenizer | None = None,
                        truncate: bool = False) -> list[dict]:
    """JSONL lines (an open file, str lines or dicts) with 'messages' → packed SFT rows."""
    conversations = []
    for n, line in enumerate(lines):
        if isinstance(line, str) and not line.strip():
            continue  # a blank line (e.g. the file's trailing newline) holds no record
        try:
            conversations += split_conversations(parse_chat_record(line))
        except ValueError as err:
            raise ValueError(f"JSONL record {n}: {err}") from None
    return pack_conversations(conversations, seq_length, tok, truncate)


# %% [markdown]
# ## Demo: three chats in one 32-token row

# %% tags=["hide-input"]
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.overview.batch import plot_masks

    tok = ByteTokenizer()
    jsonl = [
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1"},
                      {"role": "assistant", "content": "2"},
                      {"role": "system", "content": ""}, {"role": "user", "content": "?"},
                      {"role": "assistant", "content": "!"}]},
    ]
    rows = sft_rows_from_jsonl(jsonl, seq_length=32, tok=tok)
    row = rows[0]
    names = [tok.decode([t]).replace("\x00", "·") for t in row["tokens"].tolist()]
    for key in ["tokens", "labels"]:
        print(f"{key:12}:", tok.decode(row[key]).replace("\x00", "·"))
    print("loss_mask   :", "".join(str(int(x)) for x in row["loss_mask"]))
    print("position_ids:", row["position_ids"].tolist())
    print("cu_seqlens  :", row["cu_seqlens"].tolist(), " max_seqlen", row["max_seqlen"])
    plot_masks(row["attention_mask"], row["loss_mask"], row["position_ids"], names,
               "packed SFT row: one causal block per conversation")
    plt.show()

    assert len(rows) == 1 and row["cu_seqlens"].tolist() == [0, 8, 19, 27, 32]
    seg = torch.bucketize(torch.arange(32), row["cu_seqlens"][1:].long(), right=True)
    allowed = ~row["attention_mask"][0]
    assert not (allowed & (seg[:, None] != seg[None, :])).any()   # never across conversations
    learned = tok.decode(row["labels"][row["loss_mask"] == 1])
    print("trained on  :", learned)
    assert learned == "yo<|end|>2<|end|>!<|end|>"                 # only assistant text + <|end|>
    for bad in ['{"text": "no messages"}', '{"messages": []}']:
        try:
            sft_rows_from_jsonl([bad], 32, tok)
            raise AssertionError("bad record accepted")
        except ValueError as err:
            print("rejected    :", err)

# %% [markdown]
# ## Summary
#
# - SFT rows are packed conversations; `cu_seqlens` marks their boundaries, position ids restart
#   per conversation, and attention is causal within a conversation and blocked across.
# - Only assistant tokens (and their closing marker) are targets; prompts, role markers and
#   padding have loss mask 0.
# - Malformed records, empty conversations and overlong conversations are errors, not silently
#   wrong masks.
#
# ## How production does it
#
# - `megatron/training/datasets/sft_dataset.py:51` (`SFTDataset`), `:76` (split on `system`),
#   `:91` (`__getitem__`: pack, truncate, pad, shift, `cu_seqlens`), padding of each conversation
#   to a multiple of `2·cp` under context parallelism.
# - `megatron/core/tokenizers/text/libraries/sft_tokenizer.py:130` (`tokenize_conversation`).
# - `pretrain_gpt.py:212-233`: the packed THD format handed to the attention kernel.
# - [Chapter 04](../04_data/distribute.py) builds `get_batch` for packed rows (the `cu_seqlens`
#   broadcast over TP/CP), and [its SFT dataset](../04_data/sft.py) reads these rows from disk.
#
# ## Exercises
#
# 1. Fold the padding into the last segment as Megatron does. Which assertion of the demo still
#    holds, and which token now attends to pads?
#
#    <details><summary>Answer</summary>
#
#    `cu_seqlens` becomes `[0, 8, 19, 32]`, so the first
#    assertion fails; the other two (no attention across segments, trained only on
#    `yo<|end|>2<|end|>!<|end|>`) still hold. No real token attends to a pad: the causal triangle
#    already forbids looking right. What changes is the other way round: the five pad queries
#    (positions 27-31) now see the last conversation's eight keys (19-26), 40 more allowed
#    entries, all with loss mask 0.
#
#    </details>
#
# 2. Pack with "best fit" instead of "in order": how many rows do 1000 random chats need each way?
#
#    <details><summary>Hint</summary>
#
#    The count depends on the random lengths, so measure it:
#    `_fit_conversations` is the only function to change. Best fit puts each conversation in the
#    open row with the least room left that still holds it, where in order closes a row at the
#    first conversation that does not fit; the gap is widest when lengths are a sizable fraction
#    of `seq_length`.
#
#    </details>
#
# 3. Why must the first token of every conversation be a non-target?
#
#    <details><summary>Hint</summary>
#
#    Follow the shift in `_build_row`: `labels = targets[1:]`, so
#    the label of a conversation's last input is the next conversation's first target. If it
#    counted, the loss would ask one conversation to predict the start of an unrelated
#    one.
#
#    </details>

# %% [markdown]
# # 00 · The three ingredients of a batch: labels, masks, positions
#
# A language-model batch is more than a block of token ids. Before the first matrix multiply,
# Megatron's dataset has already decided *what each position predicts* (the label shift),
# *what each position may look at* (the attention mask), *which predictions count* (the loss
# mask) and *where each token sits in its document* (the position ids). This page builds those
# four tensors exactly as Megatron-LM does and draws them.
#
# What you will build: a byte-level demo tokenizer, the label shift, Megatron's
# `get_ltor_masks_and_position_ids`, pad masking, and a padding sample.

# %%
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinytron.overview._plots import plot_masks

__all__ = [
    "ByteTokenizer",
    "PAD_SENTINEL",
    "split_into_samples",
    "shift_labels",
    "get_ltor_masks_and_position_ids",
    "mask_padding",
    "build_gpt_sample",
    "plot_masks",
]

# %% [markdown]
# ## A tokenizer you can read
#
# The demos in this chapter use a byte-level tokenizer: every UTF-8 byte is its own token
# (ids 0..255) and a handful of special ids sit right after them. Its vocabulary (262 ids) is
# small enough for a CPU model and every id can be printed. `EOD = 256` ends a document, `PAD = 257`
# fills rows, and four chat markers (`<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>`) are
# used by [the SFT page](sft.py). [Chapter 04](../04_data/preprocess.py) has the real tokenizers
# (BPE through `tokenizers`).
#
# Decoding is the only part with a twist: bytes must be decoded in runs, because one UTF-8
# character can span several bytes, while a special id is printed by name. The helper below does
# that; the tokenizer class after it only supplies the names.

# %% tags=["hide-input"]
def _decode_runs(ids, names: dict[int, str]) -> str:
    """Byte ids decoded as UTF-8 in runs; ids >= 256 shown by their name (or `<id>`)."""
    out, run = [], bytearray()
    for i in (int(x) for x in ids):
        if i < 256:
            run.append(i)
            continue
        out.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
        out.append(names.get(i, f"<{i}>"))
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)


# %% tags=["hide-input"]
@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus special ids for end-of-document, padding and chat roles."""

    eod: int = 256
    pad: int = 257
    system: int = 258
    user: int = 259
    assistant: int = 260
    end_of_turn: int = 261

    @property
    def vocab_size(self) -> int:
        """Number of ids: 256 bytes + 6 specials."""
        return 262

    def role_id(self, role: str) -> int:
        """The marker id that opens a message of this role."""
        ids = {"system": self.system, "user": self.user, "assistant": self.assistant}
        if role not in ids:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(ids)}")
        return ids[role]

    def encode(self, text: str) -> list[int]:
        """Text to byte ids (no specials added)."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Ids to text; special ids are shown by name, bytes are decoded as UTF-8."""
        names = {self.eod: "<eod>", self.pad: "<pad>", self.system: "<|system|>",
                 self.user: "<|user|>", self.assistant: "<|assistant|>",
                 self.end_of_turn: "<|end|>"}
        return _decode_runs(ids, names)


# %% [markdown]
# ## Ingredient 1: the label shift
#
# A GPT predicts token $t_{i+1}$ from $t_0..t_i$. Megatron does the shift in the *dataset*, not in
# the model: every sample reads `seq_length + 1` tokens `text`, and
# `tokens = text[:-1]`, `labels = text[1:]` (`megatron/core/datasets/gpt_dataset.py:241-243`).
# Samples are cut from one long token stream with stride `seq_length`, so consecutive samples
# **overlap by exactly one token**: the last label of sample $k$ is the first input token of
# sample $k+1$. Nothing is lost and nothing is predicted twice.
#
# With the extra token switched off (`add_extra_token_to_sequence=False`) the labels are the
# tokens rolled left by one and the last label becomes the pad id (`gpt_dataset.py:245-247`).
#
# Worked example, `seq_length = 4`, stream `a b c d e f g h i`:
#
# | sample | text (5 tokens) | tokens | labels |
# |---|---|---|---|
# | 0 | a b c d e | a b c d | b c d e |
# | 1 | e f g h i | e f g h | f g h i |

# %% tags=["hide-input"]
def split_into_samples(stream: torch.Tensor, seq_length: int) -> list[torch.Tensor]:
    """Cut a 1-D token stream into windows of seq_length+1 tokens with stride seq_length."""
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    num_samples = (stream.numel() - 1) // seq_length
    if num_samples < 1:
        raise ValueError(f"stream of {stream.numel()} tokens is too short for one sample of "
                         f"seq_length {seq_length} (needs {seq_length + 1})")
    return [stream[k * seq_length: k * seq_length + seq_length + 1] for k in range(num_samples)]


def shift_labels(text: torch.Tensor, pad_id: int | None = None):
    """(tokens, labels) from one sample; with pad_id set, text is not extended and the last label is pad."""
    if pad_id is None:  # add_extra_token_to_sequence=True: text has seq_length + 1 tokens
        return text[..., :-1].clone(), text[..., 1:].clone()
    labels = torch.roll(text, shifts=-1, dims=-1)
    labels[..., -1] = pad_id
    return text.clone(), labels


# %% [markdown]
# ## Ingredients 2-4: attention mask, loss mask, position ids
#
# `_get_ltor_masks_and_position_ids` (`megatron/core/datasets/gpt_dataset.py:706`) builds, for one
# sample of `s` input tokens:
#
# - **attention mask** `[1, s, s]`: start from the lower triangle (query $q$ may see key $k \le q$).
#   With `reset_attention_mask`, for each EOD at position $i$ the block `[i+1:, :i+1]` is cleared,
#   so a document never looks back into the previous one. Finally it is turned into a
#   **boolean where `True` means masked** (`mask < 0.5`, `gpt_dataset.py:778`): the polarity
#   trips people up, because many kernels use `True` = keep. Batched, the collate stacks it to
#   `[b, 1, s, s]`. With `create_attention_mask=False` no mask is built at all and the attention
#   kernel applies the causal mask itself.
# - **loss mask** `[s]` float32 ones; with `eod_mask_loss`, zero where the *input* token is EOD
#   (the prediction made *from* an EOD, i.e. "what starts the next document", is not trained).
# - **position ids** `[s]`: `arange(s)`; with `reset_position_ids` they restart at 0 right
#   after every EOD.
#
# All three switches default to `False` in Megatron.
#
# <details><summary>Megatron detail: a loop, not a closed form</summary>
#
# Megatron walks over the
# EOD positions in a Python loop; we compute the same tensors in closed form.
#
# </details>
#
# The closed form: let $d_i$ be the number of EODs at
# positions $< i$ (the document index of token $i$). Then, with resets on,
# masked$(q,k) = k > q \lor d_k \ne d_q$, and the position of token $i$ is $i$ minus the index right
# after the last EOD before it.
#
# Worked example, `s = 6`, tokens `x EOD y z EOD w` (EOD at 1 and 4): $d = 0,0,1,1,1,2$,
# positions $0,1,0,1,2,0$, loss mask with `eod_mask_loss` $1,0,1,1,0,1$.

# %% tags=["hide-input"]
def _document_index(tokens_bs: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Number of EODs strictly before each position: the document each token belongs to."""
    is_eod = (tokens_bs == eod_token).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


def _reset_positions(tokens_bs: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Positions that restart at 0 right after every EOD."""
    s = tokens_bs.shape[-1]
    idx = torch.arange(s, device=tokens_bs.device).expand_as(tokens_bs)
    after_eod = torch.zeros_like(tokens_bs, dtype=torch.bool)
    after_eod[..., 1:] = tokens_bs[..., :-1] == eod_token
    doc_start = torch.cummax(torch.where(after_eod, idx, torch.zeros_like(idx)), dim=-1).values
    return idx - doc_start


# %% [markdown]
# With $d$ and the restarted positions in hand, the function itself is a few tensor operations:
# the loss mask from the EOD test, the positions, and the causal triangle widened by the
# document test when `reset_attention_mask` is on.

# %% tags=["hide-input"]
def get_ltor_masks_and_position_ids(tokens: torch.Tensor, eod_token: int,
                                    reset_position_ids: bool = False,
                                    reset_attention_mask: bool = False,
                                    eod_mask_loss: bool = False,
                                    create_attention_mask: bool = True):
    """(attention_mask True=masked, loss_mask float32, position_ids int64) for [s] or [b, s] tokens."""
    if tokens.dim() not in (1, 2):
        raise ValueError(f"tokens must be [s] or [b, s], got shape {tuple(tokens.shape)}")
    tokens_bs = tokens.unsqueeze(0) if tokens.dim() == 1 else tokens
    b, s = tokens_bs.shape
    dev = tokens.device
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=dev)
    if eod_mask_loss:
        loss_mask[tokens_bs == eod_token] = 0.0
    if reset_position_ids:
        position_ids = _reset_positions(tokens_bs, eod_token)
    else:
        position_ids = torch.arange(s, dtype=torch.long, device=dev).expand(b, s).clone()
    attention_mask = None
    if create_attention_mask:
        q = torch.arange(s, device=dev)
        masked = (q[None, :] > q[:, None]).expand(b, s, s)  # key after query: the future
        if reset_attention_mask:
            doc = _document_index(tokens_bs, eod_token)
            masked = masked | (doc[:, :, None] != doc[:, None, :])
        attention_mask = masked.unsqueeze(1).clone()  # [b, 1, s, s]
    if tokens.dim() == 1:  # one dataset sample: [1, s, s], [s], [s] as gpt_dataset.py returns
        return (None if attention_mask is None else attention_mask[0],
                loss_mask[0], position_ids[0])
    return attention_mask, loss_mask, position_ids


# %% [markdown]
# ## Padding, and the padding sample
#
# Rows that run out of data are filled with the pad id. After the masks are built Megatron zeroes
# the loss wherever the **label** is pad, then rewrites every pad id in tokens and labels to 0 so
# the embedding lookup stays in range (`gpt_dataset.py:271-276`). When the tokenizer has no usable
# pad id, Megatron uses the sentinel `-1` (`megatron/core/datasets/megatron_dataset.py:20`), which
# is why the rewrite is needed at all. A whole sample requested with `idx=None` (used to pad a
# global batch to full size) gets an **all-zero loss mask** (`gpt_dataset.py:279-280`): it flows
# through the model but contributes nothing to the loss or its token count.

# %% tags=["hide-input"]
PAD_SENTINEL = -1  # Megatron's _PAD_TOKEN_ID when the tokenizer has no usable pad


def mask_padding(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                 pad_id: int):
    """Zero the loss where the label is pad, then map pad ids to 0 in tokens and labels."""
    loss_mask = loss_mask.clone()
    loss_mask[labels == pad_id] = 0.0
    tokens = tokens.masked_fill(tokens == pad_id, 0)
    labels = labels.masked_fill(labels == pad_id, 0)
    return tokens, labels, loss_mask


def build_gpt_sample(text: torch.Tensor, eod_token: int, pad_id: int = PAD_SENTINEL, *,
                     reset_position_ids: bool = False, reset_attention_mask: bool = False,
                     eod_mask_loss: bool = False, create_attention_mask: bool = True,
                     add_extra_token_to_sequence: bool = True,
                     is_padding_sample: bool = False) -> dict:
    """One GPT training sample dict (tokens, labels, attention_mask, loss_mask, position_ids)."""
    if text.dim() != 1:
        raise ValueError(f"text must be 1-D, got shape {tuple(text.shape)}")
    text = text.long()
    tokens, labels = shift_labels(text, None if add_extra_token_to_sequence else pad_id)
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss,
        create_attention_mask)
    tokens, labels, loss_mask = mask_padding(tokens, labels, loss_mask, pad_id)
    if is_padding_sample:
        loss_mask = torch.zeros_like(loss_mask)
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
              "position_ids": position_ids}
    if create_attention_mask:
        sample["attention_mask"] = attention_mask
    return sample


# %% [markdown]
# ## Drawing the masks
#
# A picture of the `[s, s]` attention mask (dark = may attend), the loss mask and the position
# ids makes the EOD resets visible at a glance. [The SFT page](sft.py) reuses this plot for packed rows.
# The drawing function, `plot_masks`, is in the chapter's private module
# `tinytron.overview._plots`. What to look for in the demo's picture: with
# `reset_attention_mask` the lower triangle breaks into one block per document, so a token
# never attends across an EOD; with `reset_position_ids` the position row restarts at 0 after
# each EOD; and with `eod_mask_loss` the loss row is 0 at each position whose *input* token is
# an EOD (the test is on the token, as in Megatron, not on the label).

# %% [markdown]
# ## Demo: three documents in one sample
#
# The byte tokenizer's stream `hi<eod>abc<eod>xyz<eod>` plus three pads, cut into samples of 6
# (each 7 tokens, overlapping by one), then one 11-token sample built with every reset on: the
# positions must restart after each EOD, and no document may see the one before it.

# %% tags=["hide-input"]
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    tok = ByteTokenizer()
    docs = ["hi", "abc", "xyz"]
    stream = torch.tensor([i for d in docs for i in tok.encode(d) + [tok.eod]] + [tok.pad] * 3)
    seq_length = 6
    samples = split_into_samples(stream, seq_length)
    print("stream :", tok.decode(stream))
    for k, text in enumerate(samples):
        tks, lbl = shift_labels(text)
        print(f"sample {k}: tokens {tok.decode(tks)!r:24} labels {tok.decode(lbl)!r}")
    # 1-token overlap: last label of a sample == first token of the next
    assert all(shift_labels(a)[1][-1] == shift_labels(b)[0][0] for a, b in zip(samples, samples[1:]))

    text = stream[:12]  # inputs "hi<eod>abc<eod>xyz<eod>" (11), labels end with a pad
    s = build_gpt_sample(text, tok.eod, tok.pad, reset_position_ids=True,
                         reset_attention_mask=True, eod_mask_loss=True)
    print("tokens      :", s["tokens"].tolist())
    print("position_ids:", s["position_ids"].tolist())
    print("loss_mask   :", s["loss_mask"].tolist())
    names = [tok.decode([t]) for t in s["tokens"]]
    plot_masks(s["attention_mask"], s["loss_mask"], s["position_ids"], names,
               "reset_attention_mask: documents do not see each other")
    plt.show()
    am = s["attention_mask"][0]
    assert am.dtype == torch.bool and am[0, 1]          # True = masked (the future)
    assert am[3, 2] and not am[4, 3]                    # "a" cannot see "<eod>" of "hi"; "b" sees "a"
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3]
    assert s["loss_mask"][2] == 0 and s["loss_mask"][6] == 0   # input EOD positions

    pad_row = build_gpt_sample(stream[-7:], tok.eod, tok.pad)   # "xyz<eod>" then 3 pads
    print("padded row  :", tok.decode(stream[-7:]), "-> loss_mask", pad_row["loss_mask"].tolist())
    assert (pad_row["loss_mask"][-3:] == 0).all() and (pad_row["tokens"] != tok.pad).all()
    filler = build_gpt_sample(stream[:7], tok.eod, tok.pad, is_padding_sample=True)
    assert filler["loss_mask"].sum() == 0                 # idx=None: all-zero loss mask

# %% [markdown]
# ## Summary
#
# - The label shift lives in the dataset: `seq_length + 1` tokens per sample, 1-token overlap.
# - The attention mask is boolean with `True` = masked; EOD resets block attention across
#   documents; position ids can restart at each document.
# - The loss mask removes EOD predictions (optional), pad labels, and whole padding samples.
#
# ## How production does it
#
# - `megatron/core/datasets/gpt_dataset.py:225` (`GPTDataset.__getitem__`), `:706`
#   (`_get_ltor_masks_and_position_ids`), caching of the masks when no reset is on (`:131-137`).
# - `megatron/training/utils/common_utils.py:334`: a batched variant (`[b, 1, s, s]` mask, plus
#   pad handling) used by the RL code (`megatron/rl/rl_utils.py:1490`) and the post-training
#   fine-tuning example.
# - [Chapter 04](../04_data/gpt_dataset.py) builds the real dataset (`.bin/.idx`, sample index) and
#   [`get_batch`](../04_data/distribute.py) on top of these functions; fused attention kernels take `cu_seqlens` instead of a dense mask.
#
# ## Exercises
#
# 1. Why is the loss at an EOD *input* masked and not the loss at an EOD *label*?
#
#    <details><summary>Hint</summary>
#
#    Ask what each position is asked to predict. At an EOD label
#    the model learns to end a document, which it must do at generation time. At an EOD input it
#    would have to guess the first token of an unrelated next document. See `eod_mask_loss` in
#    `get_ltor_masks_and_position_ids` above.
#
#    </details>
#
# 2. With `reset_attention_mask=False` but `reset_position_ids=True`, what does the model see?
#
#    <details><summary>Hint</summary>
#
#    Draw the demo's picture with only the position switch on:
#    the full lower triangle comes back, so each document still attends to the ones before it,
#    but its positions restart at 0 as if it were alone. Compare the attention rows and the
#    position row that `plot_masks` draws.
#
#    </details>
#
# 3. Build the `[s, s]` mask for a 4096-token sample: how many bytes is it, per micro-batch of 8?
#
#    <details><summary>Answer</summary>
#
#    The mask is `torch.bool`, one byte per entry:
#    $4096^2$ = 16,777,216 B = 16 MiB per sample, and $8 \times$ that, 134,217,728 B = 128 MiB,
#    for the `[8, 1, 4096, 4096]` batch; one reason long-sequence runs leave
#    `create_attention_mask` off and let the kernel apply the causal mask.
#
#    </details>

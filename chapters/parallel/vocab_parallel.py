# %% [markdown]
# # A.3 · The vocabulary, split: embedding and cross entropy over TP
#
# The vocabulary is the largest dimension of a language model (128,256 for Llama 3). Both ends of
# the model cut it across the `tp` ranks: the input embedding looks tokens up in a slice of the
# table, and the loss is computed from a slice of the logits without ever gathering them.

# %%
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinytron.parallel._comm import all_reduce
from tinytron.parallel.grid import ParallelGrid
from tinytron.parallel.tensor_parallel import (_check_divisible, _make_sharded_weight,
                                               reduce_from_tp_region,
                                               reduce_scatter_to_sequence_parallel_region)

__all__ = ["padded_vocab_size", "vocab_range", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy"]

# %% [markdown]
# ## Padding and ranges
#
# Megatron pads the vocabulary up to a multiple of `make_vocab_size_divisible_by × tp`
# (default 128, `megatron/core/tokenizers/utils/build_tokenizer.py:124`), so every rank gets an
# equal, GPU-friendly slice: Llama 3's 128,256 $= 501 \cdot 256$ stays as it is up to tp 2, but
# becomes 129,024 $= 126 \cdot 1024$ at tp 8; GPT-2's 50,257 becomes 50,304 even at tp 1. Rank $r$ owns rows $[r\,V/t, (r+1)\,V/t)$.

# %%
def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Round the vocabulary up to a multiple of divisible_by * tp (Megatron's padding rule)."""
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"vocab_size, tp, divisible_by must be positive, got {vocab_size}, {tp}, {divisible_by}")
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def vocab_range(vocab_size: int, grid: ParallelGrid) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this TP rank owns."""
    per_rank = _check_divisible("vocab_size", vocab_size, grid)
    start = grid.rank("tp") * per_rank
    return start, start + per_rank

# %% [markdown]
# ## Vocab-parallel embedding
#
# Each rank holds $V/t$ rows. A token outside my range looks up row 0 (any valid row) and its
# output is zeroed; the sum over TP then has exactly one non-zero contribution per token
# (`VocabParallelEmbedding`, `megatron/core/tensor_parallel/layers.py:198`, masking at
# `:292-306` in its `forward`). That sum is `reduce_from_tp_region` — or, with sequence
# parallelism, a reduce-scatter along the sequence that lands directly in the $[s/t, b, h]$
# layout the next block wants (`reduce_scatter_embeddings=True`).

# %%
class VocabParallelEmbedding(torch.nn.Module):
    """Embedding with rows split over TP: tokens [b, s] -> [b, s, h] (or [s/tp, b, h] with reduce_scatter_embeddings)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, grid: ParallelGrid, *,
                 init_method: Callable[[torch.Tensor], None] | None = None,
                 reduce_scatter_embeddings: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.grid, self.num_embeddings, self.embedding_dim = grid, num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, grid)
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        device = device if device is not None else grid.device
        self.weight = _make_sharded_weight((num_embeddings, embedding_dim), 0, grid, init_method,
                                           device, dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.grid.size("tp") > 1:
            outside = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
            local = (tokens - self.vocab_start_index).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(tokens, self.weight)
        if self.reduce_scatter_embeddings:
            out_sbh = out.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h] for the SP split
            return reduce_scatter_to_sequence_parallel_region(out_sbh, self.grid, 0)
        return reduce_from_tp_region(out, self.grid)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"rows [{self.vocab_start_index}, {self.vocab_end_index})")

# %% [markdown]
# ## Vocab-parallel cross entropy
#
# For one token with logits $z \in \mathbb{R}^V$ split as $z = [z^{(0)}, \dots, z^{(t-1)}]$ and
# target $y$:
#
# $$\ell = \log \sum_{j} e^{z_j - m} - (z_y - m), \qquad m = \max_j z_j .$$
#
# Every piece is a sum or a max over the vocabulary, so each rank computes it over its slice
# and one all-reduce finishes it: the **max** (`ReduceOp.MAX`, for stability), then the
# **target logit** (only the rank that owns $y$ contributes; the others add 0) and the
# **sum of exponentials** (`megatron/core/tensor_parallel/cross_entropy.py:32-116`, autograd
# class `:119`). Three all-reduces of $[b, s]$ floats instead of gathering $[b, s, V]$.
#
# The gradient needs no communication at all: $\partial \ell / \partial z_j = \mathrm{softmax}(z)_j -
# \mathbb{1}[j = y]$, and each rank already holds its slice of the softmax
# ($e^{z_j - m} / \sum$). The loss is computed in fp32 whatever the logits' dtype.
#
# Worked example, $V = 4$ split over 2 ranks, logits $[1, 2 \mid 3, 0]$, target 2: rank 0 has
# local max 2, rank 1 has 3, global $m = 3$; sums $e^{-2} + e^{-1} = 0.503$ and
# $e^{0} + e^{-3} = 1.050$, total 1.553; rank 1 owns the target, $z_y - m = 0$; the loss is
# $\log 1.553 = 0.440$ — the demo below checks this number.
#
# ```mermaid
# flowchart LR
#   subgraph r0["TP rank 0: logits [1, 2]"]
#     M0["local max 2"]
#     S0["local Σ e^(z−m) = 0.503"]
#     T0["target logit: not mine, 0"]
#   end
#   subgraph r1["TP rank 1: logits [3, 0]"]
#     M1["local max 3"]
#     S1["local Σ e^(z−m) = 1.050"]
#     T1["target logit: z_y − m = 0"]
#   end
#   M0 --> AM["all-reduce MAX: m = 3"]
#   M1 --> AM
#   AM --> S0
#   AM --> S1
#   S0 --> AS["all-reduce SUM: 1.553"]
#   S1 --> AS
#   T0 --> AT["all-reduce SUM: 0"]
#   T1 --> AT
#   AS --> L["loss = log 1.553 − 0 = 0.440<br/>(on every rank)"]
#   AT --> L
# ```

# %%
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_local, labels, grid, vocab_start):
        if grid.size("tp") == 1:
            return _one_rank_forward(ctx, logits_local, labels)
        local_max = logits_local.float().max(dim=-1).values
        global_max = local_max.clone()
        if grid.size("tp") > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=grid.group("tp"))
        z = logits_local.float() - global_max.unsqueeze(-1)
        local_v = z.shape[-1]
        outside = (labels < vocab_start) | (labels >= vocab_start + local_v)
        idx = (labels.long() - vocab_start).masked_fill(outside, 0)
        target = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp_z = z.exp()
        sum_exp = all_reduce(exp_z.sum(dim=-1), grid, "tp")
        target = all_reduce(target, grid, "tp")
        ctx.save_for_backward(exp_z.div_(sum_exp.unsqueeze(-1)), idx, outside)
        ctx.in_dtype, ctx.saved_log_p = logits_local.dtype, False
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss):
        saved, idx, outside = ctx.saved_tensors
        # the softmax, as a new tensor the gradient is built in (TP 1 saved log p: see below)
        grad = saved.exp() if ctx.saved_log_p else saved.clone()
        # Subtract the one-hot only on the rank that owns the target.
        grad.scatter_add_(-1, idx.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


# %% [markdown]
# **One rank.** With the whole vocabulary on one rank there is nothing to reduce, and the
# chain above — the max, the shifted logits $z$, their exponential, its sum, the division —
# is five passes over $[b, s, V]$ with $z$ and $e^z$ alive together. `torch.log_softmax` does
# the max, the sum and the shift in one pass per row and writes $\log p$ once; the loss is
# $-\log p_y$. The backward needs the softmax as a new tensor anyway, the one the gradient is
# built in (the chain above copies its saved softmax for that), so this path saves $\log p$
# and the backward takes $e^{\log p}$ there: the same numbers as the chain's softmax, one
# pass over $[b, s, V]$ fewer than exponentiating in the forward and copying in the backward.
# It saves as many bytes as every other layout (log p instead of the softmax, the target ids,
# the target mask), and the forward holds one $[b, s, V]$ temporary less (chapter 07's peak
# counts it). The numbers agree with the chain to fp32 rounding (the sum is taken in another
# order), not bit for bit. A label outside the vocabulary gets the loss the chain gives it at
# any TP size, $\log \sum_j e^{z_j - m}$, which needs the max again (one read-only pass).
#
# <details><summary>Megatron detail: no one-rank special case</summary>
#
# Megatron has no such special case: its `VocabParallelCrossEntropy` runs the chain at TP 1
# too (`megatron/core/tensor_parallel/cross_entropy.py:32-116`); PyTorch's `F.cross_entropy`
# is this `log_softmax` plus a gather.
#
# </details>

# %%
def _one_rank_forward(ctx, logits, labels):
    """TP 1: loss -log p_y from one log_softmax pass; saves what the chain saves."""
    x = logits.float()
    outside = (labels < 0) | (labels >= x.shape[-1])
    idx = labels.long().masked_fill(outside, 0).unsqueeze(-1)
    log_p = torch.log_softmax(x, dim=-1)
    target = log_p.gather(-1, idx).squeeze(-1)
    # outside the vocabulary: log sum exp(z - max), as the chain (no one-hot in the backward)
    shifted_lse = x.gather(-1, idx).squeeze(-1) - x.amax(dim=-1) - target
    ctx.save_for_backward(log_p, idx.squeeze(-1), outside)
    ctx.in_dtype, ctx.saved_log_p = logits.dtype, True
    return torch.where(outside, shifted_lse, -target)


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, labels: torch.Tensor,
                                 grid: ParallelGrid) -> torch.Tensor:
    """Per-token CE (fp32, shape of labels) from this rank's vocab slice of the logits [..., V/tp]."""
    if logits_local.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits_local.shape)} and labels {tuple(labels.shape)} "
                         "must agree on all but the last (vocab) dim")
    vocab_start = grid.rank("tp") * logits_local.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits_local, labels, grid, vocab_start)

# %% [markdown]
# ## Demo
#
# First the worked example on one rank, then two ranks: an embedding lookup and the loss over
# split logits, compared with `nn.Embedding` and `F.cross_entropy` on the full tensors
# (values and gradients).

# %%
if __name__ == "__main__":
    grid1 = ParallelGrid.single()
    z = torch.tensor([[1.0, 2.0, 3.0, 0.0]], requires_grad=True)
    loss = vocab_parallel_cross_entropy(z, torch.tensor([2]), grid1)
    loss.sum().backward()
    print(f"worked example: loss {loss.item():.3f}, grad {z.grad.numpy().round(3)}")
    assert abs(loss.item() - 0.440) < 1e-3
    assert torch.allclose(loss, F.cross_entropy(z.detach(), torch.tensor([2]), reduction="none"))
    assert abs(z.grad.sum().item()) < 1e-6  # softmax - one-hot sums to zero
    assert padded_vocab_size(50257, 1) == 50304 and padded_vocab_size(128256, 2) == 128256
    assert padded_vocab_size(128256, 8) == 129024

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.parallel._workers import vocab_parity

    errors = run_on_ranks(vocab_parity, 2)
    for r, e in enumerate(errors):
        print(f"rank {r}: " + ", ".join(f"{k} {v:.1e}" for k, v in e.items()))
        assert max(e.values()) < 1e-5

# %% [markdown]
# ## Summary
#
# - The embedding masks tokens it does not own and sums over TP; the loss reduces a max, a
#   target logit and a sum of exponentials over TP, and its gradient is local.
# - Neither end of the model ever materializes the full $[b, s, V]$ tensor on one rank.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/tensor_parallel/layers.py:198` (`VocabParallelEmbedding`),
#   `megatron/core/tensor_parallel/cross_entropy.py` (the unfused version above),
#   `megatron/core/fusions/fused_cross_entropy.py` (one fused kernel per step, the three
#   all-reduces merged into fewer), and label smoothing in the same autograd class.
# - torchtitan: `loss_parallel()` from `torch.distributed.tensor.parallel` computes the same
#   loss on a vocabulary-sharded DTensor.
#
# ## Exercises
#
# 1. Merge the target-logit and sum-exp all-reduces into one (stack them) and check parity.
#
#    <details><summary>Hint</summary>
#
#    Both are sums over the TP group of per-row fp32 values, so
#    <code>torch.stack([exp_z.sum(-1), target])</code> goes through one <code>all_reduce</code>
#    and <code>unbind</code> after; the max must stay a separate all-reduce because it comes first
#    and uses another operation. Page C.3's <code>_VocabParallelCE</code> does exactly this with
#    its <code>pair</code>.
#
#    </details>
#
# 2. Add label smoothing $\epsilon$: the loss gains $-\frac{\epsilon}{V}\sum_j \log p_j$ — which
#    extra all-reduce does it need?
#
#    <details><summary>Hint</summary>
#
#    $\sum_j \log p_j = \sum_j z_j - V \log \sum_j e^{z_j}$, and
#    the log-sum-exp is already global. What is missing is each row's sum of logits over the whole
#    vocabulary: every rank sums its slice, and one more sum all-reduce (which can be stacked with
#    the other two sums) adds them.
#
#    </details>
#
# 3. Why must the max be global? Try a rank-local max and find logits where the result changes.
#
#    <details><summary>Hint</summary>
#
#    Each rank's $\sum e^{z - m_r}$ is then in its own scale
#    $e^{-m_r}$, and adding them across ranks mixes scales. Two ranks with one logit each, $0$ and
#    $10$: local maxes give $1 + 1 = 2$ where $e^{-10} + 1$ is right, so the loss is off by about
#    $\ln 2$. A local max works only with each rank's sum rescaled by $e^{m_r - m}$, as [page C.3](../kernels/cross_entropy.py)'s
#    kernel does, which needs the global max anyway.
#
#    </details>

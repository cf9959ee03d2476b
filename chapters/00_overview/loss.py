# %% [markdown]
# # 00 · One loss contract, two normalizations, one train step
#
# Pretraining, SFT and RL differ in where their tokens come from and in the per-token loss, but
# Megatron runs all three through the same schedule, backward and optimizer. The glue is a small
# contract: the user's `loss_func` returns `(loss_sum, num_tokens, report)`, and the schedule
# decides how to normalize. This page builds the contract, shows when Megatron's two
# normalizations agree and when they do not, and builds the `train_step` the rest of the
# chapter reuses for every mode.

# %%
from __future__ import annotations

from functools import partial

import torch

__all__ = [
    "lm_loss_func",
    "pretrain_forward_step",
    "microbatch_objective",
    "token_weights",
    "forward_backward",
    "reduce_reports",
    "train_step",
]

# %% [markdown]
# ## The contract
#
# `pretrain_gpt.py:121` (`loss_func`) receives the per-token losses `[b, s]` that the model's last
# stage computed from the labels, and returns three things:
#
# - `loss_sum` $= \sum_i \ell_i m_i$ in float32, where $m$ is the loss mask;
# - `num_tokens` $= \sum_i m_i$ as an int;
# - a report `{"lm loss": tensor([loss_sum, num_tokens])}`: a *pair*, so that any number of
#   micro-batches and data-parallel ranks can be combined into an exact token mean later.
#
# RL's `loss_func` (`train_rl.py:85`) has the same shape with a different $\ell$; the schedule
# does not know which mode it is running.
#
# ## Two normalizations
#
# `forward_step_calc_loss` (`megatron/core/pipeline_parallel/schedules.py:251`, lines 292-305)
# turns the 3-tuple into the scalar that is back-propagated. With $M$ micro-batches, $S_j$ the loss
# sum and $N_j$ the token count of micro-batch $j$:
#
# - default (`calculate_per_token_loss=False`): each micro-batch back-propagates
#   $S_j / \max(N_j, 1) / M$, so the gradient is that of
#   $\frac{1}{M}\sum_j \frac{S_j}{N_j}$, a **mean of per-micro-batch token means**;
# - `calculate_per_token_loss=True`: each micro-batch back-propagates the raw sum $S_j$ and
#   `finalize_model_grads` divides every gradient by the global token count $\sum_j N_j$
#   (`megatron/core/distributed/finalize_model_grads.py:546-560`), giving the gradient of
#   $\frac{\sum_j S_j}{\sum_j N_j}$, the **global per-token mean**.
#
# The two agree exactly when every micro-batch has the same $N_j$. They differ when the loss
# masks differ: with $N = (1, 3)$ and per-token losses all equal to their micro-batch's mean
# $(a, b)$, the default weighs the single token of micro-batch 1 as much as the three of
# micro-batch 2 ($\frac{a+b}{2}$), while the per-token mean gives $\frac{a + 3b}{4}$.
#
# Megatron's *logged* loss is always the global token mean: the `[sum, count]` pairs are summed
# over micro-batches and data-parallel ranks and divided (`megatron/training/training.py:2327-2345`).

# %% tags=["hide-input"]
def lm_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(loss_sum fp32, num_tokens int, report {'lm loss': [sum, count]}) from per-token losses."""
    losses = output_tensor.reshape(-1).float()
    mask = loss_mask.reshape(-1).float()
    if losses.shape != mask.shape:
        raise ValueError(f"loss_mask has {mask.numel()} entries, per-token loss {losses.numel()}")
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}
    return loss_sum, num_tokens, report


def pretrain_forward_step(model, batch: dict):
    """Run the model on one micro-batch; return (per-token loss, loss_func) as Megatron's forward_step does."""
    output = model(batch["tokens"], batch.get("position_ids"), labels=batch["labels"],
                   attention_mask=batch.get("attention_mask"))
    return output, partial(lm_loss_func, batch["loss_mask"])


def microbatch_objective(loss_sum: torch.Tensor, num_tokens: torch.Tensor, num_microbatches: int,
                         calculate_per_token_loss: bool) -> torch.Tensor:
    """The scalar one micro-batch back-propagates (schedules.py:292-305)."""
    if calculate_per_token_loss:
        return loss_sum  # grads are divided by the global token count after the last micro-batch
    return loss_sum / torch.clamp(num_tokens, min=1) / num_microbatches


# %% [markdown]
# The difference is easiest to see as the weight each loss token receives in the gradient:
# $\frac{1}{M N_j}$ by default, $\frac{1}{\sum_j N_j}$ per token. With $N = (2, 6)$ a token of the
# small micro-batch counts $\frac{1}{4}$, one of the large micro-batch $\frac{1}{12}$; per token
# every one counts $\frac{1}{8}$.

# %% tags=["hide-input"]
def token_weights(num_tokens: list[int], calculate_per_token_loss: bool) -> list[list[float]]:
    """Gradient weight of each loss token, grouped by micro-batch, under either normalization."""
    total, m = sum(num_tokens), len(num_tokens)
    if calculate_per_token_loss:
        return [[1.0 / max(total, 1)] * n for n in num_tokens]
    return [[1.0 / (m * n)] * n for n in num_tokens]


# %% [markdown]
# ## Forward-backward over micro-batches, then one optimizer step
#
# `forward_backward` is the no-pipelining schedule in miniature ([chapter 01](../01_main_loop/schedules.py) builds the real ones):
# run each micro-batch, back-propagate its objective so gradients accumulate, keep the reports.
# With `calculate_per_token_loss` it finishes as `finalize_model_grads` does, dividing every
# gradient by the total token count. `train_step` then clips, steps, and measures the update.

# %% tags=["hide-input"]
def forward_backward(model, microbatches: list[dict], forward_step=pretrain_forward_step,
                     calculate_per_token_loss: bool = False):
    """Accumulate gradients over micro-batches; return (reports, total num_tokens)."""
    if not microbatches:
        raise ValueError("forward_backward needs at least one micro-batch")
    reports, total_tokens = [], 0
    for mb in microbatches:
        output, loss_func = forward_step(model, mb)
        loss_sum, num_tokens, report = loss_func(output)
        microbatch_objective(loss_sum, num_tokens, len(microbatches),
                             calculate_per_token_loss).backward()
        reports.append(report)
        total_tokens += int(num_tokens)
    if calculate_per_token_loss:
        scale = 1.0 / max(total_tokens, 1)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return reports, total_tokens


# %% [markdown]
# The reports are not averaged as they come: each is a `[sum, count]` pair, and only the totals
# are divided, so the logged loss is the global token mean whatever the micro-batch sizes.

# %% tags=["hide-input"]
def reduce_reports(reports: list[dict]) -> dict[str, float]:
    """Sum the [sum, count] pairs of every micro-batch and divide: the logged global token mean."""
    out = {}
    for key in reports[0]:
        pair = torch.stack([r[key].reshape(-1) for r in reports]).sum(dim=0)
        out[key] = float(pair[0] / pair[1].clamp(min=1))
    return out


# %% [markdown]
# `train_step` puts the pieces in Megatron's order: zero the gradients, run every micro-batch,
# clip, step, and report the logged loss, the gradient norm and how far the weights moved.

# %% tags=["hide-input"]
def train_step(model, optimizer, microbatches: list[dict], forward_step=pretrain_forward_step, *,
               calculate_per_token_loss: bool = False, clip_grad: float = 1.0) -> dict:
    """zero grads, forward-backward, clip, optimizer step; returns losses, grad norm, update norm."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    reports, num_tokens = forward_backward(model, microbatches, forward_step,
                                           calculate_per_token_loss)
    max_norm = clip_grad if clip_grad > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    before = [p.detach().clone() for p in params]
    optimizer.step()
    update_sq = sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(params, before))
    return {**reduce_reports(reports), "num_tokens": num_tokens, "grad_norm": grad_norm,
            "update_norm": update_sq ** 0.5}


# %% [markdown]
# ## Demo: when the normalizations differ, and when they agree
#
# Two micro-batches of the same tiny model. First with loss masks that keep 2 and 6 tokens:
# the default gradient (mean of micro-batch means) differs from the global token mean, and the
# per-token mode reproduces the global mean exactly. Then with masks that keep 4 and 4 tokens:
# all three agree.

# %% tags=["hide-input"]
def _grads(model) -> torch.Tensor:
    """All gradients of a model flattened into one vector."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _demo_gradients(model, microbatches, calculate_per_token_loss):
    """Gradient vector of one forward_backward pass."""
    model.zero_grad(set_to_none=True)
    forward_backward(model, microbatches, calculate_per_token_loss=calculate_per_token_loss)
    return _grads(model)


# %% [markdown]
# Both masks run through the three ways of computing the gradient; the printed numbers are the
# relative distance of the default and of the per-token gradient from the global token mean.

# %% tags=["hide-input"]
if __name__ == "__main__":
    from tinytron.overview._tiny_model import build_demo_model

    torch.set_num_threads(1)  # tiny matrices: threads only contend on a small shared machine
    model, name = build_demo_model(vocab_size=262, seq_length=8)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 8), generator=g)
    labels = torch.randint(0, 256, (2, 8), generator=g)
    for keep in [(2, 6), (4, 4)]:
        masks = [torch.zeros(1, 8), torch.zeros(1, 8)]
        masks[0][0, :keep[0]], masks[1][0, :keep[1]] = 1, 1
        mbs = [{"tokens": tokens[j:j + 1], "labels": labels[j:j + 1], "loss_mask": masks[j]}
               for j in range(2)]
        whole = [{"tokens": tokens, "labels": labels, "loss_mask": torch.cat(masks)}]
        g_default = _demo_gradients(model, mbs, False)
        g_per_token = _demo_gradients(model, mbs, True)
        g_global = _demo_gradients(model, whole, False)   # one micro-batch = global token mean
        d1 = float((g_default - g_global).norm() / g_global.norm())
        d2 = float((g_per_token - g_global).norm() / g_global.norm())
        print(f"{name}: tokens kept {keep}: |default - global|/|global| = {d1:.3e}, "
              f"|per-token - global|/|global| = {d2:.3e}")
        assert d2 < 1e-5                                   # per-token mode: always the global mean
        assert (d1 > 1e-2) if keep[0] != keep[1] else (d1 < 1e-5)

# %% [markdown]
# The same difference as a picture: the gradient weight of each of the eight loss tokens under
# the masks that keep 2 and 6 tokens.

# %% tags=["hide-input"]
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.4))
    for per_token, offset in [(False, -0.2), (True, 0.2)]:
        w = [x for mb in token_weights([2, 6], per_token) for x in mb]
        ax.bar([i + offset for i in range(len(w))], w, width=0.4,
               label="per-token (global mean)" if per_token else "default (mean of means)")
    ax.axvline(1.5, color="gray", linestyle=":")
    ax.set_xlabel("loss token (micro-batch 1 | micro-batch 2)")
    ax.set_ylabel("gradient weight")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    assert token_weights([2, 6], False) == [[0.25] * 2, [1 / 12] * 6]
    assert token_weights([4, 4], False) == token_weights([4, 4], True)

# %% [markdown]
# Last, one full `train_step` on the 4-and-4 micro-batches: eight loss tokens, and the weights move.

# %% tags=["hide-input"]
if __name__ == "__main__":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = train_step(model, opt, mbs)
    print("train_step:", {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()})
    assert stats["num_tokens"] == 8 and stats["update_norm"] > 0

# %% [markdown]
# ## Summary
#
# - Every mode's `loss_func` returns `(loss_sum, num_tokens, report)`; the report is a
#   `[sum, count]` pair so the logged loss is an exact global token mean.
# - The default backward objective is a mean of per-micro-batch token means; it equals the global
#   token mean only when every micro-batch has the same number of loss tokens.
#   `calculate_per_token_loss` makes the gradient the global token mean by back-propagating sums and
#   dividing the gradients once by the global count.
#
# ## How production does it
#
# - `pretrain_gpt.py:121` (`loss_func`), `train_rl.py:85` (RL `loss_func`, same contract).
# - `megatron/core/pipeline_parallel/schedules.py:251` (`forward_step_calc_loss`), `:494`
#   (`backward_step`, loss scaling).
# - `megatron/core/distributed/finalize_model_grads.py:445` (division by the global token count).
# - `megatron/training/training.py:2327-2345` (logged loss). [Chapter 01](../01_main_loop/schedules.py) builds the real
#   schedules, [chapter 05](../05_buffers/finalize_model_grads.py) the gradient buffers and
#   `finalize_model_grads`, [chapter 02](../02_optimizer/mixed_precision.py) clipping and the optimizer.
#
# ## Exercises
#
# 1. With data parallelism of 2, where would the default normalization divide by 2, and where
#    would the per-token mode need an all-reduce of `num_tokens`?
#
#    <details><summary>Hint</summary>
#
#    The default divides inside each rank (by $N_j$ and $M$) and
#    then averages the two ranks' gradients in the data-parallel all-reduce: that average is the
#    division by 2. The per-token mode back-propagates raw sums, so the divisor must be the token
#    count of both ranks together; look at how `finalize_model_grads` gathers it before it
#    divides (`megatron/core/distributed/finalize_model_grads.py:546-560`).
#
#    </details>
#
# 2. Construct masks for which the default normalization *up-weights* a single padded-out sample.
#
#    <details><summary>Answer</summary>
#
#    Keep 1 token in micro-batch 1 (the rest is padding) and 7
#    in micro-batch 2. `token_weights([1, 7], False)` gives the lone token $\frac{1}{2}$ and each
#    of the others $\frac{1}{14}$; per token all eight get $\frac{1}{8}$. The padded-out sample
#    counts 4 times as much as under the global mean.
#
#    </details>

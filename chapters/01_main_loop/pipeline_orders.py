# %% [markdown]
# # 01 · Schedules: a pipeline's order, GPipe and 1F1B
#
# [01.3](microbatches.py) cut the global batch into $m$ micro-batches whose gradients
# accumulate before one optimizer step. With pipeline parallelism each micro-batch also crosses
# $p$ stages, and *which stage runs what, when* is the schedule's job. This page builds the two
# pipeline orders from scratch over appendix A's point-to-point sends: all forwards then all
# backwards (GPipe), and **1F1B**, Megatron's default. They compute the same bits; what
# separates them is memory, measured at the end. [01.5](schedules.py) turns the bare 1F1B into
# the one the trainer runs.

# %%
from __future__ import annotations

import torch

from tinytron.buffers import finalize_model_grads
from tinytron.overview.loss import microbatch_objective
from tinytron.parallel import ParallelGrid
from tinytron.parallel import pipeline_p2p as p2p

__all__ = ["forward_step", "num_warmup_microbatches_1f1b", "forward_backward_gpipe",
           "forward_backward_1f1b_bare"]

# %% [markdown]
# ## Why the order matters
#
# With pipeline parallelism the model is cut into $p$ **stages**, one per rank of the `pp`
# group. Stage $r$ cannot start micro-batch $i$ before stage $r-1$ has sent it, and cannot run
# $i$'s backward before stage $r+1$ has sent the gradient back. The naive order (all forwards,
# then all backwards: "GPipe") keeps every stage idle for $p-1$ forward and $p-1$ backward
# slots — the **bubble** — and stores the activations of all $m$ micro-batches at once.
#
# **1F1B** (one forward, one backward; Narayanan et al., *PipeDream-Flush*, and Megatron's
# default) has the same bubble but bounds memory: stage $r$ runs
#
# 1. **warmup**: $w_r = \min(p - r - 1,\ m)$ forwards (`schedules.py:2227`), just enough to fill
#    the pipeline below it;
# 2. **steady state**: $m - w_r$ rounds of *one forward, then one backward* of the oldest
#    micro-batch still in flight;
# 3. **cooldown**: the last $w_r$ backwards.
#
# A micro-batch's activations live from its forward to its backward, so stage $r$ never holds
# more than $w_r + 1 = p - r$ micro-batches' activations, whatever $m$ is. GPipe holds $m$.
#
# ### The running example
#
# The book's 7B run has TP 2, PP 2, DP 64, micro-batch 2 and global batch 1024, so
# $m = 1024 / (2 \cdot 64) = 8$ micro-batches per iteration on each pipeline:
#
# | stage $r$ | warmup $w_r$ | steady rounds | cooldown | max in flight $p - r$ |
# |---|---|---|---|---|
# | 0 (embedding, layers 0-15) | 1 | 7 | 1 | 2 |
# | 1 (layers 16-31, head, loss) | 0 | 8 | 0 | 1 |
#
# Stage 0 runs `F0 | F1 B0 F2 B1 … F7 B6 | B7`, stage 1 runs `F0 B0 F1 B1 … F7 B7`.
# Each message between them is one activation $[s/t, b, h] = [2048, 2, 4096]$ in bf16
# (sequence parallelism splits $s$ over TP), 32 MiB, and the same for its gradient: 8 sends
# in each direction per iteration. The bubble is $(p-1)/(m+p-1) = 1/9 \approx 11\%$ of the
# iteration (Narayanan et al. 2021, arXiv:2104.04473 §2.2.1: bubble $= (p-1)/m$ of the ideal
# time).
#
# ```mermaid
# flowchart LR
#   subgraph S0["stage 0: warmup 1"]
#     a0["F0"] --> a1["F1"] --> a2["B0"] --> a3["F2"] --> a4["B1"] --> a5["… F7 B6"] --> a6["B7"]
#   end
#   subgraph S1["stage 1: warmup 0"]
#     b0["F0"] --> b1["B0"] --> b2["F1"] --> b3["B1"] --> b4["… F7 B7"]
#   end
#   a0 -. "send act 0" .-> b0
#   b1 -. "send grad 0" .-> a2
# ```

# %% [markdown]
# ## One forward step and the loss contract
#
# Every schedule runs a micro-batch through a stage the same way. `forward_step` hands the
# chunk the activation received from the previous stage (`set_input_tensor`, chapter B), calls
# the user's `forward_step_func(data_iterator, model)` and, **on the last stage only**, applies
# the returned `loss_func` — chapter 00's contract
# `(loss_sum, num_tokens, {"lm loss": [sum, count]})`. What is back-propagated is chapter 00's
# `microbatch_objective`: the raw sum with `calculate_per_token_loss` (the division by the
# global token count happens once, in `finalize_model_grads`), else
# $S_j / \max(N_j, 1) / m$ (`forward_step_calc_loss`, `schedules.py:251`). A legacy 2-tuple
# `(loss, report)` is scaled by $c/m$ for $c$ context-parallel ranks, as Megatron does. Every
# other stage returns its hidden states and a token count of 0.

# %%
def _unwrap(chunk):
    """The module that owns set_input_tensor / config (through DDP's .module)."""
    while not hasattr(chunk, "set_input_tensor") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def forward_step(forward_step_func, data_iterator, model_chunk, num_microbatches: int,
                 input_tensor, forward_data_store: list, is_last_stage: bool,
                 calculate_per_token_loss: bool = True, cp_size: int = 1):
    """One micro-batch through one chunk; on the last stage, the loss to back-propagate."""
    _unwrap(model_chunk).set_input_tensor(input_tensor)
    output, loss_func = forward_step_func(data_iterator, model_chunk)
    num_tokens = torch.zeros((), dtype=torch.int)
    if not is_last_stage:
        return output, num_tokens
    result = loss_func(output)
    if len(result) == 3:
        loss_sum, num_tokens, report = result
        output = microbatch_objective(loss_sum, num_tokens, num_microbatches,
                                      calculate_per_token_loss)
    elif len(result) == 2:  # legacy contract: an already averaged loss
        loss, report = result
        output = loss * cp_size / num_microbatches
    else:
        raise ValueError(f"loss_func must return 2 or 3 values, got {len(result)}")
    forward_data_store.append(report)
    return output, num_tokens.detach().reshape(()).to(torch.int)

# %% [markdown]
# ## The naive way: all forwards, then all backwards
#
# With $p$ stages the simplest correct schedule is GPipe's (Huang et al. 2019,
# arXiv:1811.06965): every stage runs the forwards of all $m$ micro-batches, each on the input
# the previous stage sent, then the $m$ backwards, each on the gradient the next stage sent.
# Nothing can deadlock: the messages between two neighbors are posted in the same order on
# both sides. Here the backwards go oldest first, the order 1F1B will use, so the gradients
# accumulate in the same order and come out bit for bit the same; newest first (as GPipe's
# figure draws it) differs in the last bits.
#
# <details><summary>Megatron detail: how far newest-first drifts</summary>
#
# Measured: up to
# $4 \cdot 10^{-9}$ on a gradient of the tiny GPT at $m = 6$ when the backwards run newest
# first.
#
# </details>
#
# Its cost is memory: before the first backward, each stage holds the activations of all $m$
# micro-batches.

# %%
def forward_backward_gpipe(forward_step_func, data_iterator, model, num_microbatches: int,
                           shape, grid: ParallelGrid) -> list[dict]:
    """All forwards, then all backwards (GPipe): the naive pipeline schedule, for the page."""
    last, reports, pairs = grid.is_last_stage(), [], []
    num_tokens = torch.zeros((), dtype=torch.int, device=grid.device)
    for _ in range(num_microbatches):  # every forward; all m activations stay alive
        x = p2p.recv_forward(shape, grid)
        y, n = forward_step(forward_step_func, data_iterator, model, num_microbatches, x,
                            reports, last)
        p2p.send_forward(y, grid)
        pairs.append((x, y))
        num_tokens.add_(n.to(num_tokens.device))
    for x, y in pairs:  # every backward, oldest first
        torch.autograd.backward(y, grad_tensors=p2p.recv_backward(shape, grid))
        p2p.send_backward(None if x is None else x.grad, grid)
    finalize_model_grads([model], grid, num_tokens)  # the division by the token count
    return reports

# %% [markdown]
# ## 1F1B, bare
#
# `forward_backward_pipelining_without_interleaving` (`schedules.py:2089`) on stage $r$ of $p$,
# with nothing but the order of work: $w_r = \min(p-r-1, m)$ warmup forwards, $m - w_r$
# rounds of one forward then one backward, $w_r$ cooldown backwards. Two FIFO lists hold the
# (input, output) pair of every micro-batch whose backward is still to come; a backward always
# pops the oldest, so backwards run in forward order — the order GPipe above used.
#
# The messages are appendix A's named helpers. In the steady state a stage posts its output
# *and* the receive of its gradient in one exchange (`send_forward_recv_backward`), then,
# after the backward, its input gradient and the receive of the next input
# (`send_backward_recv_forward`): posting both halves at once keeps two neighbors from each
# waiting for the other to send first.
#
# Its bookkeeping comes first: `forward` runs a micro-batch and stores its pair, `backward`
# pops the oldest pair and returns the gradient of its input.

# %%
def num_warmup_microbatches_1f1b(pp_size: int, pp_rank: int, num_microbatches: int) -> int:
    """Forwards stage pp_rank runs before its first backward: min(p - r - 1, m)."""
    return min(pp_size - pp_rank - 1, num_microbatches)


class _BareStage:
    """The bare 1F1B's bookkeeping: forward stores (input, output), backward pops the oldest."""

    def __init__(self, forward_step_func, data_iterator, model, m: int, grid: ParallelGrid):
        self.func, self.data, self.model, self.m = forward_step_func, data_iterator, model, m
        self.last, self.inputs, self.outputs, self.reports = grid.is_last_stage(), [], [], []
        self.num_tokens = torch.zeros((), dtype=torch.int, device=grid.device)

    def forward(self, x):
        y, n = forward_step(self.func, self.data, self.model, self.m, x, self.reports,
                            self.last)
        self.num_tokens.add_(n.to(self.num_tokens.device))
        self.inputs.append(x)
        self.outputs.append(y)
        return y

    def backward(self, dy):
        x, y = self.inputs.pop(0), self.outputs.pop(0)  # the oldest micro-batch in flight
        torch.autograd.backward(y, grad_tensors=dy)  # dy is None for the loss
        return None if x is None else x.grad

# %% [markdown]
# The order itself, in three loops. Read it against the running example's table: on stage 0
# of $p = 2$ with $m = 8$, one warmup forward, seven steady rounds, one cooldown backward; on
# stage 1, eight rounds.

# %%
def forward_backward_1f1b_bare(forward_step_func, data_iterator, model, num_microbatches: int,
                               shape, grid: ParallelGrid) -> list[dict]:
    """1F1B on this stage and nothing else: warmup, one-forward-one-backward, cooldown."""
    m = num_microbatches
    warmup = num_warmup_microbatches_1f1b(grid.size("pp"), grid.rank("pp"), m)
    stage = _BareStage(forward_step_func, data_iterator, model, m, grid)

    # Warmup: fill the pipeline below this stage.
    for _ in range(warmup):
        x = p2p.recv_forward(shape, grid)
        p2p.send_forward(stage.forward(x), grid)

    # Steady state: forward micro-batch i + warmup, then backward micro-batch i.
    x = p2p.recv_forward(shape, grid) if warmup < m else None
    for i in range(m - warmup):
        dy = p2p.send_forward_recv_backward(stage.forward(x), shape, grid)
        dx = stage.backward(dy)
        if i < m - warmup - 1:
            x = p2p.send_backward_recv_forward(dx, shape, grid)
        else:
            p2p.send_backward(dx, grid)

    # Cooldown: the warmup's micro-batches, backward.
    for _ in range(warmup):
        dy = p2p.recv_backward(shape, grid)
        p2p.send_backward(stage.backward(dy), grid)

    finalize_model_grads([model], grid, stage.num_tokens)
    return stage.reports

# %% [markdown]
# Stage $r$ never holds more than $w_r + 1 = p - r$ pairs, whatever $m$ is: the warmup
# stores $w_r$, each steady round stores one and frees one. GPipe holds $m$. Both functions
# are tested against the trainer's 1F1B of [01.5](schedules.py) on two gloo ranks: same
# losses and bitwise the same gradients (`tests/test_main_loop_naive.py`).
#
# ## Demo: both orders on two gloo ranks
#
# The tiny GPT cut into two stages, $m = 8$ micro-batches of one sequence each: the running
# example's PP 2 and $m$ at CPU size. Each schedule runs one training step; a wrapper around
# `forward_step_func` notes every forward and, through a hook on its output, the moment that
# micro-batch's backward starts. The gradients are compared with one process running the 8
# micro-batches in turn. Then both run again under chapter 01's `LiveBytesMeter`, which keeps
# the peak of the bytes alive.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.launch import run_on_ranks
    from tinytron.main_loop._workers import naive_case

    m = 8
    stages = run_on_ranks(naive_case, 2, m, timeout=180)
    for r, res in enumerate(stages):
        print(f"stage {r} (warmup {num_warmup_microbatches_1f1b(2, r, m)})")
        for name in ("gpipe", "bare"):
            print(f"  {name:>5}: {res[name]['order']}   bitwise equal to one process: "
                  f"{res[name]['vs_reference'][1]}")
        ratio = res["peaks"]["gpipe"] / res["peaks"]["bare"]
        print(f"  peak live bytes: GPipe {res['peaks']['gpipe'] / 2**10:.0f} KiB, 1F1B "
              f"{res['peaks']['bare'] / 2**10:.0f} KiB: {ratio:.1f}x (m / (p - r) = "
              f"{m / (2 - r):.0f})")

# %% [markdown]
# The two peaks side by side: GPipe's grows with $m$, 1F1B's with $p - r$.

# %%
if __name__ == "__main__":
    fig, ax = plt.subplots(figsize=(6, 2.8))
    for k, name in enumerate(("gpipe", "bare")):
        peaks = [res["peaks"][name] / 2**10 for res in stages]
        ax.bar([r + 0.38 * k for r in range(2)], peaks, width=0.36,
               label="GPipe" if name == "gpipe" else "1F1B")
    ax.set_xticks([0.19, 1.19], ["stage 0", "stage 1"])
    ax.set_ylabel("peak live KiB")
    ax.set_title(f"p = 2, m = {m}: peak live bytes of one step (measured)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The claims: the orders of the table, the same bits as one process, and GPipe's peak about
# $m / (p - r)$ times 1F1B's (less, since both peaks also hold what a single micro-batch
# needs: exercise 1).

# %%
if __name__ == "__main__":
    assert stages[0]["bare"]["order"] == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert stages[1]["bare"]["order"] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    gpipe_order = " ".join([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    assert all(res["gpipe"]["order"] == gpipe_order for res in stages)
    assert all(res[name]["vs_reference"][1] for res in stages for name in ("gpipe", "bare"))
    for r, res in enumerate(stages):
        ratio, expected = res["peaks"]["gpipe"] / res["peaks"]["bare"], m / (2 - r)
        assert 0.6 * expected < ratio <= 1.05 * expected, (r, ratio)

# %% [markdown]
# ## Summary
#
# - A pipeline schedule is an order of forwards and backwards per stage; every correct order
#   gives the same bits when the backwards of a stage run oldest first.
# - GPipe runs all $m$ forwards, then all $m$ backwards: each stage holds $m$ micro-batches'
#   activations at its peak.
# - 1F1B runs $\min(p-r-1, m)$ warmup forwards, steady one-forward-one-backward rounds and the
#   cooldown: at most $p - r$ micro-batches alive, whatever $m$, with the same bubble
#   $(p-1)/(m+p-1)$.
#
# ## How production does it
#
# - Megatron-LM: `forward_backward_pipelining_without_interleaving`
#   (`megatron/core/pipeline_parallel/schedules.py:2089`, its warmup count at `:2227`) and
#   `forward_step_calc_loss` (`:251`), over
#   `megatron/core/pipeline_parallel/p2p_communication.py`. It has no GPipe schedule.
# - PyTorch / torchtitan: `torch.distributed.pipelining` offers both (`ScheduleGPipe`,
#   `Schedule1F1B`), chosen in `torchtitan/distributed/pipeline_parallel.py`.
#
# ## Exercises
#
# 1. The demo measured GPipe's peak at less than $m / (p - r)$ times 1F1B's, further below on
#    stage 1. What makes up the difference?
#
#    <details><summary>Hint</summary>
#
#    The ratio is of whole peaks, and both peaks hold bytes
#    that are there once whatever $m$: the temporaries of the forward or backward running at
#    the peak (on stage 1, the head's logits and the loss's work tensors). Subtract what a
#    one-micro-batch step peaks at, and compare what is left with $m / (p - r)$.
#
#    </details>
#
# 2. The running example with a global batch of 2048 instead of 1024, and then with PP 4 and
#    DP 32 at a global batch of 1024: what are $m$, the bubble, and the most micro-batches
#    stage 0 holds under 1F1B and under GPipe?
#
#    <details><summary>Answer</summary>
#
#    Batch 2048: $m = 2048 / (2 \cdot 64) = 16$, bubble
#    $(p-1)/(m+p-1) = 1/17 \approx 5.9\%$, stage 0 holds $p - 0 = 2$ under 1F1B and 16 under
#    GPipe. PP 4, DP 32: $m = 1024 / (2 \cdot 32) = 16$, bubble $3/19 \approx 15.8\%$, stage 0
#    holds $4$ under 1F1B and 16 under GPipe.
#
#    </details>
#
# 3. In steady round $i$ on stage 0 of the running example, whose output goes out and whose
#    gradient comes back in one `send_forward_recv_backward`? What is stage 1 doing in the
#    matching exchange, and what would happen if both ran a blocking send before a receive?
#
#    <details><summary>Hint</summary>
#
#    Stage 0 forwards micro-batch $i + w_0 = i + 1$ and
#    backwards micro-batch $i$: it sends $y_{i+1}$ and receives the gradient of $y_i$. Stage 1
#    has just run $F_i$ and $B_i$; its `send_backward_recv_forward` sends that gradient and
#    receives $x_{i+1}$. Each rank sends first: with a send that waits for its receive (large
#    NCCL messages do), both would wait forever.
#
#    </details>

# %% [markdown]
# # A.5 · Pipeline point-to-point: moving activations and gradients between stages
#
# A pipeline stage receives its input activation from the previous stage, sends its output to
# the next, and in backward does the reverse with gradients. This page builds those sends and
# receives (all of them on top of one batched `isend`/`irecv` exchange) in the shapes the
# [schedules of chapter 01](../01_main_loop/schedules.py) call them.

# %%
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tinytron.parallel.grid import ParallelGrid

__all__ = ["communicate", "recv_forward", "recv_backward", "send_forward", "send_backward",
           "send_forward_recv_backward", "send_backward_recv_forward", "send_forward_recv_forward",
           "send_backward_recv_backward", "send_forward_backward_recv_forward_backward"]

# %% [markdown]
# ## One exchange, four optional directions
#
# Every pipeline message is one of four: an activation **to the next** stage, a gradient **to
# the previous** one, and the two matching receives. The schedules often need a send and a
# receive at the same instant (1F1B's steady state sends an output forward while receiving a
# gradient from the same neighbor), and two blocking calls in the wrong order on two ranks
# deadlock. So every call goes through one function that posts all its operations together
# with `torch.distributed.batch_isend_irecv` and then waits (Megatron: `P2PCommunicator._communicate`
# and `_batched_p2p_ops`, `megatron/core/pipeline_parallel/p2p_communication.py:275`, `:17`).
#
# Neighbors wrap around the `pp` group: the next of the last stage is the first
# (`p2p_communication.py:155-156`). The plain helpers never use the wrap (the first stage has
# nothing to receive forward), the interleaved schedule does: virtual chunk $k$ on the last
# rank feeds chunk $k+1$ on the first rank.
#
# **Matching.** Two messages between the same pair of ranks are matched in posting order. With
# two stages the previous and the next neighbor are the same rank, so every rank posts in the
# fixed order *send-next, recv-prev, send-prev, recv-next*: rank A's send-next then pairs with
# B's recv-prev and A's send-prev with B's recv-next.
#
# **Shapes.** A receive must allocate its buffer before the data arrives, so the caller passes
# the shape: for a transformer it is $[s/cp, b, h]$, or $[s/(cp \cdot tp), b, h]$ under sequence
# parallelism, the same every micro-batch. A received activation is made a leaf that requires grad, so the stage's
# backward produces the gradient to send back.
#
# ```mermaid
# sequenceDiagram
#   participant S0 as stage 0
#   participant S1 as stage 1
#   participant S2 as stage 2
#   S0->>S1: send_forward(y0)
#   S1->>S2: send_forward(y1)
#   S2-->>S1: send_backward(dL/dy1)
#   S1-->>S0: send_backward(dL/dy0)
# ```

# %%
def _neighbors(grid: ParallelGrid) -> tuple[int, int]:
    """Global ranks of the previous and next pipeline stage (wrapping around)."""
    ranks, me = grid.ranks("pp"), grid.rank("pp")
    return ranks[(me - 1) % len(ranks)], ranks[(me + 1) % len(ranks)]


def _empty(shape: Sequence[int], dtype, device, requires_grad: bool) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad)


def communicate(grid: ParallelGrid, *, send_next: torch.Tensor | None = None,
                send_prev: torch.Tensor | None = None, recv_prev_shape: Sequence[int] | None = None,
                recv_next_shape: Sequence[int] | None = None, dtype: torch.dtype = torch.float32,
                device: torch.device | None = None, overlap_p2p_comm: bool = False):
    """Post every requested send/recv to the pp neighbors at once, wait, return (from_prev, from_next).

    With `overlap_p2p_comm`, wait for nothing: return (from_prev, from_next, handles) instead,
    the handles by name ("send_next", "recv_prev", "send_prev", "recv_next").
    """
    if grid.size("pp") == 1:
        raise ValueError("pipeline p2p needs a pp group of more than 1 rank")
    device = device if device is not None else grid.device
    prev_rank, next_rank = _neighbors(grid)
    from_prev = None if recv_prev_shape is None else _empty(recv_prev_shape, dtype, device, True)
    from_next = None if recv_next_shape is None else _empty(recv_next_shape, dtype, device, False)
    group, ops = grid.group("pp"), []
    if overlap_p2p_comm:
        return from_prev, from_next, _post_each(group, prev_rank, next_rank, send_next, from_prev,
                                                send_prev, from_next)
    # Fixed posting order; see "Matching" above.
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), next_rank, group))
    if from_prev is not None:
        ops.append(dist.P2POp(dist.irecv, from_prev, prev_rank, group))
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev.detach().contiguous(), prev_rank, group))
    if from_next is not None:
        ops.append(dist.P2POp(dist.irecv, from_next, next_rank, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return from_prev, from_next

# %% [markdown]
# ## Posted, not waited: the overlapped exchange
#
# The interleaved schedule can hide its messages behind compute (`overlap_p2p_comm`, the
# default of Megatron's training arguments for that schedule): it posts an exchange right after
# a forward or a backward and waits for each piece only when it needs it — a received input
# just before the forward that reads it, a send before its buffer is reused. For that an
# exchange returns its handles instead of waiting, one per operation and named by direction
# (Megatron's `_communicate(..., wait_on_reqs=False)` and `_p2p_ops`,
# `p2p_communication.py:55-128, 411-415`). The operations are posted one by one with
# `isend`/`irecv`, in the same fixed order as above, so the matching is unchanged.
#
# <div class="admonition note"><p class="admonition-title">tinytron differs here</p>
#
# Megatron's `_p2p_ops` posts in an even/odd order and, with two pipeline ranks, sends one
# direction over the world group (`p2p_communication.py:66-77`), so that NCCL, whose
# operations on one communicator run one after the other, can move both directions at
# once. Gloo matches the messages of each pair of ranks in posting order and runs them on its
# own threads, so tinytron keeps one group and one order for both paths.
#
# </div>

# %%
def _post_each(group, prev_rank: int, next_rank: int, send_next, recv_prev, send_prev,
               recv_next) -> dict:
    """isend/irecv each given tensor in the fixed order; {direction: handle}."""
    handles = {}
    for name, t, peer, op in (("send_next", send_next, next_rank, dist.isend),
                              ("recv_prev", recv_prev, prev_rank, dist.irecv),
                              ("send_prev", send_prev, prev_rank, dist.isend),
                              ("recv_next", recv_next, next_rank, dist.irecv)):
        if t is not None:
            buf = t.detach().contiguous() if op is dist.isend else t
            handles[name] = op(buf, peer, group=group)
    return handles

# %% [markdown]
# ## The named helpers
#
# The names are Megatron's (`P2PCommunicator.recv_forward` `:424`, `recv_backward` `:455`,
# `send_forward` `:486`, `send_backward` `:507`, `send_forward_recv_backward` `:527`,
# `send_backward_recv_forward` `:560`, `send_forward_recv_forward` `:593`,
# `send_backward_recv_backward` `:619`, `send_forward_backward_recv_forward_backward` `:645`).
# The first six are no-ops (or return `None`) on the stage with no neighbor in that direction;
# the last three are the interleaved schedule's, which decides itself whether to receive.

# %%
def recv_forward(shape: Sequence[int], grid: ParallelGrid, dtype=torch.float32) -> torch.Tensor | None:
    """The input activation from the previous stage (None on the first stage)."""
    if grid.is_first_stage():
        return None
    return communicate(grid, recv_prev_shape=shape, dtype=dtype)[0]


def recv_backward(shape: Sequence[int], grid: ParallelGrid, dtype=torch.float32) -> torch.Tensor | None:
    """The gradient of my output from the next stage (None on the last stage)."""
    if grid.is_last_stage():
        return None
    return communicate(grid, recv_next_shape=shape, dtype=dtype)[1]


def send_forward(output: torch.Tensor, grid: ParallelGrid) -> None:
    """Send my output activation to the next stage (nothing on the last stage)."""
    if not grid.is_last_stage():
        communicate(grid, send_next=output)


def send_backward(input_grad: torch.Tensor, grid: ParallelGrid) -> None:
    """Send the gradient of my input to the previous stage (nothing on the first stage)."""
    if not grid.is_first_stage():
        communicate(grid, send_prev=input_grad)


def send_forward_recv_backward(output: torch.Tensor, shape: Sequence[int], grid: ParallelGrid,
                               dtype=torch.float32) -> torch.Tensor | None:
    """Send my output forward and receive its gradient, in one exchange (None on the last stage)."""
    if grid.is_last_stage():
        return None
    return communicate(grid, send_next=output, recv_next_shape=shape, dtype=dtype)[1]


def send_backward_recv_forward(input_grad: torch.Tensor, shape: Sequence[int], grid: ParallelGrid,
                               dtype=torch.float32) -> torch.Tensor | None:
    """Send my input gradient back and receive the next input activation (None on the first stage)."""
    if grid.is_first_stage():
        return None
    return communicate(grid, send_prev=input_grad, recv_prev_shape=shape, dtype=dtype)[0]


# %% [markdown]
# The interleaved schedule's three: the ring wraps (the last rank's next is rank 0, for the
# next model chunk), and the schedule says itself whether anything comes back.

# %%
def send_forward_recv_forward(output: torch.Tensor | None, recv_prev: bool, shape: Sequence[int],
                              grid: ParallelGrid, dtype=torch.float32,
                              overlap_p2p_comm: bool = False):
    """Interleaved: send to the next rank (wrapping) and optionally receive from the previous.

    With `overlap_p2p_comm`: (the receive buffer, not yet filled, and the handles)."""
    out = communicate(grid, send_next=output, recv_prev_shape=shape if recv_prev else None,
                      dtype=dtype, overlap_p2p_comm=overlap_p2p_comm)
    return (out[0], out[2]) if overlap_p2p_comm else out[0]


def send_backward_recv_backward(input_grad: torch.Tensor | None, recv_next: bool,
                                shape: Sequence[int], grid: ParallelGrid,
                                dtype=torch.float32, overlap_p2p_comm: bool = False):
    """Interleaved: send a gradient to the previous rank (wrapping), optionally receive from the next.

    With `overlap_p2p_comm`: (the receive buffer, not yet filled, and the handles)."""
    out = communicate(grid, send_prev=input_grad, recv_next_shape=shape if recv_next else None,
                      dtype=dtype, overlap_p2p_comm=overlap_p2p_comm)
    return (out[1], out[2]) if overlap_p2p_comm else out[1]


def send_forward_backward_recv_forward_backward(
        output: torch.Tensor | None, input_grad: torch.Tensor | None, recv_prev: bool,
        recv_next: bool, shape: Sequence[int], grid: ParallelGrid, dtype=torch.float32):
    """Interleaved steady state: all four directions in one exchange; returns (from_prev, from_next)."""
    return communicate(grid, send_next=output, send_prev=input_grad,
                       recv_prev_shape=shape if recv_prev else None,
                       recv_next_shape=shape if recv_next else None, dtype=dtype)

# %% [markdown]
# ## Demo: a 3-stage pipeline equals the unsplit model
#
# Three ranks each own one `Linear(8, 8)` + `tanh` of a 3-layer model. One micro-batch goes
# forward stage by stage (`recv_forward`, `send_forward_recv_backward`), the last stage computes
# the loss and its backward, gradients flow back (`send_backward`), and every stage compares its
# weight gradient with the same layer's gradient in the unsplit model run on each rank.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.parallel._workers import pipeline_parity

    results = run_on_ranks(pipeline_parity, 3)
    for r, res in enumerate(results):
        print(f"stage {r}: weight-grad error {res['grad_err']:.1e}, loss {res['loss']}")
    assert all(res["grad_err"] < 1e-6 for res in results)
    assert abs(results[-1]["loss"] - results[-1]["loss_ref"]) < 1e-6

# %% [markdown]
# ## Summary
#
# - Every pipeline message goes through one batched exchange with a fixed posting order, so a
#   send and a receive can be combined without deadlock; the overlapped form posts the same
#   operations and hands back their handles, to be waited where the schedule needs them.
# - Receives need the shape in advance; received activations require grad so the stage's
#   backward yields the gradient to send back.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/pipeline_parallel/p2p_communication.py` (also negotiates
#   variable shapes with an extra exchange, `_communicate_shapes` `:186`; it returns the
#   requests instead of waiting under `overlap_p2p_comm`, as `communicate` does above).
# - torchtitan / PyTorch: `torch.distributed.pipelining` (`PipelineStage` infers shapes with a
#   meta-device dry run and runs `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`).
#
# ## Exercises
#
# 1. Send two micro-batches through the 3-stage demo in GPipe order (all forwards, then all
#    backwards) and check the accumulated gradients.
# 2. Why does the receive buffer for gradients not need `requires_grad`?

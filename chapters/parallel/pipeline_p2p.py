# %% [markdown]
# # A.5 · Pipeline point-to-point: moving activations and gradients between stages
#
# A pipeline stage receives its input activation from the previous stage, sends its output to
# the next, and in backward does the reverse with gradients. This page builds those sends and
# receives (all of them through one exchange function, which posts either one batch or single
# `isend`/`irecv` operations) in the shapes the
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
# deadlock. So every call goes through one function that posts all its operations at once,
# by default together with `torch.distributed.batch_isend_irecv`, and then waits (Megatron:
# `P2PCommunicator._communicate` and `_batched_p2p_ops`,
# `megatron/core/pipeline_parallel/p2p_communication.py:275`, `:17`).
#
# Neighbors wrap around the `pp` group: the next of the last stage is the first
# (`p2p_communication.py:155-156`). The plain helpers never use the wrap (the first stage has
# nothing to receive forward), the interleaved schedule does: virtual chunk $k$ on the last
# rank feeds chunk $k+1$ on the first rank.
#
# **Matching.** Two messages between the same pair of ranks are matched in posting order. With
# two stages the previous and the next neighbor are the same rank, so every rank posts a batch
# in the fixed order *send-next, recv-prev, send-prev, recv-next*: rank A's send-next then pairs with
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


# %% [markdown]
# `communicate` is the one exchange every helper below calls: it allocates the receive buffers,
# posts the sends and receives that were asked for, and waits, unless an overlapping schedule
# takes the handles.

# %%
def communicate(grid: ParallelGrid, *, send_next: torch.Tensor | None = None,
                send_prev: torch.Tensor | None = None, recv_prev_shape: Sequence[int] | None = None,
                recv_next_shape: Sequence[int] | None = None, dtype: torch.dtype = torch.float32,
                device: torch.device | None = None, batch_p2p_comm: bool = True,
                wait_on_reqs: bool = True):
    """Post every requested send/recv to the pp neighbors, wait, return (from_prev, from_next).

    `batch_p2p_comm`: all in one `batch_isend_irecv`, else one `isend`/`irecv` each (see
    "Single operations" below). With `wait_on_reqs=False` (single operations only) wait for
    nothing: return (from_prev, from_next, handles), the handles by direction ("send_next",
    "recv_prev", "send_prev", "recv_next").
    """
    if batch_p2p_comm and not wait_on_reqs:
        raise ValueError("batch_p2p_comm = True cannot leave the messages in flight: "
                         "overlap_p2p_comm needs batch_p2p_comm = False")
    if grid.size("pp") == 1:
        raise ValueError("pipeline p2p needs a pp group of more than 1 rank")
    device = device if device is not None else grid.device
    from_prev = None if recv_prev_shape is None else _empty(recv_prev_shape, dtype, device, True)
    from_next = None if recv_next_shape is None else _empty(recv_next_shape, dtype, device, False)
    tensors = {"send_next": send_next, "recv_prev": from_prev, "send_prev": send_prev,
               "recv_next": from_next}
    if batch_p2p_comm:
        _batched(grid, tensors)
        return from_prev, from_next
    handles = _post_each(grid, tensors)
    if not wait_on_reqs:
        return from_prev, from_next, handles
    for req in handles.values():
        req.wait()
    return from_prev, from_next


# %% [markdown]
# The batched path posts all of an exchange's operations in one `batch_isend_irecv`, always in the
# same order of directions, and waits for all of them.

# %%
def _batched(grid: ParallelGrid, tensors: dict) -> None:
    """One batch_isend_irecv on the pp group, in the fixed order; see "Matching" above."""
    prev_rank, next_rank = _neighbors(grid)
    peers = {"send_next": next_rank, "recv_prev": prev_rank, "send_prev": prev_rank,
             "recv_next": next_rank}
    ops = [dist.P2POp(dist.isend if name.startswith("send") else dist.irecv,
                      t.detach().contiguous() if name.startswith("send") else t,
                      peers[name], grid.group("pp"))
           for name, t in tensors.items() if t is not None]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()

# %% [markdown]
# ## Single operations, and why the two kinds must never meet
#
# `batch_p2p_comm` chooses how every message of a schedule is posted: the batch above
# (Megatron's default, `megatron/core/model_parallel_config.py:309-312`) or one `isend` /
# `irecv` per tensor (`_p2p_ops`, `p2p_communication.py:55-128`). It must be the same choice at
# both ends of every message. Under NCCL the two do not travel on the same road: torch runs a
# batch on the process group's communicator and a single operation on a separate
# communicator of the two ranks, so a tensor sent batched and received single (or the
# reverse) is never matched, and both ranks hang. Gloo matches point-to-point messages by
# peer and tag whatever posted them, so a CPU run hides the mistake, which is why a test
# records the method of every message at both ends (`tests/test_main_loop_p2p_methods.py`).
# The choice is one switch in the schedule's config, never a choice made per call site.
#
# Single operations are posted in Megatron's even/odd order: an even pipeline rank sends
# before it receives, an odd one receives before it sends, so each send meets a receive that
# is already posted. With two pipeline ranks both neighbors are the same rank, and the two
# directions would queue behind each other on one NCCL stream; Megatron posts the even
# ranks' sends on the pipeline group and the odd ranks' sends on the world group
# (`p2p_communication.py:66-77`), one communicator per direction, and so does `_post_each`
# (when the world group has the pipeline group's backend, as Megatron's excludes UCC).
# Global ranks name the peers, so either group reaches them.

# %%
_ORDER = {0: ("send_next", "recv_prev", "send_prev", "recv_next"),   # even pp rank
          1: ("recv_prev", "send_next", "recv_next", "send_prev")}   # odd pp rank


def _single_op_groups(grid: ParallelGrid) -> tuple:
    """(group of the even ranks' sends, group of the odd ranks' sends)."""
    group = grid.group("pp")
    if grid.size("pp") == 2 and dist.get_backend(group) == dist.get_backend():
        return group, dist.group.WORLD
    return group, group


def _post_each(grid: ParallelGrid, tensors: dict) -> dict:
    """isend/irecv each given tensor in the even/odd order; {direction: handle}."""
    prev_rank, next_rank = _neighbors(grid)
    parity = grid.rank("pp") % 2
    even_sends, odd_sends = _single_op_groups(grid)
    handles = {}
    for name in _ORDER[parity]:
        t, send = tensors[name], name.startswith("send")
        if t is None:
            continue
        peer = next_rank if name.endswith("next") else prev_rank
        group = even_sends if send == (parity == 0) else odd_sends
        op = dist.isend if send else dist.irecv
        handles[name] = op(t.detach().contiguous() if send else t, peer, group=group)
    return handles

# %% [markdown]
# ## Posted, not waited: the overlapped exchange
#
# The interleaved schedule can hide its messages behind compute (`overlap_p2p_comm`, the
# default of Megatron's training arguments for that schedule): it posts an exchange right after
# a forward or a backward and waits for each piece only when it needs it — a received input
# just before the forward that reads it, a send before its buffer is reused. For that an
# exchange returns its handles instead of waiting, one per operation and named by direction
# (Megatron's `_communicate(..., wait_on_reqs=False)`, `p2p_communication.py:411-415`). A
# batch cannot be left in flight that way, so `overlap_p2p_comm` requires
# `batch_p2p_comm = False` (`model_parallel_config.py:304-312`; Megatron's training sets one
# to the negation of the other, `megatron/training/argument_utils.py:302`), and then *every*
# message of the schedule is a single operation, the blocking ones of its warmup and
# cooldown included.

# %% [markdown]
# ## The named helpers
#
# The names are Megatron's, the methods of its `P2PCommunicator`.
#
# <details><summary>Megatron detail: the methods, line by line</summary>
#
# `P2PCommunicator.recv_forward` `:424`, `recv_backward` `:455`,
# `send_forward` `:486`, `send_backward` `:507`, `send_forward_recv_backward` `:527`,
# `send_backward_recv_forward` `:560`, `send_forward_recv_forward` `:593`,
# `send_backward_recv_backward` `:619`, `send_forward_backward_recv_forward_backward` `:645`.
#
# </details>
#
# The first six are no-ops (or return `None`) on the stage with no neighbor in that direction;
# the last three are the interleaved schedule's, which decides itself whether to receive.
# Each takes `batch_p2p_comm`, which Megatron reads from its config inside `_communicate`:
# a schedule passes the one value of its config to every call.

# %%
def recv_forward(shape: Sequence[int], grid: ParallelGrid, dtype=torch.float32, *,
                 batch_p2p_comm: bool = True) -> torch.Tensor | None:
    """The input activation from the previous stage (None on the first stage)."""
    if grid.is_first_stage():
        return None
    return communicate(grid, recv_prev_shape=shape, dtype=dtype, batch_p2p_comm=batch_p2p_comm)[0]


def recv_backward(shape: Sequence[int], grid: ParallelGrid, dtype=torch.float32, *,
                  batch_p2p_comm: bool = True) -> torch.Tensor | None:
    """The gradient of my output from the next stage (None on the last stage)."""
    if grid.is_last_stage():
        return None
    return communicate(grid, recv_next_shape=shape, dtype=dtype, batch_p2p_comm=batch_p2p_comm)[1]


def send_forward(output: torch.Tensor, grid: ParallelGrid, *, batch_p2p_comm: bool = True) -> None:
    """Send my output activation to the next stage (nothing on the last stage)."""
    if not grid.is_last_stage():
        communicate(grid, send_next=output, batch_p2p_comm=batch_p2p_comm)


def send_backward(input_grad: torch.Tensor, grid: ParallelGrid, *,
                  batch_p2p_comm: bool = True) -> None:
    """Send the gradient of my input to the previous stage (nothing on the first stage)."""
    if not grid.is_first_stage():
        communicate(grid, send_prev=input_grad, batch_p2p_comm=batch_p2p_comm)


# %% [markdown]
# The two combined ones of the 1F1B steady state send one way and receive the other way in one
# exchange, so neither rank's send waits for the other's receive.

# %%
def send_forward_recv_backward(output: torch.Tensor, shape: Sequence[int], grid: ParallelGrid,
                               dtype=torch.float32, *,
                               batch_p2p_comm: bool = True) -> torch.Tensor | None:
    """Send my output forward and receive its gradient, in one exchange (None on the last stage)."""
    if grid.is_last_stage():
        return None
    return communicate(grid, send_next=output, recv_next_shape=shape, dtype=dtype,
                       batch_p2p_comm=batch_p2p_comm)[1]


def send_backward_recv_forward(input_grad: torch.Tensor, shape: Sequence[int], grid: ParallelGrid,
                               dtype=torch.float32, *,
                               batch_p2p_comm: bool = True) -> torch.Tensor | None:
    """Send my input gradient back and receive the next input activation (None on the first stage)."""
    if grid.is_first_stage():
        return None
    return communicate(grid, send_prev=input_grad, recv_prev_shape=shape, dtype=dtype,
                       batch_p2p_comm=batch_p2p_comm)[0]


# %% [markdown]
# The interleaved schedule's three: the ring wraps (the last rank's next is rank 0, for the
# next model chunk), and the schedule says itself whether anything comes back. Two of them
# can leave their messages in flight (`overlap_p2p_comm`, with single operations only).

# %%
def send_forward_recv_forward(output: torch.Tensor | None, recv_prev: bool, shape: Sequence[int],
                              grid: ParallelGrid, dtype=torch.float32,
                              overlap_p2p_comm: bool = False, *, batch_p2p_comm: bool = True):
    """Interleaved: send to the next rank (wrapping) and optionally receive from the previous.

    With `overlap_p2p_comm`: (the receive buffer, not yet filled, and the handles)."""
    out = communicate(grid, send_next=output, recv_prev_shape=shape if recv_prev else None,
                      dtype=dtype, batch_p2p_comm=batch_p2p_comm,
                      wait_on_reqs=not overlap_p2p_comm)
    return (out[0], out[2]) if overlap_p2p_comm else out[0]


def send_backward_recv_backward(input_grad: torch.Tensor | None, recv_next: bool,
                                shape: Sequence[int], grid: ParallelGrid, dtype=torch.float32,
                                overlap_p2p_comm: bool = False, *, batch_p2p_comm: bool = True):
    """Interleaved: send a gradient to the previous rank (wrapping), optionally receive from the next.

    With `overlap_p2p_comm`: (the receive buffer, not yet filled, and the handles)."""
    out = communicate(grid, send_prev=input_grad, recv_next_shape=shape if recv_next else None,
                      dtype=dtype, batch_p2p_comm=batch_p2p_comm,
                      wait_on_reqs=not overlap_p2p_comm)
    return (out[1], out[2]) if overlap_p2p_comm else out[1]


def send_forward_backward_recv_forward_backward(
        output: torch.Tensor | None, input_grad: torch.Tensor | None, recv_prev: bool,
        recv_next: bool, shape: Sequence[int], grid: ParallelGrid, dtype=torch.float32, *,
        batch_p2p_comm: bool = True):
    """Interleaved steady state: all four directions in one exchange; returns (from_prev, from_next)."""
    return communicate(grid, send_next=output, send_prev=input_grad,
                       recv_prev_shape=shape if recv_prev else None,
                       recv_next_shape=shape if recv_next else None, dtype=dtype,
                       batch_p2p_comm=batch_p2p_comm)

# %% [markdown]
# ## Demo: a 3-stage pipeline equals the unsplit model
#
# Three ranks each own one `Linear(8, 8)` + `tanh` of a 3-layer model. One micro-batch goes
# forward stage by stage (`recv_forward`, `send_forward_recv_backward`), the last stage computes
# the loss and its backward, gradients flow back (`send_backward`), and every stage compares its
# weight gradient with the same layer's gradient in the unsplit model run on each rank. The
# pass runs twice, batched and with single operations (`batch_p2p_comm=False` on every call
# of every rank): the method decides how the tensors travel, not what arrives, so the
# gradients are the same bits.

# %%
if __name__ == "__main__":
    from tinytron.launch import run_on_ranks
    from tinytron.parallel._workers import pipeline_parity_both_methods

    results = run_on_ranks(pipeline_parity_both_methods, 3)
    for r, (batched, single) in enumerate(results):
        print(f"stage {r}: weight-grad error {batched['grad_err']:.1e}, loss {batched['loss']}, "
              f"single ops give the same bits: {bool((batched['grad'] == single['grad']).all())}")
    assert all(res["grad_err"] < 1e-6 for both in results for res in both)
    assert abs(results[-1][0]["loss"] - results[-1][0]["loss_ref"]) < 1e-6
    assert all(torch.equal(batched["grad"], single["grad"]) for batched, single in results)

# %% [markdown]
# ## Summary
#
# - Every pipeline message goes through one exchange that posts its sends and receives at once,
#   so a send and a receive can be combined without deadlock: one batch in a fixed order, or
#   (`batch_p2p_comm = False`) single operations in Megatron's even/odd order, the two
#   directions on two groups when there are two stages. The overlapped form posts single
#   operations and hands back their handles, to be waited where the schedule needs them.
# - The two methods never meet on one message: under NCCL a batch and a single operation
#   travel on different communicators and would never match. A schedule's config chooses one
#   method for all its messages; `overlap_p2p_comm` requires single operations.
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
#
#    <details><summary>Hint</summary>
#
#    Each stage keeps both micro-batches' inputs and outputs until
#    the backwards: run <code>recv_forward</code>, forward, <code>send_forward</code> twice, then
#    <code>recv_backward</code>, backward, <code>send_backward</code> twice in the same order. The
#    summed gradients must equal those of one process on the two micro-batches (divide the loss by
#    2 in both).
#
#    </details>
#
# 2. Why does the receive buffer for gradients not need `requires_grad`?
#
#    <details><summary>Hint</summary>
#
#    Look at the two <code>_empty</code> calls in
#    <code>communicate</code>: the activation from the previous stage is a leaf this stage
#    differentiates against, its <code>.grad</code> is what <code>send_backward</code> sends back.
#    A received gradient is only an input to <code>backward(grad)</code>; nothing is ever
#    differentiated with respect to it.
#
#    </details>
#
# 3. With two stages, post every single operation of both directions on the pipeline group
#    alone. Which sequence of exchanges in the overlapped interleaved schedule could leave a
#    send on each rank waiting behind a receive that the other rank posts after its own send?
#
#    <details><summary>Hint</summary>
#
#    With two ranks, "next" and "previous" are the same peer, and
#    on one group the operations between two ranks are matched in the order they were posted.
#    Write down, per rank, the order in which the overlapped schedule posts its forward and
#    backward sends and receives, and look for the step where rank 0's first posted operation to
#    rank 1 is a send of one direction while rank 1's first is a send of the other.
#
#    </details>

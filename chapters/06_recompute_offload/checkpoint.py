# %% [markdown]
# # 06 · Recompute (1/4): a checkpoint that replays the same random numbers
#
# Activation recompute throws away what a block of the forward saved for its backward and runs
# that block again when the backward reaches it. The second run must compute *exactly* the
# same thing as the first — including every dropout mask, which is drawn from a random number
# generator that has moved on since. This page builds the checkpoint function that makes the
# replay exact on one rank and under tensor parallelism.
#
# You will build: `capture_rng_states`, `restore_rng_states`, `fork_rng`, `CheckpointFunction`
# with `checkpoint(...)` (including `distribute_saved_activations` over TP), and
# `CheckpointWithoutOutput`, which frees a block's *output* too.

# %%
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from tinytron.parallel import ParallelGrid
from tinytron.parallel.rng import RNGStatesTracker

__all__ = ["RNGSnapshot", "capture_rng_states", "restore_rng_states", "fork_rng",
           "CheckpointOptions", "CheckpointFunction", "checkpoint", "CheckpointWithoutOutput"]

# %% [markdown]
# ## Why the random state is part of the input
#
# A checkpointed block is a function of its input tensors *and* of the generators it draws
# from. Take one dropout with $p = 0.5$ over 8 values. In forward, the default generator is in
# state $S_0$; dropout draws its keep-mask from $S_0$, say `10110010`, and leaves the generator
# in $S_1$. Everything after the block draws from $S_1$ onward. When the backward reaches the
# block and re-runs it, the generator is somewhere far later, $S_{57}$: the recomputed mask is
# another 8 coin flips, `01100111`, and the backward multiplies the incoming gradient by a mask
# the forward never used. The loss is the one the forward computed; the gradient belongs to a
# different network. Nothing crashes.
#
# The fix is to treat the generator state as one more saved input: remember $S_0$ at forward,
# set the generator to $S_0$ for the recompute, and put the backward's own state back
# afterwards, so that whatever the backward draws next is what it would have drawn without
# recompute.
#
# Under tensor parallelism there are several generators (appendix A's tracker): dropout in a
# TP-split region draws from the `model-parallel-rng` stream, dropout on replicated
# activations from the device's default generator. Megatron's `CheckpointFunction`
# (`megatron/core/tensor_parallel/random.py:555`, state capture at `:578`) saves **all** of
# them — the CPU generator, the current CUDA generator and every named tracker state
# (`_get_all_rng_states`, `:499`) — and its backward restores them inside `_fork_rng`
# (`:519`), which saves the states current at backward time and puts them back when the
# recompute is done.
#
# | moment | default generator | `model-parallel-rng` | what happens |
# |---|---|---|---|
# | forward enters the block | $S_0$ | $T_0$ | snapshot $(S_0, T_0)$ |
# | forward leaves the block | $S_1$ | $T_1$ | outputs kept, internals dropped |
# | later forwards, the head, ... | $S_{57}$ | $T_{12}$ | |
# | backward reaches the block | $S_{57} \to S_0$ | $T_{12} \to T_0$ | fork: save $(S_{57}, T_{12})$, set the snapshot |
# | recompute, then its backward | $S_1$ | $T_1$ | same masks as the forward |
# | leave the fork | $S_{57}$ | $T_{12}$ | the rest of the backward is unaffected |

# %%
@dataclass
class RNGSnapshot:
    """Every generator a block may draw from: CPU, current CUDA device, and the tracker's streams."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None = None
    tracker: dict[str, torch.Tensor] = field(default_factory=dict)


def capture_rng_states(tracker: RNGStatesTracker | None = None) -> RNGSnapshot:
    """Snapshot the CPU generator, the current CUDA generator (if CUDA is in use) and the tracker."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return RNGSnapshot(torch.get_rng_state(), cuda,
                       tracker.get_states() if tracker is not None else {})


def restore_rng_states(snapshot: RNGSnapshot, tracker: RNGStatesTracker | None = None) -> None:
    """Set every generator to the snapshot's state."""
    torch.set_rng_state(snapshot.cpu)
    if snapshot.cuda is not None:
        torch.cuda.set_rng_state(snapshot.cuda)
    if tracker is not None:
        tracker.set_states(snapshot.tracker)


@contextlib.contextmanager
def fork_rng(tracker: RNGStatesTracker | None = None) -> Iterator[None]:
    """Run the block, then put every generator back where it was (Megatron's `_fork_rng`)."""
    saved = capture_rng_states(tracker)
    try:
        yield
    finally:
        restore_rng_states(saved, tracker)

# %% [markdown]
# One subtlety with appendix A's tracker: under sequence parallelism the whole decoder runs
# inside `tracker.fork()`, so while the forward runs, the `model-parallel-rng` stream *is* the
# default generator. On a CPU the fork copies the stream's state in and out, so the tracker's
# stored copy is stale until the fork ends; on CUDA the fork points the default generator at
# the stream's own state (so a CUDA graph can capture it), and the stream is live. Either way
# the snapshot replays correctly: its CPU (or CUDA) state is the forked stream's current
# position, and a recompute that runs outside any fork draws from exactly that state.
#
# ## The checkpoint function
#
# `CheckpointFunction` is an autograd `Function` whose forward runs the block under
# `torch.no_grad()` — so nothing inside is saved — and keeps only the block's inputs and the
# RNG snapshot. Its backward:
#
# 1. takes the saved inputs (re-assembling the first one if it was distributed, below),
#    detaches them and marks them as requiring grad where the originals did;
# 2. inside `fork_rng`, restores the snapshot and re-runs the block *with* grad, which builds
#    the block's autograd graph a second time;
# 3. back-propagates the incoming gradients through that fresh graph
#    (`torch.autograd.backward(outputs, grads)`) and returns the inputs' gradients.
#
# Megatron's signature is `checkpoint(function, distribute_saved_activations, *args)`
# (`random.py:637`); its tracker is a process-wide global. Here the tracker and the TP grid
# travel in a `CheckpointOptions` value, and `preserve_rng_state=False` turns the RNG replay off
# so that a test can show what goes wrong without it (`torch.utils.checkpoint` has the same
# switch).
#
# **`distribute_saved_activations`.** Without sequence parallelism every TP rank holds the
# same full $[s, b, h]$ layer input, $t$ identical copies. With this flag each rank keeps only its
# $1/t$ slice of the flattened tensor (Megatron's `split_tensor_into_1d_equal_chunks`), and the
# backward all-gathers the slices before the recompute. With $s = 4096$, $b = 1$,
# $h = 4096$ in bf16 at $t = 2$, the stored input of a checkpointed chunk drops from 32 MiB to
# 16 MiB per rank, for one all-gather of 32 MiB per chunk in backward. As in Megatron
# (`random.py:585-589`), the slice *replaces the input's data* (`x.data = slice`): every
# holder of that tensor — the previous layer, a pipeline stage keeping its received input for
# backward — now holds the slice, not the full tensor beside a copy; backward puts the gathered
# full tensor back into the same tensor object before the recompute. One case cannot work
# that way: an input that is a *view* keeps its base, and so the full storage, alive
# whatever its own data becomes. The first layer's input is one at micro-batch size 1 without
# embedding dropout: the
# embedding's $[b, s, h]$ output transposed to $[s, b, h]$ is then already contiguous, so
# `.contiguous()` hands back the view itself. There the slice is kept apart, which frees the
# base once the caller drops the view.
#
# <details><summary>Megatron detail: viewless inputs</summary>
#
# Megatron meets the same view and
# removes it one level up: `TransformerBlock.forward` makes its input viewless before any
# layer runs (`make_viewless_tensor`, `megatron/core/transformer/transformer_block.py:575-590`),
# and its checkpoint asserts that it is (`safely_set_viewless_tensor_data`,
# `megatron/core/utils.py:754`); tinytron handles it in the checkpoint instead.
#
# </details>
#
# Under sequence
# parallelism the input is already split ($[s/t, b, h]$, different on every rank), so the flag
# is refused (`ModelConfig` raises).

# %%
@dataclass
class CheckpointOptions:
    """How a checkpoint replays: the tracker whose streams it restores, and TP distribution."""

    tracker: RNGStatesTracker | None = None
    grid: ParallelGrid | None = None
    distribute_saved_activations: bool = False
    preserve_rng_state: bool = True

    def distributes(self) -> bool:
        """True when the first input is split over more than one TP rank."""
        return (self.distribute_saved_activations and self.grid is not None
                and self.grid.size("tp") > 1)


def _my_flat_chunk(x: torch.Tensor, grid: ParallelGrid) -> torch.Tensor:
    """This TP rank's 1/tp of x flattened, as a new tensor (x's storage can then be freed)."""
    tp, rank = grid.size("tp"), grid.rank("tp")
    flat = x.detach().reshape(-1)
    if flat.numel() % tp:
        raise ValueError(f"cannot distribute a tensor of {flat.numel()} elements over tp={tp}")
    n = flat.numel() // tp
    return flat[rank * n:(rank + 1) * n].clone()


def _gather_flat_chunks(chunk: torch.Tensor, shape, grid: ParallelGrid) -> torch.Tensor:
    """All-gather the TP ranks' 1-D chunks and view the result as `shape`."""
    parts = [torch.empty_like(chunk) for _ in range(grid.size("tp"))]
    dist.all_gather(parts, chunk.contiguous(), group=grid.group("tp"))
    return torch.cat(parts).view(shape)


# %% [markdown]
# The two halves of the distribution, and the leaf the recompute starts from. Forward keeps
# only this rank's slice (in the input itself, or apart when the input is a view); backward
# gathers the full tensor back into the same object.

# %%
def _keep_first_slice(args, tensors: list, grid: ParallelGrid) -> None:
    """Keep only this TP rank's slice of args[0]: in the input itself, or in tensors[0]."""
    mine = _my_flat_chunk(args[0], grid)
    if args[0]._base is None:   # the input itself now holds only this rank's slice
        args[0].data = mine
    else:   # a view's base would keep the full storage alive: keep the slice apart
        tensors[0] = mine


def _regather_first(tensors: list, ctx) -> None:
    """The full first input back into the same tensor, requiring grad as the original did."""
    tensors[0].data = _gather_flat_chunks(tensors[0].data, ctx.first_shape, ctx.options.grid)
    if ctx.first_requires_grad and not tensors[0].requires_grad:
        tensors[0].requires_grad_()   # the slice kept apart from a view


def _detached(t: torch.Tensor) -> torch.Tensor:
    """A leaf sharing t's data, requiring grad exactly when t did."""
    return t.detach().requires_grad_(t.requires_grad)


# %% [markdown]
# The function itself follows. `forward` keeps the RNG snapshot and the inputs (the first one
# as this rank's slice when it distributes); `backward` is the three steps listed above, with
# the all-gather in front when the first input was split.

# %%
class CheckpointFunction(torch.autograd.Function):
    """Forward without saving internals; backward re-runs the block with the forward's RNG states."""

    @staticmethod
    def forward(ctx, run_function: Callable, options: CheckpointOptions, *args):
        ctx.run_function, ctx.options = run_function, options
        ctx.rng = capture_rng_states(options.tracker) if options.preserve_rng_state else None
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.first_shape, tensors = None, [a for a in args if torch.is_tensor(a)]
        if options.distributes() and ctx.is_tensor[0]:
            ctx.first_shape, ctx.first_requires_grad = args[0].shape, args[0].requires_grad
            _keep_first_slice(args, tensors, options.grid)
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpointed blocks need .backward(), not torch.autograd.grad()")
        tensors = list(ctx.saved_tensors)
        if ctx.first_shape is not None:   # the full input back into the same tensor
            _regather_first(tensors, ctx)
        inputs = [_detached(tensors.pop(0)) if t else other
                  for t, other in zip(ctx.is_tensor, ctx.others)]
        tracker = ctx.options.tracker
        with fork_rng(tracker):
            if ctx.rng is not None:
                restore_rng_states(ctx.rng, tracker)
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if torch.is_tensor(x) else None for x in inputs)


# %% [markdown]
# And Megatron's call, which packs the options:

# %%
def checkpoint(function: Callable, distribute_saved_activations: bool, *args,
               tracker: RNGStatesTracker | None = None, grid: ParallelGrid | None = None,
               preserve_rng_state: bool = True):
    """Run function(*args) keeping only its inputs; recompute it in backward with the same RNG."""
    options = CheckpointOptions(tracker, grid, distribute_saved_activations, preserve_rng_state)
    return CheckpointFunction.apply(function, options, *args)

# %% [markdown]
# ## Freeing the output as well: `CheckpointWithoutOutput`
#
# A checkpoint keeps its inputs and its outputs stay alive because the *next* operation saves
# them. For a cheap block whose output is immediately consumed by a layer that saves it — an
# RMSNorm feeding `linear_qkv` — Megatron goes one step further
# (`CheckpointWithoutOutput`, `random.py:699`): run the block without grad, let the consumer
# save the output, then **free the output's storage** (`untyped_storage().resize_(0)`: the
# tensor object, which the consumer holds, stays valid but owns zero bytes), and register a
# gradient hook on the consumer's *output*. The backward reaches that hook just before the
# consumer's own backward needs its saved input; the hook recomputes the block (same RNG
# replay) and hands the result to the original storage, so every saved reference to the
# output sees the data again without knowing it was ever gone (`_recompute`, `:742`).
#
# One copy of the output must remain, not two. tinytron copies the recomputed values into the
# old storage and then points the recomputed tensor at that storage (`new.data = old`, which
# bumps no version counter), so the recomputed storage is freed as the hook returns — one copy
# from then on, two only during the copy itself.
#
# <details><summary>Megatron detail: zero bytes copied</summary>
#
# Megatron re-points the old
# storage at the recomputed data with a small C++ extension (`random.py:28-75, 790-797`): zero
# bytes copied. tinytron stays in Python.
#
# </details>
#
# For the norm before `linear_qkv` this saves the norm's internals *and* its output: per
# layer $s' b h$ elements of output (what `linear_qkv` keeps, $s' = s/t$ rows under SP) and
# $s' b$ of reciprocal RMS (page 4 counts them); the norm's input stays, as the checkpoint's
# input. The price is one more norm forward in backward — a few percent of a
# layer's time.

# %%
class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Forward under no_grad saving only the inputs; backward through the recomputed graph."""

    @staticmethod
    def forward(ctx, run_function, owner: "CheckpointWithoutOutput", *args):
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.save_for_backward(*args)
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if getattr(ctx, "outputs", None) is None:
            raise RuntimeError("CheckpointWithoutOutput: the recompute hook never ran "
                               "(discard_output_and_register_recompute was not called)")
        torch.autograd.backward(ctx.outputs, grads)
        inputs, ctx.outputs, ctx.inputs = ctx.inputs, None, None
        return (None, None) + tuple(x.grad if torch.is_tensor(x) else None for x in inputs)


# %% [markdown]
# The user-facing object: `checkpoint` runs the block, `discard_output_and_register_recompute`
# frees the output once the consumer has saved it, and `_recompute`, the hook, refills it.

# %%
class CheckpointWithoutOutput:
    """Checkpoint a block, free its output after the consumer saved it, refill it in backward."""

    def __init__(self, tracker: RNGStatesTracker | None = None):
        self.tracker, self.ctx, self.run_function, self.outputs, self.rng = tracker, None, None, None, None

    def checkpoint(self, run_function: Callable, *args):
        """Run the block without grad; the outputs are returned as usual."""
        self.run_function, self.rng = run_function, capture_rng_states(self.tracker)
        outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage now; recompute it when hook_tensor's gradient arrives."""
        for out in self.outputs:
            out.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad):
        """Re-run the block with the forward's RNG and put the data back into the old storage."""
        if self.ctx is None:
            return
        inputs = [_detached(t) for t in self.ctx.saved_tensors]
        with fork_rng(self.tracker):
            restore_rng_states(self.rng, self.tracker)
            with torch.enable_grad():
                outputs = self.run_function(*inputs)
        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        with torch.no_grad():
            for old, new in zip(self.outputs, outputs):
                old.untyped_storage().resize_(new.untyped_storage().nbytes())
                old.untyped_storage().copy_(new.untyped_storage())
                new.data = old   # one storage: the recomputed one is freed
        self.ctx.outputs, self.ctx.inputs = outputs, inputs
        self.ctx, self.run_function, self.outputs, self.rng = None, None, None, None

# %% [markdown]
# ## Demo: two dropout masks, with and without the replay
#
# One dropout ($p = 0.5$) over a $12 \times 32$ tensor, checkpointed. The block records the
# keep-mask every time it runs: once in forward and once in the recompute. Between the forward
# and the backward, something else draws from the generator (the rest of the model would).
# With the RNG replay the recomputed mask equals the forward's bit for bit and the gradient is
# the mask scaled by $1/(1-p)$; without it, about half the positions disagree, and the gradient
# is wrong at exactly those positions. The generator after the backward is where it would be
# with no recompute at all.

# %%
def _masked_block(record: list) -> Callable:
    """A dropout block that appends its keep-mask to `record` each time it runs."""
    def block(x):
        y = torch.nn.functional.dropout(x, p=0.5, training=True)
        record.append((y != 0).detach().clone())
        return y
    return block


def dropout_masks(preserve_rng_state: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                                     torch.Tensor, torch.Tensor]:
    """(forward mask, recomputed mask, input grad, generator state after backward)."""
    torch.manual_seed(seed)
    x = torch.ones(12, 32, requires_grad=True)
    masks: list = []
    y = checkpoint(_masked_block(masks), False, x, preserve_rng_state=preserve_rng_state)
    torch.rand(1000)  # the rest of the forward draws too
    y.sum().backward()
    return masks[0], masks[1], x.grad, torch.get_rng_state()


# %% [markdown]
# Both runs, and a third with no checkpoint at all for the generator's final state; then the
# three masks side by side.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    fwd, again, grad, state = dropout_masks(preserve_rng_state=True)
    fwd_naive, again_naive, grad_naive, _ = dropout_masks(preserve_rng_state=False)
    torch.manual_seed(0)  # the same draws with no checkpoint at all
    torch.nn.functional.dropout(torch.ones(12, 32), p=0.5, training=True)
    torch.rand(1000)
    plain_state = torch.get_rng_state()
    differ = int((fwd_naive != again_naive).sum())
    print(f"with the replay:    recomputed mask == forward mask: {torch.equal(fwd, again)}")
    print(f"without the replay: {differ} of {fwd.numel()} positions differ")

    fig, axes = plt.subplots(1, 3, figsize=(9, 1.9))
    panels = [(fwd, "forward mask"), (again, "recomputed, RNG restored"),
              (again_naive, "recomputed, no RNG restore")]
    for ax, (m, title) in zip(axes, panels):
        ax.imshow(m.float(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
    diff = (fwd_naive != again_naive).nonzero()
    axes[2].scatter(diff[:, 1], diff[:, 0], s=6, c="#c44e52", marker="s", label="differs")
    axes[2].legend(fontsize=7, loc="lower right")
    plt.tight_layout()
    plt.show()

    assert torch.equal(fwd, again) and torch.equal(grad, fwd.float() * 2.0)
    assert differ > 100 and not torch.equal(grad_naive, fwd_naive.float() * 2.0)
    assert torch.equal(state, plain_state), "the backward leaves the generator where it was"

# %% [markdown]
# ## Demo: the output freed and refilled
#
# An RMSNorm-like block feeds a linear layer that saves its input. After the linear's forward
# the block's output owns zero bytes; the backward refills it and the gradients equal those of
# the plain computation.

# %%
if __name__ == "__main__":
    torch.manual_seed(1)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)

    def norm(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5)

    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(norm(ref_x), ref_w).square().sum().backward()

    ckpt = CheckpointWithoutOutput()
    normed = ckpt.checkpoint(norm, x)
    out = torch.nn.functional.linear(normed, w)  # saves `normed` for w's gradient
    ckpt.discard_output_and_register_recompute(out)
    freed = normed.untyped_storage().nbytes()
    out.square().sum().backward()
    print(f"bytes held by the norm's output after the linear's forward: {freed}; "
          f"after backward: {normed.untyped_storage().nbytes()}")
    assert freed == 0
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-6) and torch.allclose(w.grad, ref_w.grad, atol=1e-5)

# %% [markdown]
# ## Summary
#
# - A checkpointed block saves its inputs and a snapshot of every generator it may draw from
#   (CPU, current CUDA device, each tracker stream); its backward restores the snapshot inside
#   a fork that puts the backward's own states back afterwards.
# - Without the replay, dropout masks in the recompute differ from the forward's and the
#   gradients are silently wrong; with it they are identical and the generator ends where it
#   would have without recompute.
# - `distribute_saved_activations` keeps $1/t$ of a replicated input per TP rank and
#   all-gathers it before the recompute; `CheckpointWithoutOutput` also frees the output and
#   refills the same storage from a gradient hook.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/tensor_parallel/random.py` — `_get_all_rng_states` (`:499`),
#   `_fork_rng` (`:519`), `CheckpointFunction` (`:555`), `checkpoint` (`:637`),
#   `CheckpointWithoutOutput` (`:699`, `_recompute` `:742`); under FP8/FP4 Transformer Engine's
#   own `checkpoint` is used instead (`megatron/core/recompute.py`).
# - PyTorch: `torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
#   preserve_rng_state=True)` saves the CPU and device generators; it knows nothing of a TP
#   tracker, so Megatron-style code that forks named streams needs its own function.
# - torchtitan: `torchtitan/distributed/activation_checkpoint.py` wraps blocks with PyTorch's
#   non-reentrant checkpoint; DTensor's offset-based RNG makes the replay work under TP.
#
# ## Exercises
#
# 1. Put the forward inside `tracker.fork()` (as sequence parallelism does) and check that the
#    replay is still exact. Why does the snapshot not need the tracker's copy, stale on a CPU?
#    <details><summary>Hint</summary>
#
#    Reread the subtlety after `fork_rng`: inside the fork the
#    stream *is* the default generator, so `capture_rng_states` records its current position in
#    `snapshot.cpu`, and the recompute, outside any fork, draws from the default generator.
#
#    </details>
#
# 2. Measure the saved bytes of `checkpoint(..., distribute_saved_activations=True)` on two TP
#    ranks with `saved_tensor_bytes` (chapter 01).
#    <details><summary>Hint</summary>
#
#    Expect the stored input to halve: $s \cdot b \cdot h$
#    elements become $s b h / t$ per rank, 32 MiB to 16 MiB in the example above. Run it on two
#    ranks with `run_on_ranks` (as chapter 05's demos do) and a `ParallelGrid` of TP 2, and read
#    the bytes after the forward, before the backward gathers them back.
#
#    </details>

# %% [markdown]
# # A.6 · Random numbers under model parallelism: the RNG states tracker
#
# Dropout on a TP-split tensor must draw *different* masks on each TP rank (each holds different
# features), while dropout on a replicated tensor must draw the *same* mask on every TP rank
# (they hold the same values and must stay identical). One default generator cannot do both;
# a tracker of named generator states can.

# %%
from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch

from tinytron.parallel.grid import ParallelGrid

__all__ = ["MODEL_PARALLEL_RNG", "DATA_PARALLEL_RNG", "EXPERT_PARALLEL_RNG", "DefaultGenerator",
           "NamedStreams", "RNGStatesTracker", "get_rng_tracker", "model_parallel_seed",
           "set_random_seed"]

# %% [markdown]
# ## The idea
#
# Megatron keeps the device's default generator for the replicated regions and a dictionary of
# extra named generator *states* (`CudaRNGStatesTracker`,
# `megatron/core/tensor_parallel/random.py:216`). `fork(name)` swaps the named state into the
# default generator, runs the block, saves the advanced named state and swaps the original back
# (`:298`). So code inside `with tracker.fork():` draws from the named stream and code outside
# is unaffected, as if the fork never happened.
#
# The seeds (`model_parallel_cuda_manual_seed`, `random.py:433`, offset at `:466-467`):
#
# | stream | seed | same across | differs across |
# |---|---|---|---|
# | default generator, `data-parallel-rng` | `seed` | TP ranks, DP replicas | PP stages |
# | `model-parallel-rng` | `seed + 2718 + tp_rank` | DP replicas | TP ranks |
# | `expert-parallel-rng` | `seed + 1024 + 100·ep_rank + etp_rank` | expert-DP | expert ranks |
#
# where `seed` is already `args.seed + 100·pp_rank` (`_set_random_seed`,
# `megatron/training/initialize.py:381-403`; default `--seed 1234`), so every pipeline stage
# draws its own numbers. Expert parallelism is size 1 in this book (`ep_rank = 0`,
# `etp_rank = tp_rank`); the stream is kept so checkpoints carry the same names.
#
# Worked example, seed 1234, tp 2, pp 2: stage 0 uses base seed 1234 and TP streams 3952 and
# 3953; stage 1 uses 1334 with TP streams 4052 and 4053.
#
# On CPU the "default generator" is `torch.default_generator`; on CUDA it is the current
# device's generator. The tracker is told which one at construction, so the same code runs on
# both. Saving `get_states()` and restoring with `set_states()` rewinds every stream:
# [chapter 06](../06_recompute_offload/checkpoint.py) uses it to recompute identical dropout
# masks, [chapter 03](../03_checkpoint/resume.py) to resume.
#
# ## Streams as generator objects, so that a CUDA graph can hold them
#
# Swapping a saved state *tensor* into the default generator (`set_rng_state`) is a host-side
# copy of a seed and an offset. Inside a CUDA graph capture that fails twice over: the copy
# would run once, at capture, and never at replay, so no replay could move a stream in or out;
# and PyTorch refuses outright to read a CUDA generator's state while a capture runs ("Cannot
# call CUDAGeneratorImpl::current_seed during CUDA graph capture"). A graph instead advances
# the Philox offset of each generator *registered* with it (`CUDAGraph.register_generator_state`)
# by the amount the captured kernels consumed, once per replay. So each named stream must be a
# real `torch.Generator` whose state object the graph can register, and `fork` must make the
# default generator *point at* that state rather than copy it in.
#
# PyTorch provides exactly that for CUDA generators: `graphsafe_get_state()` returns a generator
# sharing the default's current state object, `graphsafe_set_state(g)` makes the default use
# `g`'s state object (a pointer swap, legal during capture). Megatron's graph-safe tracker
# (`CudaRNGStatesTracker(use_cudagraphable_rng=True)`, `random.py:225-236`) creates each stream
# by cloning the default generator and seeding the clone (`:283-286`), forks with
# `graphsafe_set_state` (`_set_cuda_rng_state(..., graph_safe=True)`, `:160-162`, called at
# `:310`), and the full-iteration graph registers every stream (`get_all_rng_states`, `:411`).
# Dropout needs no generator argument for this: it draws from the default generator, which,
# inside the fork, *is* the stream.
#
# A CPU generator has no graph-safe swap (`graphsafe_set_state is not supported in this
# Generator`), and there is no graph to register with. On CPU the tracker keeps the same
# generator objects but forks by copying their state in and out, which is the old
# `get/set_rng_state` arithmetic, draw for draw; the tests check it bit for bit against an
# inline copy of that old implementation.
#
# | | CPU | CUDA |
# |---|---|---|
# | a named stream is | a `torch.Generator` on the CPU | a `torch.Generator` on the device |
# | `fork` enters by | copying the stream's state into the default | `default.graphsafe_set_state(stream)` |
# | `fork` leaves by | copying the default's state back into the stream | pointing the default back at its own state |
# | a stream's progress while forked is | in the default (the stream's copy is stale) | in the stream itself (shared) |
# | capturable | no graph on a CPU | yes, once the graph registers `generators()` |
#
# `get_states()` still returns state *tensors* (a byte tensor per stream, as before), so the
# checkpoint format of [chapter 03](../03_checkpoint/saved_state.py) does not change and old
# checkpoints load; `set_states()` writes those tensors *into* the existing generator objects,
# never replacing them, because a graph registered the objects and a recompute may run while
# the default points at one of them.
#
# The tracker is built in three whole parts. `DefaultGenerator` below knows how to read, write
# and seed one device's default generator and make new streams for it; `NamedStreams` keeps the
# streams and their states; `RNGStatesTracker` adds the fork on top.

# %%
MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
"""Megatron's stream names (`megatron/core/tensor_parallel/random.py:91-93`)."""


# %% [markdown]
# `DefaultGenerator` hides the one difference between the devices that the rest needs: where a
# device's default generator lives, and how to read, write and seed it.

# %%
class DefaultGenerator:
    """Read, write and seed the default generator of one device type (cpu or cuda)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device}")
        self.on_cuda = self.device.type == "cuda"

    @property
    def graph_safe(self) -> bool:
        """True on CUDA: forks swap state objects (capturable), not state tensors."""
        return self.on_cuda

    def _index(self) -> int:
        torch.cuda.init()  # default_generators is filled on CUDA's lazy init
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def default_generator(self) -> torch.Generator:
        """The device's default generator object (what dropout draws from)."""
        return torch.cuda.default_generators[self._index()] if self.on_cuda else torch.default_generator

    def new_generator(self, seed: int) -> torch.Generator:
        """A fresh generator on this device, seeded: the state `manual_seed(seed)` would give."""
        where = torch.device("cuda", self._index()) if self.on_cuda else "cpu"
        return torch.Generator(device=where).manual_seed(seed)

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.on_cuda else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.on_cuda:
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _manual_seed(self, seed: int) -> None:
        self.default_generator().manual_seed(seed)


# %% [markdown]
# ## Named streams and the fork
#
# The tracker proper is a dictionary from stream name to a generator, plus the set of seeds
# already handed out (two streams with one seed would draw the same numbers, which is exactly
# the bug the tracker exists to prevent). Adding a stream makes a new generator seeded with its
# seed, so adding never moves the default stream. `fork` makes the named stream the default for
# the length of a block and, on the way out, makes the outer one the default again. A fork
# inside a fork must not lose the outer stream's draws: on CPU it first parks the outer
# stream's progress in its generator; on CUDA there is nothing to park, the default was
# pointing at the outer stream's own state.
#
# Worked example with 4-element masks: stream `a` seeded 1, the default seeded 0. Outside,
# `torch.rand(4)` draws the default's first four numbers $u_1..u_4$. Inside `fork("a")` it draws
# `a`'s first four; a second `fork("a")` later continues with `a`'s numbers five to eight, not
# one to four again; and the next draw outside is $u_5..u_8$, as if neither fork happened (the
# last demo below checks exactly this, with draws of three).
#
# The class is three short parts: the streams and their states (`add`, `get_states`,
# `set_states`, `generators`), the fork by copying (CPU) and the fork by pointing (CUDA).
# `get_states` clones each state, an ordinary allocation, so that chapter 06's CPU meter counts
# a snapshot the caller holds.

# %%
class NamedStreams(DefaultGenerator):
    """The named generators of one device, their seeds, and their states as tensors."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        self.reset()

    def reset(self) -> None:
        """Forget every named stream (a graph that registered them must be captured again)."""
        self._generators: dict[str, torch.Generator] = {}
        self._seeds: set[int] = set()
        self._active: str | None = None

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`; the default generator is left as it was."""
        if name in self._generators:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state")
        self._generators[name] = self.new_generator(seed)
        self._seeds.add(seed)

    def generators(self) -> dict[str, torch.Generator]:
        """The stream objects, by name: what a CUDA graph registers."""
        return dict(self._generators)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every named state as a tensor (save it to rewind later)."""
        return {name: gen.get_state().clone() for name, gen in self._generators.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Make the named states equal `states` (from get_states), in the same generator objects."""
        self._generators = {n: g for n, g in self._generators.items() if n in states}
        for name, state in states.items():
            self._store(name, state)

    def _store(self, name: str, state: torch.Tensor) -> None:
        if name not in self._generators:
            self._generators[name] = self.new_generator(0)
        self._generators[name].set_state(state)

# %% [markdown]
# The fork itself picks one of two ways by device. Both leave the default generator exactly as
# they found it and both keep every draw a stream made; they differ only in *where* the
# stream's progress lives while the block runs (the table above). The CPU way is the old
# state-copying one, kept so that CPU results stay bit for bit what they were; the CUDA way is
# the one a graph can capture, because entering and leaving the fork change which state object
# the default generator uses and copy no state at all.

# %%
class RNGStatesTracker(NamedStreams):
    """Named RNG streams for one device's default generator; `fork(name)` runs a block on one."""

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with stream `name` as the default generator; restore the original after."""
        if name not in self._generators:
            raise ValueError(f"RNG state {name!r} was never added; have {sorted(self._generators)}")
        with (self._fork_by_pointing(name) if self.graph_safe else self._fork_by_copying(name)):
            yield

    @contextlib.contextmanager
    def _fork_by_copying(self, name: str) -> Iterator[None]:
        original, outer = self._get(), self._active
        if outer is not None:  # nested fork: park the outer stream's progress first
            self._store(outer, original)
        self._set(self._generators[name].get_state())
        self._active = name
        try:
            yield
        finally:
            self._store(name, self._get())
            self._active = outer
            self._set(self._generators[outer].get_state() if outer is not None else original)

    @contextlib.contextmanager
    def _fork_by_pointing(self, name: str) -> Iterator[None]:
        default = self.default_generator()
        original, outer = default.graphsafe_get_state(), self._active  # shares the current state
        default.graphsafe_set_state(self._generators[name])
        self._active = name
        try:
            yield
        finally:
            self._active = outer
            default.graphsafe_set_state(original)

# %% [markdown]
# <details><summary>Megatron detail: state objects, not copies</summary>
#
# <p>Megatron's <code>get_states</code> returns the tracker's own state objects and
# <code>set_states</code> keeps the dictionary it is given (<code>random.py:258-270</code>);
# tinytron returns state tensors and writes them into its own generators, so a snapshot taken
# for recompute or a checkpoint cannot be changed by later draws, a checkpoint holds tensors on
# both devices, and a graph's registered generators survive a restore. <code>add</code> checks
# the name before the seed (Megatron the seed first, <code>:272-281</code>), so a repeated
# <code>add</code> of one stream names the stream. Megatron makes the graph-safe tracker
# opt-in (<code>use_cudagraphable_rng</code>, set when <code>cuda_graph_impl != "none"</code>,
# <code>megatron/training/initialize.py:105</code>); here a CUDA tracker is always graph-safe,
# since the pointer swap does the same draws without the two state copies per fork. There is no
# warning when the CPU generator moves inside a fork (<code>:313-320</code>); and a tracker is
# built for a device type, so the same code runs on a CPU-only machine.</p>
#
# </details>

# %% [markdown]
# Megatron reaches its tracker through a process-wide getter (`get_cuda_rng_tracker`,
# `random.py:401`): dropout deep inside a layer needs it and nobody wants to thread it through
# every constructor. The same here, one per device type; a test or a second model can still
# build its own `RNGStatesTracker`.

# %%
_TRACKERS: dict[str, RNGStatesTracker] = {}


def get_rng_tracker(device: torch.device | str = "cpu") -> RNGStatesTracker:
    """The process-wide tracker for `device`'s type (cpu or cuda), created on first use."""
    dev = torch.device(device)
    if dev.type not in _TRACKERS:
        _TRACKERS[dev.type] = RNGStatesTracker(dev)
    return _TRACKERS[dev.type]


def model_parallel_seed(seed: int, grid: ParallelGrid, tracker: RNGStatesTracker | None = None,
                        tp_rank: int | None = None) -> RNGStatesTracker:
    """Seed the default generator and the data/model/expert streams as Megatron does; return the tracker."""
    tracker = tracker if tracker is not None else get_rng_tracker(grid.device)
    tp_rank = grid.rank("tp") if tp_rank is None else tp_rank  # explicit rank: as Megatron's tp_rank=
    tracker.reset()
    tracker._manual_seed(seed)
    tracker.add(DATA_PARALLEL_RNG, seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * 0 + tp_rank)  # ep_rank 0, etp_rank = tp_rank
    return tracker


def set_random_seed(seed: int, grid: ParallelGrid, data_parallel_random_init: bool = False,
                    tracker: RNGStatesTracker | None = None) -> int:
    """Megatron's `_set_random_seed`: offset by pipeline (and optionally DP) rank, seed everything."""
    if not isinstance(seed, int) or seed <= 0:
        raise ValueError(f"seed must be a positive int, got {seed!r}")
    seed = seed + 100 * grid.rank("pp")
    if data_parallel_random_init:
        seed += 10 * grid.rank("dp")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_seed(seed, grid, tracker)
    return seed

# %% [markdown]
# ## Demo: two TP ranks, three dropouts
#
# The tracker never communicates, so one process can play both TP ranks of a tp-2 group by
# passing `tp_rank` explicitly (Megatron's `model_parallel_cuda_manual_seed` takes the same
# argument). Each "rank" seeds with 1234 and draws a dropout mask three ways: outside any fork
# (the default stream), inside `fork()` (the model-parallel stream) and inside
# `fork("data-parallel-rng")`. The first and third must agree across TP ranks; the second must
# differ. A fourth draw after restoring saved states must repeat the second exactly.
# (`data-parallel-rng` is seeded with the same seed as the default generator, so its first draw
# repeats the default's first draw.) The tests run the same check on real 2- and 4-rank worlds.

# %%
if __name__ == "__main__":
    def _mask(n: int = 12) -> str:
        """A dropout keep-mask as a bit string, drawn from the default generator."""
        keep = torch.nn.functional.dropout(torch.ones(n), p=0.5) > 0
        return "".join("1" if k else "0" for k in keep.tolist())

    masks = []
    for tp_rank in range(2):
        tracker = model_parallel_seed(1234, ParallelGrid.single(), RNGStatesTracker("cpu"), tp_rank=tp_rank)
        m = {"default": _mask()}
        saved = tracker.get_states()
        with tracker.fork():
            m["tp"] = _mask()
        with tracker.fork(DATA_PARALLEL_RNG):
            m["dp"] = _mask()
        tracker.set_states(saved)
        with tracker.fork():
            m["replayed"] = _mask()
        masks.append(m)
        print(f"tp rank {tp_rank}: default {m['default']}  model-parallel {m['tp']}  data-parallel {m['dp']}")
    assert masks[0]["default"] == masks[1]["default"]
    assert masks[0]["dp"] == masks[1]["dp"]
    assert masks[0]["tp"] != masks[1]["tp"]
    assert all(m["replayed"] == m["tp"] for m in masks)

# %% [markdown]
# The same draws, bigger and drawn: 128 keep/drop decisions per mask (dark = dropped), for the
# two TP ranks. The replicated streams give both ranks the same pattern, so a replicated
# activation stays identical on both; the model-parallel stream gives each rank its own, so the
# two halves of a split activation are not dropped in lockstep.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    def _keep(n: int = 128) -> torch.Tensor:
        """A dropout keep-mask drawn from whatever the default generator is right now."""
        return torch.nn.functional.dropout(torch.ones(n), p=0.5) > 0

    fig, axes = plt.subplots(2, 3, figsize=(10, 2.8))
    drawn = {}
    for tp_rank in range(2):
        tracker = model_parallel_seed(1234, ParallelGrid.single(), RNGStatesTracker("cpu"), tp_rank=tp_rank)
        drawn[tp_rank, "default (replicated)"] = _keep()
        with tracker.fork():
            drawn[tp_rank, "model-parallel-rng (split)"] = _keep()
        with tracker.fork(DATA_PARALLEL_RNG):
            drawn[tp_rank, "data-parallel-rng (replicated)"] = _keep()
    for (tp_rank, stream), keep in drawn.items():
        col = ["default (replicated)", "model-parallel-rng (split)",
               "data-parallel-rng (replicated)"].index(stream)
        ax = axes[tp_rank, col]
        ax.imshow(keep.view(4, 32).float(), cmap="gray", vmin=0, vmax=1)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"tp rank {tp_rank}: {stream}", fontsize=8)
    plt.tight_layout()
    plt.show()
    for stream in ("default (replicated)", "data-parallel-rng (replicated)"):
        assert torch.equal(drawn[0, stream], drawn[1, stream])
    assert not torch.equal(drawn[0, "model-parallel-rng (split)"], drawn[1, "model-parallel-rng (split)"])

# %%
if __name__ == "__main__":
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    torch.manual_seed(0)
    before = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("a"):
        inside = torch.rand(3)
    after = torch.rand(3)
    with tracker.fork("a"):
        again = torch.rand(3)
    print("outside the fork the default stream is untouched:", torch.equal(before, after))
    assert torch.equal(before, after) and not torch.equal(inside, before)
    first_six = torch.rand(6, generator=torch.Generator().manual_seed(1))  # stream a, drawn alone
    print("a second fork continues the stream:", torch.equal(torch.cat([inside, again]), first_six))
    assert torch.equal(torch.cat([inside, again]), first_six)

# %% [markdown]
# ## Summary
#
# - Replicated regions use the default generator (same seed on all TP ranks); TP-split regions
#   fork into `model-parallel-rng` (seed offset by `2718 + tp_rank`).
# - `get_states` / `set_states` snapshot and rewind every stream; recompute and resume rely on it.
#
# ## How production does it
#
# - Megatron-LM: `megatron/core/tensor_parallel/random.py` (`CudaRNGStatesTracker` `:216`,
#   `model_parallel_cuda_manual_seed` `:433`, the checkpoint function that captures and restores
#   all of them `:555`); its graph-safe variant (`use_cudagraphable_rng`) keeps
#   `torch.Generator` objects as this page does on CUDA, and Transformer Engine brings its own
#   graph-safe tracker (`te_rng_tracker`).
# - torchtitan: DTensor's `OffsetBasedRNGTracker` (`torch/distributed/tensor/_random.py`)
#   gives each shard its own Philox offset instead of its own seed.
#
# ## Exercises
#
# 1. Nest `fork("model-parallel-rng")` inside `fork("data-parallel-rng")` and show the result
#    equals doing the two forks one after the other.
#
#    <details><summary>Hint</summary>
#
#    Draw <code>torch.rand(3)</code> inside each fork, once nested
#    and once in sequence, from two trackers built with the same seeds, and compare the draws and
#    <code>get_states()</code> afterwards. Each stream keeps its own progress, so which stream a
#    draw came from matters, not how the forks were nested; the worked example of the fork checks
#    the same for one stream forked twice.
#
#    </details>
#
# 2. Why is the data-parallel stream the *same* on every DP replica? (Hint: dropout masks there
#    are on replicated activations of different samples — does it matter?)
#
#    <details><summary>Hint</summary>
#
#    Each DP replica holds different samples, so one stream on
#    different data still gives masks that are independent of the data; nothing is lost, and no
#    replica needs its own seed. Seeds must differ only where the tensors are pieces of one
#    activation, as the heads on the TP ranks are. Look at the seeds
#    <code>model_parallel_seed</code> gives the three streams, and which of them include the TP
#    rank.
#
#    </details>

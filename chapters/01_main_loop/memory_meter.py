# %% [markdown]
# # 01 · Measuring memory: live tensor bytes on any device
#
# Before a chapter can say "1F1B keeps at most p − r micro-batches alive" or "selective
# recompute saves 40% of the activations", it needs a ruler. On a GPU the ruler is the caching
# allocator's counters; on a CPU there is none. This page builds one that works on both, so that
# every memory claim in the book (chapters [01](resident_flowing.py), 06 and 07) is measured on
# the machine you are reading it on, not estimated.

# %%
from __future__ import annotations

import time
from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytesMeter", "storage_bytes", "saved_tensor_bytes"]

# %% [markdown]
# ## Why count storages, and why on the dispatcher
#
# `torch.cuda.memory_allocated()` answers "how many bytes do live tensors hold on this GPU".
# On a CPU it silently returns 0, and the process's resident set size mixes in the Python
# heap, the allocator's free lists and every library's buffers. What we want is the quantity the
# GPU counter measures: **the bytes of tensor storages that are still alive**.
#
# Three facts make that countable on a CPU:
#
# 1. Every tensor that PyTorch allocates is the output of an ATen operator, and every operator
#    call passes through the dispatcher. A `TorchDispatchMode` sees each call and its outputs,
#    including the ones autograd runs during backward.
# 2. Views share their base's storage (`x.t()`, `x[0]`, `x.view(...)`), so counting *storages*,
#    keyed by their identity, never double-counts a view.
# 3. A `StorageWeakRef` watches a storage without keeping it alive: when the last tensor
#    (or autograd's saved-tensor slot) that refers to it is gone, `expired()` turns true.
#
# So the meter keeps a table `storage → bytes` of everything allocated inside its block, drops
# the entries whose storage has died before each new operator, and reads the sum. The peak is
# the largest sum seen right after an operator produced its outputs — the same instant the CUDA
# allocator's peak is taken.
#
# | event | live storages | live bytes |
# |---|---|---|
# | `x = torch.ones(1024)` (fp32) | {x} | 4096 |
# | `y = x * 2` | {x, y} | 8192 (peak) |
# | `v = y[:10]` | {x, y} — a view adds nothing | 8192 |
# | `del x` | {y} | 4096 |
# | `del y` (v still holds the storage) | {y} | 4096 |
# | `del v` | {} | 0 |
#
# ```mermaid
# flowchart LR
#   op["ATen operator call<br/>(forward or backward)"] --> mode["LiveBytesMeter<br/>__torch_dispatch__"]
#   mode --> sweep["drop expired storages"]
#   sweep --> add["add output storages<br/>(key = storage identity)"]
#   add --> peak["current, peak, timeline"]
# ```
#
# On CUDA the meter reads the allocator instead (`memory_allocated` and `max_memory_allocated`,
# relative to the moment the block was entered), which is the number Megatron reports
# (`megatron/training/training.py:2361`, `training_log` → `report_memory`).

# %%
def _storage_key(t: torch.Tensor):
    """(identity, weak ref, nbytes, device) of a tensor's storage, or None if it has none."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
        return None
    return s._cdata, StorageWeakRef(s), s.nbytes(), s.device


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind these tensors (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key is not None:
                seen[key[0]] = key[2]
    return sum(seen.values())


# %% [markdown]
# The meter itself. `track(tensors)` adds storages that were created before the block (the
# parameters and optimizer state of a model built earlier), so one meter can report resident
# and flowing bytes together; `mark(label)` stamps the timeline so a plot can show where the
# forward of micro-batch 3 began.
#
# It is built from three pieces, each whole: the table of live storages the CPU path keeps,
# the readings a caller takes (each with its CUDA and its CPU branch), and the dispatch mode
# that enters and leaves the block and feeds the table once per operator.
#
# ### The table of live storages
#
# One entry per storage allocated inside the block: its identity, a weak reference (so the
# table does not keep it alive) and its size. A storage on another device type is not ours
# to count; `sweep` forgets the storages that have died since the last call, and the live
# bytes are the sum of what is left. `add_outputs` takes one operator's outputs and adds those
# whose storage is new: an output that shares an input's storage (a view, an in-place op)
# allocated nothing and is skipped.

# %%
class _StorageTable:
    """Storages born in (or tracked into) a block, held by weak reference, with their bytes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}

    def add(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None or key[3].type != self.device.type or key[0] in self.live:
            return
        self.live[key[0]] = (key[1], key[2])

    def add_outputs(self, out, args) -> None:
        """Add each output storage of one operator that none of its inputs `args` holds."""
        inputs = {k[0] for k in map(_storage_key, _tensors(args)) if k is not None}
        for t in _tensors(out):
            key = _storage_key(t)
            if key is not None and key[0] not in inputs:
                self.add(t)

    def sweep(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            del self.live[k]

    def bytes(self) -> int:
        return sum(n for _, n in self.live.values())

# %% [markdown]
# ### What a caller reads
#
# Each reading has its two branches side by side: the allocator's counters minus the baseline
# taken when the block was entered on CUDA, the storage table on a CPU. `_Readings` is the
# meter's half that answers questions; the meter below supplies `_uses_allocator`, `device`,
# `table`, the baseline `_base` and the CPU peak `_cpu_peak`.

# %%
class _Readings:
    """current, peak, reset_peak, track and mark of LiveBytesMeter (both devices)."""

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that existed before the block (params, grads, optimizer state)."""
        if self._uses_allocator:
            return  # the allocator already sees them; they are part of the baseline
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.table.add(t)
        self._cpu_peak = max(self._cpu_peak, self.current)

    @property
    def current(self) -> int:
        """Live bytes now (CUDA: allocated minus the amount allocated when the block began)."""
        if self._uses_allocator:
            return torch.cuda.memory_allocated(self.device) - self._base
        self.table.sweep()
        return self.table.bytes()

    @property
    def peak(self) -> int:
        """The largest live byte count seen since the block began (or the last reset_peak)."""
        if self._uses_allocator:
            return torch.cuda.max_memory_allocated(self.device) - self._base
        return max(self._cpu_peak, self.current)

    def reset_peak(self) -> None:
        """Start a new peak from the current value."""
        if self._uses_allocator:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._cpu_peak = self.current

    def mark(self, label: str) -> int:
        """Stamp the timeline with a label; returns the live bytes at that moment."""
        now = self.current
        self.timeline.append((time.perf_counter() - self._t0, now, label))
        return now

# %% [markdown]
# ### The meter: a dispatch mode
#
# On CUDA entering and leaving the block is all the meter does: synchronize, reset the
# allocator's peak, take the baseline. On a CPU the work happens in `__torch_dispatch__`, once
# per operator: run it, sweep the table, then add the outputs' new storages to it.
#
# One more reading, for a measurement right after a collective. Gloo runs a collective on its
# own worker thread, and that thread lets go of the collective's tensors a moment *after* the
# caller has woken up: read at once, a temporary the caller already dropped is sometimes
# still alive and sometimes not. `settled()` reads until the count stops changing, so a
# measurement does not depend on which thread the scheduler ran first.
#
# <details><summary>Megatron detail: what the gloo thread held</summary>
#
# Measured after a TP2
# forward: 2 KiB at b = 4, s = 128, the size of one [b, s] fp32 row like those the
# vocab-parallel loss all-reduces; it is gone 200 ms later.
#
# </details>

# %%
class _Settling:
    """settled() of LiveBytesMeter: a reading taken once the live bytes stop changing."""

    def settled(self, quiet_s: float = 0.05, timeout_s: float = 2.0) -> int:
        """Live bytes once they have not changed for quiet_s (CUDA: current, at once)."""
        if self._uses_allocator:
            return self.current
        deadline, last = time.perf_counter() + timeout_s, self.current
        while time.perf_counter() < deadline:
            time.sleep(quiet_s)
            now = self.current
            if now == last:
                return now
            last = now
        return last


# %% [markdown]
# The meter puts the halves together: its own state, the block's entry and exit, and the
# per-operator hook; the readings and `settled` come from the two classes above.

# %%
class LiveBytesMeter(_Readings, _Settling, TorchDispatchMode):
    """Live bytes of tensor storages allocated in this block (CPU: by storage; CUDA: allocator)."""

    def __init__(self, device: torch.device | str | None = None, record_every_op: bool = True):
        super().__init__()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.record_every_op, self.table = record_every_op, _StorageTable(self.device)
        self._cpu_peak, self._base, self._t0 = 0, 0, time.perf_counter()
        self.timeline: list[tuple[float, int, str]] = []

    @property
    def _uses_allocator(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self):
        self._t0 = time.perf_counter()
        if self._uses_allocator:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self  # no dispatch mode needed: the allocator counts for us
        return super().__enter__()

    def __exit__(self, *exc):
        if self._uses_allocator:
            torch.cuda.synchronize(self.device)
            return False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.table.sweep()
        self.table.add_outputs(out, (args, kwargs))
        self._cpu_peak = max(self._cpu_peak, self.table.bytes())
        if self.record_every_op:
            self.timeline.append((time.perf_counter() - self._t0, self.table.bytes(), ""))
        return out

# %% [markdown]
# A second, independent ruler for activations alone: autograd's saved-tensor hooks see every
# tensor a forward keeps for its backward. Their distinct storages are, by definition, the
# activation memory of that forward. The demo below checks that the two rulers agree.

# %%
def saved_tensor_bytes(fn, *args, exclude: Iterable[torch.Tensor] = (), **kwargs
                       ) -> tuple[object, int]:
    """Run fn(*args); return (its output, bytes of the distinct storages autograd saved).

    Storages of `exclude` (e.g. the parameters, which a matmul saves for its input grad) are
    not counted: they are resident memory, not activations.
    """
    saved: list[torch.Tensor] = []
    skip = {k[0] for k in map(_storage_key, exclude) if k is not None}

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, storage_bytes(t for t in saved if _storage_key(t)[0] not in skip)


# %% [markdown]
# ## Demo: one forward and backward of a small MLP, measured
#
# A 3-layer MLP (`h = 256`, batch 64, fp32). We measure three moments and check each against
# an independent count: after the forward, the live bytes are exactly the activations autograd
# saved (less the weights and the input, which existed before) plus the output; after the backward and `del`, only the parameter gradients are left;
# the peak sits in between.

# %%
def _demo_mlp(h: int = 256, b: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(),
                                torch.nn.Linear(4 * h, 4 * h), torch.nn.GELU(),
                                torch.nn.Linear(4 * h, h))
    return model, torch.randn(b, h)


# %% [markdown]
# The three moments, each printed next to its independent count.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    model, x = _demo_mlp()
    # ruler 2, on a throw-away forward: what autograd saves, minus the weights and the input
    # (both existed before the meter's block, so the meter does not count them either)
    _, activations = saved_tensor_bytes(model, x, exclude=[x, *model.parameters()])
    param_bytes = storage_bytes(model.parameters())
    with LiveBytesMeter() as meter:
        meter.mark("start")
        out = model(x)
        after_forward = meter.mark("forward done")
        out.sum().backward()
        meter.mark("backward done")
        del out
        after_backward = meter.mark("graph freed")
    out_bytes = 64 * 256 * 4
    print(f"parameters            {param_bytes / 2**20:7.2f} MiB (built before the meter)")
    print(f"saved for backward    {activations / 2**20:7.2f} MiB (saved-tensor hooks)")
    print(f"live after forward    {after_forward / 2**20:7.2f} MiB (meter)")
    print(f"peak                  {meter.peak / 2**20:7.2f} MiB")
    print(f"live after backward   {after_backward / 2**20:7.2f} MiB (= the .grad tensors)")
    assert after_forward == activations + out_bytes, (after_forward, activations)
    assert after_backward == param_bytes  # one .grad per parameter, nothing else alive
    assert meter.peak > after_forward

# %% [markdown]
# The whole timeline, one step per operator call, with the four marks as dashed lines.

# %%
if __name__ == "__main__":
    t, live, labels = zip(*meter.timeline)
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.step(range(len(live)), [v / 2**20 for v in live], where="post")
    for i, lab in enumerate(labels):
        if lab:
            ax.axvline(i, color="gray", lw=0.6, ls="--")
            ax.text(i, max(live) / 2**20 * 0.95, lab, rotation=90, va="top", fontsize=8)
    ax.set_xlabel("operator call"), ax.set_ylabel("live MiB")
    ax.set_title("live tensor bytes through one forward and backward (CPU, measured)")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# The forward climbs as each layer's input and GELU input are saved; the backward first
# allocates gradients and then releases the saved activations layer by layer; what is left is
# exactly one gradient per parameter. That shape — a resident floor and a flowing hill — is what
# the [resident vs flowing](resident_flowing.py) page measures for a whole training iteration.
#
# ## How production does it
#
# - Megatron reports CUDA allocator statistics (`torch.cuda.memory_allocated`,
#   `max_memory_allocated`, `memory_reserved`) in `report_memory`
#   (`megatron/training/utils.py`), called from `training_log`
#   (`megatron/training/training.py:2361`) at the first logged iterations.
# - `torch.cuda.memory._record_memory_history` and its snapshot viewer give the same timeline as
#   ours on a GPU, with the stack of every allocation.
# - The meter costs one Python call per operator: fine for a book-sized model, too slow for a
#   production step. It is a measuring instrument, not something to leave on.
#
# ## Exercises
#
# 1. Replace GELU with `torch.nn.GELU(approximate="tanh")` and predict the change in saved
#    bytes.
#
#    <details><summary>Answer</summary>
#
#    None: `saved_tensor_bytes` reads 1,048,576 B (1 MiB)
#    both ways. Either GELU saves its input for the backward, and the tanh form only changes
#    the arithmetic, not what is kept.
#
#    </details>
#
# 2. Wrap the forward in `torch.no_grad()`: what does the meter read after it?
#
#    <details><summary>Answer</summary>
#
#    65,536 B: only the output, $64 \cdot 256 \cdot 4$.
#    Nothing is saved for a backward, so each intermediate dies as soon as the next layer has
#    read it; the peak is 524,288 B, two $64 \times 1024$ fp32 tensors alive at once.
#
#    </details>

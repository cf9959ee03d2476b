# %% [markdown]
# # 08 · The full-iteration CUDA graph
#
# A small model on a fast GPU spends much of its step *launching* kernels: each of the
# thousands of kernels of a forward and backward costs the CPU a few microseconds to launch,
# and when the kernels themselves take a few microseconds the GPU waits for the CPU. A CUDA
# graph records the kernels of a piece of work once and replays the whole sequence with one
# launch. Megatron's `FullCudaGraphWrapper` records **the whole forward-backward of an
# iteration** — every micro-batch, forward and backward, and the gradient collectives inside
# the backward — leaving the data loading and the optimizer outside. This page builds that
# wrapper, explains every constraint it imposes, and refuses to run on a CPU.

# %%
from __future__ import annotations

from typing import Any, Callable, Optional

import weakref

import torch
import torch.distributed as dist

from tinytron.parallel.rng import RNGStatesTracker, get_rng_tracker

__all__ = ["FullCudaGraphUnavailable", "StaticBufferLoader", "FullCudaGraphWrapper",
           "get_capture_stream", "get_graph_pool", "copy_into_static"]

# %% [markdown]
# ## What a graph can and cannot hold
#
# Capturing runs the function once in a special mode in which kernels are *recorded*, not
# run; `replay()` later runs the recorded kernels with the **same arguments** — the same device
# pointers, the same shapes, the same launch parameters. Everything follows from that:
#
# | constraint | why | how the wrapper meets it |
# |---|---|---|
# | static shapes | kernel launch parameters are frozen | fixed micro-batch size, sequence length and micro-batch count |
# | static input addresses | a replay reads the pointers recorded at capture | `StaticBufferLoader` copies each batch **into** the same tensors (`copy_`) |
# | no host synchronization | `.item()`, `print(tensor)`, a NaN check that branches in Python would wait for a kernel that is only being recorded | the rerun machine's checks must be off (Megatron asserts `--no-check-for-nan-in-loss-and-grad`, `arguments.py:1186-1188`); the trainer refuses each of `[reliability]`'s three `check_for_*` switches with this graph |
# | no data-dependent control flow | Python runs once, at capture; its branches are baked in | the schedule's order depends only on static counts |
# | memory from a private pool | addresses used inside the graph must stay valid for every replay | a graph memory pool (`pool=`), shared with the optimizer's graph if any (`use_single_mempool`) |
# | warm-up first | the first calls allocate (cuBLAS workspaces, autograd's accumulation buffers, DDP buckets) and lazily initialize | `cuda_graph_warmup_steps` eager calls (default 3) before the capture |
# | no recompute | chapter 06's checkpoint reads and rewinds generator states on the host, which a capture cannot do | the trainer refuses recompute with this graph (Megatron skips checkpointing while capturing, `megatron/core/tensor_parallel/random.py:647-648`) |
# | RNG | a replay must advance the Philox offset, not reuse the captured one; a state copied in with `set_rng_state` at capture is never copied again | PyTorch registers the default generator; the wrapper registers every stream of appendix A's tracker (`register_generator_state`), whose forks point the default at a stream instead of copying states |
# | outputs are static too | the returned loss tensors are overwritten by the next replay | consume before the next call: `train_step` reduces at once, `evaluate` copies each batch's reports |
# | gradients in place | `zero_grad(set_to_none=True)` would free the addresses the graph writes | DDP's contiguous grad buffer (chapter 05), zeroed in place between replays |
# | collectives | NCCL kernels can be captured; gloo (CPU) cannot | CUDA + NCCL only |
#
# <details><summary>Megatron detail: which generators are registered</summary>
#
# Megatron registers every RNG tracker state with the graph
# (`megatron/core/full_cuda_graph.py:213-214`), the tracker being the process-wide one. Here the
# wrapper registers the streams of the tracker it is given (`rng_tracker=`, by default the
# process-wide CUDA tracker of appendix A, the one the model's dropout forks into), plus any
# extra `generators=`. Registration happens at capture, not at construction, so a tracker
# reseeded between the two is the one registered; one reseeded *after* the capture holds new
# generator objects, and the graph must be captured again (`reset_cuda_graph`).
#
# </details>
#
# Per call (`megatron/core/full_cuda_graph.py:184`): read **all** the iteration's micro-batches
# from the real iterator first and copy them into the static buffers on a side stream
# (`data_read`, `:151`); hand the schedule an iterator over the static buffers; count the calls
# separately for training and validation (`forward_only`); at call number `warmup` capture
# (barrier, synchronize, capture on a shared stream into the pool, synchronize, barrier); from
# then on — including the capture call itself, which only recorded — `replay()` and return the
# stored result. The optimizer step stays eager (or gets its own graph,
# `megatron/core/optimizer/optimizer_cuda_graph.py:14`).
#
# ```mermaid
# sequenceDiagram
#   participant L as train loop
#   participant W as FullCudaGraphWrapper
#   participant G as CUDA graph
#   L->>W: call 0..2 (warm-up)
#   W->>W: copy batches into static buffers, run eagerly
#   L->>W: call 3
#   W->>G: capture forward-backward (kernels recorded, not run)
#   W->>G: replay
#   L->>W: call 4, 5, ...
#   W->>W: copy batches into the same buffers
#   W->>G: replay (one launch)
#   L->>L: optimizer.step() eagerly, zero grad buffers in place
# ```

# %%
class FullCudaGraphUnavailable(RuntimeError):
    """The full-iteration CUDA graph was asked for where it cannot run."""


_CAPTURE_STREAM: Optional["torch.cuda.Stream"] = None
_GRAPH_POOL = None


def get_capture_stream() -> "torch.cuda.Stream":
    """One process-wide side stream for every capture (`full_cuda_graph.py:21`)."""
    global _CAPTURE_STREAM
    if _CAPTURE_STREAM is None:
        _CAPTURE_STREAM = torch.cuda.Stream()
    return _CAPTURE_STREAM


def get_graph_pool(use_single_mempool: bool = True):
    """A shared graph memory pool (or a fresh one per graph)."""
    global _GRAPH_POOL
    if not use_single_mempool:
        return torch.cuda.graph_pool_handle()
    if _GRAPH_POOL is None:
        _GRAPH_POOL = torch.cuda.graph_pool_handle()
    return _GRAPH_POOL


# %% [markdown]
# A batch may be a tensor, a dict or a list of them. The first copy allocates the static
# tensors on the device; every later one writes into them, and a batch of another shape or
# dtype is refused.

# %%
def copy_into_static(src: Any, dst: Any = None, device: str | torch.device = "cuda") -> Any:
    """Copy a (nested) batch into `dst` in place; without `dst`, allocate it (same structure)."""
    if isinstance(src, torch.Tensor):
        if dst is None:
            return src.detach().to(device, copy=True)
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"a CUDA graph needs static inputs: got {tuple(src.shape)} "
                             f"{src.dtype}, captured {tuple(dst.shape)} {dst.dtype}")
        dst.copy_(src, non_blocking=True)
        return dst
    if isinstance(src, dict):
        return {k: copy_into_static(v, None if dst is None else dst[k], device)
                for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        return type(src)(copy_into_static(v, None if dst is None else dst[i], device)
                         for i, v in enumerate(src))
    return src  # ints, strings: part of the static "shape" of the call


# %% [markdown]
# `StaticBufferLoader` keeps one static copy per stage and micro-batch index: the first batch
# allocates it, every later one is copied into it, on a side stream that the compute stream
# then waits for.

# %%
class StaticBufferLoader:
    """Per stage ('training'/'validation') and micro-batch: a batch that never moves."""

    def __init__(self, device: str | torch.device = "cuda"):
        self.device = torch.device(device)
        self.buffers: dict[str, list] = {"training": [], "validation": []}
        self.stream = torch.cuda.Stream() if self.device.type == "cuda" else None

    def __call__(self, batch: Any, stage: str, index: int) -> Any:
        """The static copy of micro-batch `index` of `stage`, refreshed with `batch`."""
        bufs = self.buffers[stage]
        if self.stream is None:
            return self._copy(batch, bufs, index)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = self._copy(batch, bufs, index)
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def _copy(self, batch, bufs: list, index: int):
        if index == len(bufs):
            bufs.append(copy_into_static(batch, None, self.device))
        else:
            copy_into_static(batch, bufs[index], self.device)
        return bufs[index]


# %% [markdown]
# ## The wrapper
#
# `FullCudaGraphWrapper(forward_backward_func, cuda_graph_warmup_steps=3,
# use_single_mempool=True, rng_tracker=None, generators=())` has the call signature of chapter 01's schedules
# (`forward_backward_func(forward_step_func=, data_iterator=, model=, num_microbatches=, …,
# forward_only=)`), so `train()` uses it unchanged (Megatron wraps it at
# `megatron/training/training.py:3293-3298`, and the evaluation schedule at `:3858`). On a
# machine without CUDA it refuses at construction, with the reason: there is nothing to
# capture into, and silently running eagerly would make the speed-up claims of a
# configuration meaningless.
#
# The wrapper is six whole parts: `GraphSetup` (the settings), `DataRead` (the data read
# that must happen outside the graph), `GraphSlots` and `SameCall` (the per-stage graphs,
# kept on the class, below, and the check that a replay is for the call captured), `Capture`
# (an eager warm-up call and the capture) and `CaptureReplay` (the per-stage counter that
# decides eager, capture or replay); `FullCudaGraphWrapper` is the six together. A check of the data that reads values (the
# trainer's token-id check against the vocabulary, chapter 04) cannot live inside the graph:
# it would run once, at capture, and its read would stall the capture. `check_batch=` runs it
# on each host batch before the copy, at every call.
# With the default `cuda_graph_warmup_steps = 3`, training calls 1 to 3 run eagerly; call 4
# captures (recording runs no kernel) and at once replays what it recorded, so that call too
# computes its step; every later call only replays.

# %%
class GraphSetup:
    """The wrapper's settings and the generators a capture registers."""

    def __init__(self, forward_backward_func: Callable, cuda_graph_warmup_steps: int = 3,
                 use_single_mempool: bool = True, generators: tuple = (),
                 rng_tracker: Optional[RNGStatesTracker] = None, barrier_group=None,
                 check_batch: Optional[Callable[[Any], None]] = None):
        if not torch.cuda.is_available():
            raise FullCudaGraphUnavailable(
                "the full-iteration CUDA graph (cuda_graph_impl='full_iteration') needs a CUDA "
                "device, and torch.cuda.is_available() is False here: CUDA graphs record GPU "
                "kernels and there are none on a CPU. Use cuda_graph_impl='none' on CPU.")
        if cuda_graph_warmup_steps < 1:
            raise ValueError(f"cuda_graph_warmup_steps must be >= 1 (the capture needs warm "
                             f"allocations), got {cuda_graph_warmup_steps}")
        if rng_tracker is not None and not rng_tracker.graph_safe:
            raise ValueError(f"rng_tracker is a {rng_tracker.device.type} tracker; a CUDA graph "
                             "registers the streams of a CUDA one")
        self.fn, self.warmup = forward_backward_func, cuda_graph_warmup_steps
        self.use_single_mempool, self.generators = use_single_mempool, tuple(generators)
        self.rng_tracker, self.barrier_group = rng_tracker, barrier_group
        self.check_batch = check_batch

    def generators_to_register(self) -> list:
        """The tracker's streams (the model's dropout draws from them), then any extra ones."""
        tracker = self.rng_tracker if self.rng_tracker is not None else get_rng_tracker("cuda")
        return list(tracker.generators().values()) + list(self.generators)


# %% [markdown]
# The data read, at every call and outside the graph: all the iteration's micro-batches are
# pulled from the real iterator (one list per virtual-pipeline chunk), checked on the host,
# copied into the static buffers, and the schedule gets an iterator over those.

# %%
class DataRead:
    """The read of an iteration's micro-batches into the static buffers."""

    def data_read(self, data_iterator, num_microbatches: int, stage: str):
        """Pull the iteration's micro-batches now; an iterator over their static copies."""
        if isinstance(data_iterator, list):  # one iterator per virtual-pipeline chunk
            return [self.data_read(d, num_microbatches, f"{stage}/{i}")
                    for i, d in enumerate(data_iterator)]
        if data_iterator is None:
            return None
        self.loader.buffers.setdefault(stage, [])
        batches = [next(data_iterator) for _ in range(num_microbatches)]
        for batch in batches if self.check_batch is not None else ():
            self.check_batch(batch)   # on the host, every call: a replay runs no Python
        return iter([self.loader(b, stage, i) for i, b in enumerate(batches)])


# %% [markdown]
# ## Graphs kept on the class
#
# The counters, the graphs, their results and the static input buffers live **on the class**,
# as Megatron keeps them (`full_cuda_graph.py:141-143`, and the loader's buffers at `:102`).
# Megatron builds a new wrapper in every `evaluate` call (`training.py:3858`) and in `train`
# (`:3293`); per-instance graphs would capture the validation graph again at each evaluation
# and free nothing of the old one. On the class, a new wrapper continues where the last one
# stopped: it counts on, replays the same graph and copies its batches into the same buffers
# the graph reads. (`tinytron.train` wraps the schedule once, with `[training]
# cuda_graph_impl = "full_iteration"`, and hands that wrapper to its evaluations too; the
# class-level slots are what keep any second wrapper, in a user's loop or a test, correct.)
#
# The price is that two models in one process share the slots: a graph replayed for other
# model chunks, or for another micro-batch count than it captured, would compute someone
# else's step. So the wrapper remembers both at capture and refuses a replay that differs
# (Megatron does not check), naming `reset_cuda_graph`, which drops the graphs and their
# static inputs (Megatron's keeps the buffers).

# %%
class GraphSlots:
    """Per stage: call count, graph, result, what it was captured for; the static inputs."""

    calls: dict[str, int] = {"training": 0, "validation": 0}
    graphs: dict[str, Optional["torch.cuda.CUDAGraph"]] = {"training": None,
                                                           "validation": None}
    results: dict[str, Any] = {"training": None, "validation": None}
    captured_for: dict[str, Optional[tuple]] = {"training": None, "validation": None}
    _loader: Optional[StaticBufferLoader] = None

    @property
    def loader(self) -> StaticBufferLoader:
        """The static input buffers every wrapper of this process copies into."""
        if GraphSlots._loader is None:
            GraphSlots._loader = StaticBufferLoader("cuda")
        return GraphSlots._loader

    @classmethod
    def reset_cuda_graph(cls, stage: Optional[str] = None) -> None:
        """Drop the graph(s) and their static inputs; count warm-up again (`:244`)."""
        for s in ([stage] if stage else list(cls.graphs)):
            cls.graphs[s], cls.results[s], cls.calls[s] = None, None, 0
            cls.captured_for[s] = None
            if GraphSlots._loader is not None:
                for key in [k for k in GraphSlots._loader.buffers
                            if k == s or k.startswith(s + "/")]:
                    GraphSlots._loader.buffers[key] = []


# %% [markdown]
# At capture the wrapper remembers the model chunks (weakly) and the micro-batch count; a
# replay for anything else is refused, naming `reset_cuda_graph`.

# %%
class SameCall:
    """What a graph was captured for, and the refusal of a replay for anything else."""

    def _remember(self, stage: str, kwargs) -> None:
        model = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
        self.captured_for[stage] = ([weakref.ref(m) for m in model], kwargs["num_microbatches"])

    def _check_same_call(self, stage: str, kwargs) -> None:
        models, count = self.captured_for[stage]
        now = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
        if len(now) != len(models) or any(ref() is not m for ref, m in zip(models, now)) \
                or kwargs["num_microbatches"] != count:
            raise RuntimeError(
                f"the {stage} CUDA graph was captured for other model chunks or "
                f"{count} micro-batches (now {kwargs['num_microbatches']}); call "
                "FullCudaGraphWrapper.reset_cuda_graph() before wrapping another model")


# %% [markdown]
# Each call counts per stage: before call number `warmup` it runs eagerly (on the capture
# stream), at that call it captures, and from then on it replays and returns the result tensors
# the capture produced, which the replay has just overwritten. The capture registers the
# tracker's generators first: a generator used inside a capture without being registered
# raises, and one registered but never used costs nothing.
#
# Returning the capture's own tensors is the contract (Megatron's
# `megatron/core/full_cuda_graph.py:232-234` returns its stored result the same way), and it
# binds every caller: consume each call's result before the next.
#
# <details><summary>Megatron detail: how chapter 01's evaluate met the contract</summary>
#
# Chapter 01's `evaluate` once kept each batch's reports and averaged them
# after the last batch: under replay every kept report was the same tensor, so validation
# averaged the last batch `eval_iters` times (losses 1, 2, 3, 4 read 4.0, not 2.5). It now
# copies each call's reports before the next call, as Megatron reduces each batch inside its
# loop; `tests/test_cuda_graph_rng.py` checks on CPU that an evaluation through results
# returned this way equals the eager one, bit for bit.
#
# </details>
#
# First the two ways a call runs the schedule: eagerly on the capture stream, or captured
# between barriers and synchronizations into the shared pool.

# %%
class Capture:
    """An eager warm-up call on the capture stream; the capture itself."""

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.barrier_group)

    def _eager(self, args, kwargs):
        # Warm-up runs on the capture stream, as PyTorch asks for whole-network capture: the
        # autograd state created here (gradient accumulators) then lives on the same stream.
        side, here = get_capture_stream(), torch.cuda.current_stream()
        side.wait_stream(here)
        with torch.cuda.stream(side):
            result = self.fn(*args, **kwargs)
        here.wait_stream(side)
        return result

    def _capture(self, stage: str, args, kwargs) -> None:
        self._barrier()
        graph = torch.cuda.CUDAGraph()
        for gen in self.generators_to_register():  # every tracker stream (`:213-214`)
            graph.register_generator_state(gen)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=get_capture_stream(),
                              pool=get_graph_pool(self.use_single_mempool),
                              capture_error_mode="thread_local"):
            self.results[stage] = self.fn(*args, **kwargs)
        torch.cuda.synchronize()
        self._barrier()
        self._remember(stage, kwargs)
        self.graphs[stage] = graph


# %% [markdown]
# Then the call: read the data, capture at call number `warmup`, replay from then on.

# %%
class CaptureReplay:
    """Per stage: eager warm-up calls, one capture, then replays of the captured graph."""

    def __call__(self, *args, **kwargs):
        """Same signature as the schedule; eager for the warm-up calls, then a replayed graph."""
        stage = "validation" if kwargs.get("forward_only") else "training"
        kwargs["data_iterator"] = self.data_read(kwargs["data_iterator"],
                                                 kwargs["num_microbatches"], stage)
        if self.calls[stage] == self.warmup and self.graphs[stage] is None:
            self._capture(stage, args, kwargs)
        if self.graphs[stage] is not None:
            self._check_same_call(stage, kwargs)
            self.graphs[stage].replay()
            result = self.results[stage]
        else:
            result = self._eager(args, kwargs)
        self.calls[stage] += 1
        return result


class FullCudaGraphWrapper(CaptureReplay, Capture, GraphSetup, DataRead, GraphSlots, SameCall):
    """Capture forward-backward of a whole iteration once; replay it every later iteration."""


# %% [markdown]
# ## Demo
#
# On this machine there is no GPU: the wrapper refuses with its reason, and the static-buffer
# contract — a new batch lands in the *same* storage, a batch of another shape is rejected —
# is shown on CPU tensors. On a GPU, `tests/test_reliability_gpu.py` trains the tiny GPT with
# the wrapper around a gradient-accumulating forward-backward and checks that the graphed
# losses equal the eager ones, iteration by iteration, and reports the speed-up;
# `tests/test_cuda_graph_rng.py` does the same with dropout inside the tracker's forks and
# checks that each replay draws new masks, the same ones an eager run draws from the same
# seeds.

# %%
if __name__ == "__main__":
    if torch.cuda.is_available():
        print("CUDA is available: run tests/test_reliability_gpu.py for the graphed run")
    else:
        try:
            FullCudaGraphWrapper(lambda **kw: [])
            raise AssertionError("the wrapper must refuse without CUDA")
        except FullCudaGraphUnavailable as e:
            print("refused:", e)

    loader = StaticBufferLoader("cpu")
    first = loader({"tokens": torch.arange(8).view(2, 4)}, "training", 0)
    address = first["tokens"].data_ptr()
    second = loader({"tokens": torch.arange(8, 16).view(2, 4)}, "training", 0)
    print("static batch after the second copy:", second["tokens"].tolist(),
          "| same storage:", second["tokens"].data_ptr() == address)
    assert second["tokens"].data_ptr() == address and second["tokens"][0, 0].item() == 8
    try:
        loader({"tokens": torch.zeros(3, 4, dtype=torch.long)}, "training", 0)
        raise AssertionError("a different shape must be rejected")
    except ValueError as e:
        print("rejected:", e)

    # The result contract: every replay writes into the tensors the capture returned.
    from tinytron.main_loop.loop import _own_reports   # chapter 01's evaluate copies each call
    static = [{"lm loss": torch.zeros(2)}]
    kept, owned = [], []
    for loss in (1.0, 2.0, 3.0, 4.0):
        static[0]["lm loss"].copy_(torch.tensor([loss, 1.0]))   # what replay() does
        kept += static
        owned += _own_reports(static)
    mean = (lambda reports: sum(r["lm loss"][0].item() for r in reports) / len(reports))
    print(f"mean of 4 replays: references kept {mean(kept)}, copies kept {mean(owned)}")
    assert (mean(kept), mean(owned)) == (4.0, 2.5)

# %% [markdown]
# ## Summary
#
# - The whole forward-backward of an iteration — all micro-batches and the in-backward
#   gradient collectives — is captured once after a few eager warm-up iterations and replayed
#   with one launch; data loading, the loss bookkeeping and the optimizer stay outside.
# - Every input lives at a fixed address (the static buffers), every shape is fixed, nothing
#   inside synchronizes with the host — so the NaN checks of the rerun machine must be off.
# - Dropout stays random under replay because every RNG stream is a generator object the graph
#   registers, and the tracker's forks swap which state the default generator points at.
# - A replay returns the tensors the capture returned, overwritten: a caller consumes each
#   call's result before the next (`evaluate` copies each batch's reports).
# - Graphs, counters and static inputs are kept on the class, so a wrapper built again (each
#   evaluation, in Megatron) replays the same graph; a replay for another model is refused.
# - There is no CPU version of a CUDA graph: on a CPU the wrapper and the trainer refuse.
#
# ## How production does it
#
# - `megatron/core/full_cuda_graph.py`: shared stream and pool `:21/:32/:44`,
#   `StaticBufferLoader` `:99`, `FullCudaGraphWrapper` `:138` (`data_read` `:151`, `__call__`
#   `:184`, `reset_cuda_graph` `:244`); enabled by `cuda_graph_impl="full_iteration"`
#   (`megatron/core/transformer/transformer_config.py:934`), `cuda_graph_warmup_steps = 3`
#   (`:927`), `cuda_graph_use_single_mempool = True` (`:916`); the optimizer's graph in
#   `megatron/core/optimizer/optimizer_cuda_graph.py:14`.
# - Per-layer graphs instead (`cuda_graph_impl="local"` or `"transformer_engine"`): each
#   layer's forward and backward are captured separately, which tolerates more host logic
#   between layers at the cost of one launch per layer.
# - PyTorch: `torch.cuda.graph`, `torch.cuda.make_graphed_callables`, and `torch.compile`'s
#   `mode="reduce-overhead"` (CUDA graph trees).
#
# ## Exercises
#
# 1. Why must the data be copied *before* the schedule runs rather than read inside it, as the
#    eager schedule does?
#
#    <details><summary>Hint</summary>
#
#    A replay runs no Python: a `next(data_iterator)` inside
#    the schedule would run once, at capture, and every replay would read that one batch's
#    tensors. Reading from a loader also means host work and host-to-device copies, which a
#    capture cannot hold. See `DataRead.data_read` and the static-input row of the
#    table.
#
#    </details>
#
# 2. The number of micro-batches grows with a batch-size ramp-up (chapter 01). What must happen
#    to the graph when it changes, and what does it cost?
#
#    <details><summary>Hint</summary>
#
#    The count is baked into the capture, and
#    `SameCall._check_same_call` refuses a replay for another one. Follow
#    `reset_cuda_graph("training")`: the graph and its static inputs go, the call count
#    starts again at 0, so each new count pays `cuda_graph_warmup_steps` eager iterations and
#    one capture.
#
#    </details>

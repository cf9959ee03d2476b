# %% [markdown]
# # 06 · Recompute (3/4): fine-grained activation offload to host memory
#
# Recompute pays for memory with compute. Offload pays with PCIe bandwidth instead: the
# activations a module saves for its backward are copied to host memory as soon as the module's
# forward ends, and copied back shortly before the backward needs them. On a GPU both copies
# run on side streams, so they can hide behind the matmuls — when the link moves a layer's
# offloaded bytes in less time than the layer computes (the section "What the overlap needs"
# puts numbers on it). This page builds Megatron's fine-grained version, where the model
# config picks *which modules'* activations move.
#
# You will build: `HostBufferPool`, `OffloadGroup`, `ChunkOffloadHandler`, `OffloadManager`
# and `install_offload(model, manager)`.

# %%
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from tinytron.recompute._offload_parts import (_HostRecord, _identity, _is_parameter_data,
                                               _memory_order, _Streams, _Tag, _to_device,
                                               _to_host)

__all__ = ["HostBufferPool", "OffloadGroup", "ChunkOffloadHandler", "OffloadManager",
           "install_offload", "offload_group_modules", "overlap_bandwidth", "PCIE_GEN5_X16"]

# %% [markdown]
# ## The mechanism in one picture
#
# Autograd lets a program intercept every tensor a forward saves for its backward:
# inside `torch.autograd.graph.saved_tensors_hooks(pack, unpack)`, `pack(t)` is called with
# each saved tensor and may return *anything* (a tag); in backward, `unpack(tag)` must give the
# tensor back. Megatron (`megatron/core/pipeline_parallel/fine_grained_activation_offload.py`)
# builds offload from that and two markers around each chosen module's region, a **group**:
#
# ```mermaid
# sequenceDiagram
#   participant C as compute stream
#   participant D as D2H stream
#   participant H as H2D stream
#   Note over C: forward of layer i
#   C->>C: start(qkv_linear): pack hooks on
#   C->>C: linear_qkv forward (saves its input → tag)
#   C->>D: commit: D2H waits for compute, copies the group's tensors to pinned buffers
#   D-->>D: record offload event, device memory freed
#   Note over C: ... forward goes on while D copies ...
#   Note over C: backward of layer i+1
#   C->>H: start marker of layer i+1 fires: prefetch layer i's groups
#   H-->>H: wait offload event, copy back, record reload event
#   C->>C: commit marker of layer i fires: wait reload event
#   C->>C: linear_qkv backward: unpack(tag) → the reloaded tensor
# ```
#
# The pieces, with Megatron's names: a **group** (`OffloadTensorGroup`, `:332`) holds the saved
# tensors of one module call; a **chunk handler** (`ChunkOffloadHandler`, `:739`) holds the
# groups of one micro-batch's forward through one model chunk; a **manager**
# (`PipelineOffloadManager`, `:383`) owns the two side streams, the pool of pinned host
# buffers and the queue of chunks waiting for their backward. The markers are how the
# backward tells the handler where it is: the commit marker fires just *before* its group's
# backward (time to wait for the reload), the start marker just *after* (time to prefetch).
#
# The markers are gradient hooks on the region's input and output (`tensor.register_hook`),
# which leave the graph untouched: with hooks, offload leaves every gradient bitwise unchanged.
#
# <details><summary>Megatron detail: identity markers</summary>
#
# Megatron's markers are two
# identity autograd functions (`:1108`, `:1188`) applied to the region's input and output. The
# difference is visible in the last bit: the layer input feeds both the norm and the residual
# add, and an identity node in front of the norm makes autograd sum the norm's two gradient
# contributions before adding the residual's, instead of in the order the plain graph uses — a
# different rounding, gradients one ulp apart.
#
# </details>
#
# **Which modules.** `offload_modules` names regions of a layer: `attn_norm` (input
# layernorm), `qkv_linear`, `core_attn` (softmax attention), `attn_proj`, `mlp_norm`
# (`transformer_config.py:1127-1145`, checks at `:1675-1698`). `attn_proj` requires `core_attn`:
# the projection's input *is* core attention's output, which a fused attention kernel also
# saves for its own backward, so moving it for `attn_proj` alone would free nothing. Megatron's
# list has no region for a dense MLP's internals (`expert_fc1` and `moe_act` are MoE's): they
# are the bulk of the compute that hides the copies of the other groups.
#
# **What is not moved.** Tensors smaller than `min_offloaded_tensor_size` elements (Megatron:
# $2^{20}$, `:1144`) stay: a copy's fixed cost dominates for them. Parameters (and views of
# them, like the transposed weight a linear saves) stay: they live on the device anyway.
# A tensor saved twice in one group (an RMSNorm saves its input for two operations) is copied
# once.
#
# **The offload margin.** On the last pipeline stage a chunk's backward starts right after
# its forward, and the first groups it needs are the last layer's: nothing could have
# prefetched them. The handler knows the chunk's layers in advance: a chunk with
# `post_process` keeps its last layer's groups on the device.
#
# <details><summary>Megatron detail: the warm-up iteration</summary>
#
# Megatron's warm-up
# iteration finds those groups and marks them not to be offloaded (`post_warmup_callback`,
# `:523`; `should_bulk_offload`, `:962`). Knowing the layers in advance, tinytron needs no
# warm-up.
#
# </details>
#
# **Prefetch one layer ahead.** When the backward enters the last group of layer $i$, the
# handler starts reloading every group of layer $i-1$; the copies then overlap with the rest
# of layer $i$'s backward, its MLP included: a layer gives the copies more compute to hide
# behind, for at most one layer of extra memory.
#
# <details><summary>Megatron detail: one group ahead</summary>
#
# Megatron prefetches one
# *group* ahead.
#
# </details>
#
# When a chunk's backward is done, the handler starts the last layer of the next chunk in the
# queue (`pre_reload_last_layer`, `:954`).
#
# **CPU, same structure.** Without CUDA the streams and events are absent and every copy
# completes at once; host buffers are NumPy arrays, memory that torch's allocator — like the
# CUDA allocator on a GPU — does not count, so chapter 01's meter sees exactly what stays on
# the "device".

# %% [markdown]
# ## The host buffer pool and the two streams
#
# Pinned (page-locked) host memory is what lets a `non_blocking` copy run truly asynchronously,
# and pinning is slow (a `cudaHostAlloc` per buffer), so buffers are reused across
# micro-batches, keyed by (shape, dtype) (`GPUTensorPool`, `:98`). A buffer handed back after a
# reload may still be the source of an H2D copy in flight; it carries the reload event, and the
# next D2H copy into it waits for that event first.

# %%
class HostBufferPool:
    """Reusable host buffers keyed by (shape, dtype): pinned tensors with CUDA, NumPy bytes without."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._free: dict[tuple, list] = {}
        self.num_allocated = 0
        self.bytes_allocated = 0

    def take(self, shape: torch.Size, dtype: torch.dtype):
        """A free buffer for (shape, dtype), or a new one; waits for its last reload if needed."""
        key = (tuple(shape), dtype)
        if self._free.get(key):
            buffer, ready = self._free[key].pop()
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            return buffer
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.num_allocated, self.bytes_allocated = self.num_allocated + 1, self.bytes_allocated + nbytes
        if self.pinned:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return np.empty(nbytes, dtype=np.uint8)

    def give_back(self, buffer, shape, dtype, ready=None) -> None:
        """Return a buffer; `ready` is the event after which it may be overwritten."""
        self._free.setdefault((tuple(shape), dtype), []).append((buffer, ready))


# %% [markdown]
# The copies keep a tensor's layout. A saved tensor may be a non-contiguous view (the
# transposed input a linear saves), so it goes to the host in its own memory order, and the
# reload gives the device tensor back the same strides: the backward's kernels then see the
# same layout, and round the same way, as without offload. In numbers: a bf16 `[4096, 8192]`
# tensor seen through `.t()` has shape `[8192, 4096]` and strides `(1, 8192)`; its memory
# order is dims `(1, 0)`, so the host gets the 64 MiB in storage order with no transposing
# copy, and the reload permutes back to shape `[8192, 4096]`, strides `(1, 8192)`.
#
# The two side streams hide behind one small class, so that the handler below reads the same
# on both devices: on CUDA it queues copies and records events, on CPU every call is a no-op
# and every copy has finished when it returns. On a GPU the order is: the D2H stream waits
# for the compute stream (the tensor must be written before it is read), copies, and records
# an event; the reload's H2D stream copies back, records its event, and the compute stream
# waits on that event right before the backward of the layer that needs the tensor — and not
# earlier, so the copy runs while the backward of the layer above is still computing.
#
# The copies (`_memory_order`, `_to_host`, `_to_device`), the streams (`_Streams`) and the two
# small records a slot refers to (`_Tag`, `_HostRecord`, and the `_identity` of a saved
# tensor) live in the chapter's private module `tinytron.recompute._offload_parts`
# (`chapters/06_recompute_offload/_offload_parts.py`); they move bytes and name things, and
# decide nothing about what is offloaded or when.
#
# ## Groups and the chunk handler
#
# A saved tensor gets a tag `(group, slot)`. Until its group commits, the slot holds the
# device tensor; after an offload, a host record; after a reload, the new device tensor. The
# slot counts how many tags point at it and lets go of the tensor after the last unpack, so
# the reloaded memory is freed as soon as autograd is done with it.
#
# Why count uses: one tensor is often saved twice within a module call, by two autograd nodes
# that both read it. Both pack calls see the same storage, offset, shape, strides and dtype
# (`_identity`), so one slot with two uses serves them and one copy crosses the link, not
# two. A parameter, or a view of one (the transposed weight a
# linear saves), is never offloaded: it lives on the device anyway, and copying it would
# only spend bandwidth. A tensor under `min_offloaded_tensor_size` elements (the reciprocal RMS,
# $s \cdot b$ floats) stays too: its copy would cost more in launch latency than it frees.

# %%
@dataclass
class OffloadGroup:
    """The saved tensors of one module call (one layer, one offload_modules name)."""

    name: str
    layer: int
    index: int
    slots: list = field(default_factory=list)  # device tensor | host record
    uses: list = field(default_factory=list)  # tags not yet unpacked, per slot
    seen: dict = field(default_factory=dict)  # identity of a saved tensor -> slot
    offloaded: bool = False
    reloaded: bool = False
    offload_event: object = None
    reload_event: object = None
    offloaded_bytes: int = 0


# %% [markdown]
# The handler's forward side: `start_group` opens a group and turns the pack hooks on;
# `pack` files each saved tensor (or lets a small one, or a parameter, through untouched);
# `commit_group` turns the hooks off and starts the D2H copies of everything the group holds.

# %%
class _ChunkPack:
    """Forward-side methods of ChunkOffloadHandler: open a group, pack into it, close the hooks."""

    def __init__(self, manager, last_layer: int, keep_last_layer: bool,
                 min_size: int):
        self.manager, self.last_layer, self.keep_last_layer = manager, last_layer, keep_last_layer
        self.min_size, self.groups, self.open = min_size, [], None
        self._hooks = None
        self.backward_started = False

    def start_group(self, name: str, layer: int) -> OffloadGroup:
        """Open a group; saved tensors go into it until commit_group."""
        assert self.open is None, f"group {self.open.name} is still open"
        self.open = OffloadGroup(name, layer, len(self.groups))
        self.groups.append(self.open)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self.open

    def pack(self, t: torch.Tensor):
        """A tag for a tensor worth moving; small tensors and parameters pass through."""
        if t.numel() < self.min_size or _is_parameter_data(t):
            return t
        group, key = self.open, _identity(t)
        if key not in group.seen:
            group.seen[key] = len(group.slots)
            group.slots.append(t.detach())
            group.uses.append(0)
        slot = group.seen[key]
        group.uses[slot] += 1
        return _Tag(group, slot)

    def close_hooks(self) -> None:
        """Turn the pack hooks off (the module's forward is over, or failed)."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None


# %% [markdown]
# The commit: the hooks off, then each slot copied into a pooled host buffer in its memory
# order, on the D2H stream, with one event for the whole group. The margin layer is skipped.

# %%
class _ChunkForward(_ChunkPack):
    """Forward-side methods of ChunkOffloadHandler (open, pack, commit)."""

    def commit_group(self, group: OffloadGroup) -> None:
        """Close the group and copy its tensors to host buffers on the D2H stream."""
        self.close_hooks()
        self.open, group.seen = None, {}
        if self.keep_last_layer and group.layer == self.last_layer:
            return  # the offload margin: its backward comes next, nothing could prefetch it
        streams, pool = self.manager.streams, self.manager.pool
        streams.follow_compute(streams.d2h)
        with streams.on(streams.d2h):
            for i, t in enumerate(group.slots):
                order = _memory_order(t)
                buffer = pool.take([t.shape[d] for d in order], t.dtype)
                _to_host(buffer, t)
                if streams.cuda:
                    t.record_stream(streams.d2h)  # keep the memory until the copy is done
                group.slots[i] = _HostRecord(buffer, t.shape, t.dtype, t.device, order)
                group.offloaded_bytes += t.numel() * t.element_size()
            group.offload_event = streams.record(streams.d2h)
        group.offloaded = bool(group.slots)
        self.manager.count(group)

# %% [markdown]
# The backward side. `reload_group` starts the H2D copies of one group (after its offload
# event); `wait_group` makes the compute stream wait for them; `unpack` hands a slot's tensor to
# autograd, reloading on the spot if nothing prefetched it (correct, only not overlapped).
# `prefetch_before(group)` runs at the start marker: reload every group of the
# previous layer, and when this chunk is done, the last layer of the next chunk.

# %%
class _ChunkCopyBack(_ChunkForward):
    """Backward-side methods of ChunkOffloadHandler: reload a group, wait for it."""

    def reload_group(self, group: OffloadGroup) -> None:
        """Start copying an offloaded group back to the device on the H2D stream."""
        if not group.offloaded or group.reloaded:
            return
        streams, pool = self.manager.streams, self.manager.pool
        streams.follow_compute(streams.h2d)
        with streams.on(streams.h2d):
            streams.wait(group.offload_event, streams.h2d)
            records = group.slots
            group.slots = [_to_device(r.buffer, r.shape, r.dtype, r.device, r.order)
                           for r in records]
            group.reload_event = streams.record(streams.h2d)
        for r in records:
            pool.give_back(r.buffer, [r.shape[d] for d in r.order], r.dtype, group.reload_event)
        group.reloaded = True

    def wait_group(self, group: OffloadGroup) -> None:
        """Before the group's backward: make sure its tensors are back and the copies done."""
        if not self.backward_started:
            self.backward_started = True
            self.manager.backward_began(self)
        self.reload_group(group)
        if group.reload_event is not None:
            self.manager.streams.wait(group.reload_event)
            for t in group.slots:
                if isinstance(t, torch.Tensor):
                    t.record_stream(torch.cuda.current_stream())
            group.reload_event = None


# %% [markdown]
# The unpack hook, autograd's side of a tag: the slot's tensor, reloaded first if it is still
# on the host, and dropped after its last use.

# %%
class _ChunkReload(_ChunkCopyBack):
    """Backward-side methods of ChunkOffloadHandler: reload, wait, unpack."""

    def unpack(self, packed):
        """The saved tensor for autograd; a tag's slot is released after its last use."""
        if not isinstance(packed, _Tag):
            return packed
        group = packed.group
        if group.offloaded and not group.reloaded:
            self.reload_group(group)  # nobody prefetched it: reload now
        if group.reload_event is not None:
            self.wait_group(group)
        t = group.slots[packed.slot]
        group.uses[packed.slot] -= 1
        if group.uses[packed.slot] == 0:
            group.slots[packed.slot] = None
        return t


# %% [markdown]
# What to reload ahead of time: the groups of the layer below, and, when the chunk is done,
# the next chunk's last layer.

# %%
class ChunkOffloadHandler(_ChunkReload):
    """The offload groups of one micro-batch's forward through one model chunk."""

    def prefetch_before(self, group: OffloadGroup) -> None:
        """After a group's backward: reload the previous layer, or the next chunk's last layer."""
        for g in self.groups[:group.index]:
            if g.layer >= group.layer - 1:
                self.reload_group(g)
        if group.index == 0:
            self.manager.prefetch_next_chunk(self)

    def reload_layer(self, layer: int) -> None:
        """Start reloading every group of one layer (used to pre-load a chunk's last layer)."""
        for g in self.groups:
            if g.layer == layer:
                self.reload_group(g)


# %% [markdown]
# The two markers. The start marker hooks the region's input: its gradient is complete once
# the region's backward is done. The commit marker offloads now and hooks the region's output:
# its gradient arrives just before the region's backward begins.

# %%
def _mark_start(x: torch.Tensor, handler: ChunkOffloadHandler, group: OffloadGroup) -> None:
    """After the group's backward: prefetch what comes next."""
    if x.requires_grad:
        x.register_hook(lambda grad: handler.prefetch_before(group))


def _mark_commit(out: torch.Tensor, handler: ChunkOffloadHandler, group: OffloadGroup) -> None:
    """Offload the group now; before its backward, wait for its reload."""
    handler.commit_group(group)
    if out.requires_grad:
        out.register_hook(lambda grad: handler.wait_group(group))

# %% [markdown]
# ## The manager
#
# One per rank and device. It owns the streams and the pool, creates a chunk handler at the
# start of every training forward of a model chunk, and queues finished chunks in the order
# their backwards will run — first in, first out, as in the 1F1B and no-pipelining schedules
# (an interleaved schedule only loses the cross-chunk prefetch when the guess is wrong).
#
# First the queue's bookkeeping: a chunk leaves it when its backward starts, the next one's
# last layer is reloaded when a backward ends, and each committed group's bytes are counted.

# %%
class _ChunkQueue:
    """Mixin for OffloadManager: the queue of chunks waiting for their backward, and the counts."""

    def backward_began(self, handler: ChunkOffloadHandler) -> None:
        """A chunk's backward has started: it leaves the queue."""
        if handler in self.waiting:
            self.waiting.remove(handler)

    def prefetch_next_chunk(self, handler: ChunkOffloadHandler) -> None:
        """A chunk's backward is done: start reloading the next chunk's last layer."""
        self.backward_began(handler)
        if self.waiting:
            nxt = self.waiting[0]
            nxt.reload_layer(nxt.last_layer)

    def count(self, group: OffloadGroup) -> None:
        """Add a committed group's bytes to the per-module summary."""
        self.offloaded_bytes[group.name] = self.offloaded_bytes.get(group.name, 0) + group.offloaded_bytes


# %% [markdown]
# The manager itself: a handler opened at each training forward of a chunk, queued at its end.

# %%
class OffloadManager(_ChunkQueue):
    """Side streams, the host pool, and the chunk handlers of one rank."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.streams = _Streams(self.device)
        self.pool = HostBufferPool(pinned=self.streams.cuda)
        self.current: ChunkOffloadHandler | None = None
        self.last: ChunkOffloadHandler | None = None  # the latest chunk, for inspection
        self.waiting: deque[ChunkOffloadHandler] = deque()
        self.offloaded_bytes: dict[str, int] = {}

    def begin_chunk(self, model) -> None:
        """A training forward of `model` starts: open a handler (none in eval / no-grad)."""
        if not (model.training and torch.is_grad_enabled()) or not len(model.decoder.layers):
            self.current = None
            return
        c = model.config
        self.current = ChunkOffloadHandler(self, model.decoder.layers[-1].layer_number,
                                           keep_last_layer=model.post_process,
                                           min_size=c.min_offloaded_tensor_size)

    def end_chunk(self) -> None:
        """The forward is over: queue the handler for its backward."""
        if self.current is not None:
            self.current.close_hooks()
            self.waiting.append(self.current)
            self.last = self.current
        self.current = None

# %% [markdown]
# ## Installing the groups on a model
#
# The model (appendix B) knows nothing of offload. The groups attach from outside: a forward
# pre-hook on each chosen module opens the group and marks the module's input; a forward
# hook (`always_call`, so a failing forward still closes the pack hooks) commits the group and
# marks the output. Core attention is not a module of its own; it goes
# through `SelfAttention.attend_wrapper`, the same hook selective recompute uses (page 2),
# composed so that offload is the outer layer: under selective recompute the tensors it moves
# are the checkpoint's saved inputs. A pre-/post-hook pair on the whole model opens and queues
# the chunk handler.

# %%
def offload_group_modules(layer) -> dict:
    """Megatron's offload names -> the module of this layer they cover (core_attn: none)."""
    attn = layer.self_attention
    return {"attn_norm": layer.input_layernorm, "qkv_linear": attn.linear_qkv,
            "attn_proj": attn.linear_proj, "mlp_norm": layer.pre_mlp_layernorm}


def _hook_module(module, name: str, layer_number: int, manager: OffloadManager) -> None:
    """Bracket one module's forward by a group start and a group commit."""
    state = {}

    def before(_module, args):
        handler = manager.current
        if handler is None:
            return None
        group = handler.start_group(name, layer_number)
        state["handler"], state["group"] = handler, group
        _mark_start(args[0], handler, group)
        return None

    def after(_module, args, output):
        handler, group = state.pop("handler", None), state.pop("group", None)
        if handler is None:
            return None
        if output is None:  # the forward raised: just turn the hooks off
            handler.close_hooks()
            handler.open = None
            return None
        _mark_commit(output, handler, group)
        return None

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)


# %% [markdown]
# Core attention has no module to hook, so its group wraps `attend_wrapper` instead, with the
# same start and commit marks and the same care to close the pack hooks if the forward raises.
# `install_offload` then puts the pieces on every layer, and the chunk brackets on the model.

# %%
def _offload_attend(manager: OffloadManager, layer_number: int, inner=None):
    """An attend_wrapper that makes core attention one offload group (around `inner`, if any)."""
    def wrapper(attend, q, k, v, attention_mask):
        run = attend if inner is None else (lambda *a: inner(attend, *a))
        handler = manager.current
        if handler is None:
            return run(q, k, v, attention_mask)
        group = handler.start_group("core_attn", layer_number)
        _mark_start(q, handler, group)
        try:
            out = run(q, k, v, attention_mask)
        except BaseException:
            handler.close_hooks()
            handler.open = None
            raise
        _mark_commit(out, handler, group)
        return out
    return wrapper


def install_offload(model, manager: OffloadManager) -> None:
    """Attach the offload groups named by model.config.offload_modules to every layer."""
    names = model.config.offload_modules
    for layer in model.decoder.layers:
        modules = offload_group_modules(layer)
        for name in names:
            if name == "core_attn":
                attn = layer.self_attention
                attn.attend_wrapper = _offload_attend(manager, layer.layer_number,
                                                      attn.attend_wrapper)
            else:
                _hook_module(modules[name], name, layer.layer_number, manager)
    model.register_forward_pre_hook(lambda m, args, kwargs: manager.begin_chunk(m),
                                    with_kwargs=True)
    model.register_forward_hook(lambda m, args, out: manager.end_chunk(), always_call=True)

# %% [markdown]
# ## What the overlap needs
#
# A copy is free only while compute runs beside it. The offload of layer $i$ has layer $i$'s
# forward (and the next layers') to hide behind, the reload has the backward, about twice as
# long; the forward is the tighter side. So the link must carry a layer's offloaded bytes
# within one layer's forward, per direction:
#
# $$B_{\text{needed}} = \frac{\text{offloaded bytes of one layer}}{t_{\text{fwd}}},\qquad
#   t_{\text{fwd}} = \frac{b\,s\,(2P_{\text{layer}} + 4sh)/t}{\text{MFU}\cdot\text{peak}}$$
#
# with $P_{\text{layer}}$ the layer's weights (two FLOPs per weight per token, plus $QK^\top$ and
# $AV$ over the full $s \times s$ scores). The bytes per region are what the GPU kernels save,
# in bf16, on one rank with TP $t$ and sequence parallelism: a fused norm keeps its input and
# the fp32 reciprocal RMS, `qkv_linear` its input shard, flash attention $q, k, v$, its output
# and the fp32 log-sum-exp — and that output *is* `attn_proj`'s input, moved once for both.
# (The CPU demo below saves more: an unfused norm, math attention.) The running example (TP 2,
# $b = 2$, $s = 4096$) gives what the cell prints: the five regions move 176 MiB per layer and
# micro-batch, the layer's forward takes 5.2 ms at 40% MFU of 989 TFLOP/s (H100 bf16 dense),
# so the overlap needs 36 GB/s per direction. PCIe Gen5 x16 carries 63 GB/s per direction on
# paper (32 GT/s × 16 lanes, 128b/130b coding), before protocol overhead: the five regions fit
# with little room — at 60% MFU they need 53 GB/s, 85% of the paper figure. A dense MLP's
# internals (not in Megatron's list) would add 336 MiB per layer: no PCIe link hides that.
# These are computed figures, not measurements. Chapter 07's
# [offload page](../07_memory/step_offload.py) asks the same question of tinytron's own model,
# with the layer's forward timed kernel by kernel by appendix C's law (3.5 ms, not 5.2): the
# same 176 MiB per layer and micro-batch for the five modules, of which four (144 MiB) fit
# behind the forward at 50 GB/s. Which answer holds depends on the kernels a run uses.

# %%
PCIE_GEN5_X16 = 32e9 * 16 * 128 / 130 / 8   # bytes/s per direction, on paper


def overlap_bandwidth(config, tp: int, micro_batch_size: int, mfu: float = 0.4,
                      peak_flops: float = 989e12, dtype_bytes: int = 2) -> dict:
    """Per offload region: bytes per layer and micro-batch on one rank, and the bandwidth
    (bytes/s per direction) that hides them behind one layer's forward."""
    s, b, h, a = config.seq_length, micro_batch_size, config.hidden_size, config.num_attention_heads
    kv = config.num_query_groups * (h // a)
    f = config.ffn_hidden_size
    row = s * b * dtype_bytes // tp            # one [s/t, b, 1] column of bf16, per rank
    rstd, lse = s * b * 4 // tp, s * b * (a // tp) * 4   # fp32 [s/t, b] and [b, a/t, s]
    regions = {"attn_norm": row * h + rstd, "qkv_linear": row * h,
               "core_attn": row * (h + 2 * kv) + row * h + lse,   # q, k, v; output; lse
               "attn_proj": 0,                                  # core attention's output
               "mlp_norm": row * h + rstd}
    layer_weights = h * (h + 2 * kv) + h * h + 3 * h * f
    t_fwd = b * s * (2 * layer_weights + 4 * s * h) / tp / (mfu * peak_flops)
    total = sum(regions.values())
    return {"regions": regions, "t_fwd": t_fwd, "total": total, "needed": total / t_fwd,
            "mlp_internals": row * 3 * f}


if __name__ == "__main__":
    from tinytron.model.config import llama_7b_config

    for mfu in (0.4, 0.6):
        o = overlap_bandwidth(llama_7b_config(), tp=2, micro_batch_size=2, mfu=mfu)
        print(f"MFU {mfu:.0%}: layer forward {o['t_fwd'] * 1e3:.1f} ms; regions (MiB) "
              f"{ {k: v // 2**20 for k, v in o['regions'].items()} }; total "
              f"{o['total'] // 2**20} MiB -> {o['needed'] / 1e9:.0f} GB/s per direction "
              f"({o['needed'] / PCIE_GEN5_X16:.0%} of PCIe Gen5 x16's "
              f"{PCIE_GEN5_X16 / 1e9:.0f} GB/s); a dense MLP's internals would add "
              f"{o['mlp_internals'] // 2**20} MiB")
    o = overlap_bandwidth(llama_7b_config(), tp=2, micro_batch_size=2)
    assert o["total"] // 2**20 == 176 and round(o["t_fwd"] * 1e3, 1) == 5.2
    assert o["needed"] < PCIE_GEN5_X16 < o["needed"] + o["mlp_internals"] / o["t_fwd"]

# %% [markdown]
# ## Demo: what moves, what stays, and the device's live bytes
#
# The 4-layer tiny model (dropout 0.1, fp32) runs one training micro-batch with all five
# regions offloaded (`min_offloaded_tensor_size = 1024` elements, so the tiny tensors qualify)
# and once without, under chapter 01's meter with its timeline on. The claims: the loss and
# every gradient are bitwise the same; the bytes held after the forward drop by exactly what
# went to host memory; the reciprocal RMS vectors (128 elements) and the last layer (the margin)
# stayed; a second micro-batch reuses every host buffer of the first.

# %%
def _offload_run(config, steps: int = 1):
    """Loss, grads, the meter's timeline and the manager after `steps` micro-batches."""
    from tinytron.main_loop.memory_meter import LiveBytesMeter
    from tinytron.model.gpt import GPTModel
    from tinytron.parallel import ParallelGrid
    from tinytron.parallel.rng import model_parallel_seed
    from tinytron.recompute.recompute import apply_recompute

    model_parallel_seed(1234, ParallelGrid.single())
    model = GPTModel(config)
    manager = apply_recompute(model)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length),
                           generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        with LiveBytesMeter() as meter:
            meter.track(model.parameters())
            base = meter.mark("start")
            loss = model(tokens, labels=tokens).mean()
            held = meter.mark("forward done") - base
            loss.backward()
    timeline = [(live - base) for _, live, _ in meter.timeline]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, held, timeline, manager


# %% [markdown]
# The demo runs both configurations for two micro-batches each, prints what moved, plots the
# two timelines of live bytes (the drawing is in the chapter's `_plot.py`), and asserts the
# claims above. What to read in the picture: where the forward ends, the gap between the two
# curves is exactly the bytes that went to host memory (the first assert on `held` below);
# in the backward the reloaded groups come back one at a time, so the offload curve never
# climbs back to the other's height.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.model.config import tiny_config
    from tinytron.recompute._plot import plot_live_bytes

    torch.set_num_threads(1)
    plain = tiny_config(num_layers=4, dropout=0.1)
    moved = plain.replace(fine_grained_activation_offloading=True, min_offloaded_tensor_size=1024,
                          offload_modules=["attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                           "mlp_norm"])
    loss0, grads0, held0, line0, _ = _offload_run(plain, steps=2)
    loss1, grads1, held1, line1, manager = _offload_run(moved, steps=2)
    to_host = sum(manager.offloaded_bytes.values()) // 2  # two micro-batches were counted
    print("bytes moved to host per micro-batch, by region:",
          {k: v // 2 for k, v in manager.offloaded_bytes.items()})
    print(f"held after forward: {held0:,} without offload, {held1:,} with "
          f"(difference {held0 - held1:,}, moved {to_host:,})")
    print(f"host buffers allocated: {manager.pool.num_allocated} "
          f"({manager.pool.bytes_allocated:,} bytes) for two micro-batches")

    plot_live_bytes({"no offload": line0, "offload, 5 regions": line1})  # _plot.py
    plt.show()

    assert torch.equal(loss0, loss1)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    assert held0 - held1 == to_host > 0
    assert manager.pool.bytes_allocated == to_host, "the second micro-batch reused every buffer"
    groups = manager.last.groups
    assert all(g.offloaded == (g.layer != 3) for g in groups), "only the margin layer stayed"
    # the norm keeps its input and one fp32 1/rms a row: only the input is large enough to move
    assert all(len(g.slots) == 1 for g in groups if g.name == "attn_norm"), "1/rms stayed"

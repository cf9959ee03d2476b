# %% [markdown]
# # 07.12 · Memory: the step in time — offload, module by module
#
# [07.10](step_compute.py) timed a layer's compute and [07.11](step_overlap.py) gave four
# transfers their windows by Megatron's rules. This page adds the fifth, activation offload:
# chapter 06 copies what chosen modules save to host memory and brings it back for the
# backward, and those copies cost nothing only while one layer's copies fit in one layer's
# compute. The page finds, module by module, which of chapter 06's regions hide on a given
# PCIe link; [07.13](step_time.py) then adds what the chosen set leaves exposed to the step.
#
# You will build: `layer_seconds`, `offload_table`, `best_offload_modules` and
# `offload_exposed`.

# %%
from __future__ import annotations

import itertools

from tinytron.main_loop.training_log import flops_terms
from tinytron.memory.activations import _offloaded, layer_saved
from tinytron.memory.states import MemoryConfig
from tinytron.memory.step_compute import Links, stage_kernel_seconds

__all__ = ["OFFLOAD_MODULES", "layer_seconds", "offload_table", "best_offload_modules",
           "offload_exposed"]

# %% [markdown]
# ## Why a layer's compute is the window
#
# Offload trades device memory for PCIe traffic. The ledger (07.5) counts what it saves;
# whether it also costs time depends on a race. Each layer's copies leave right after its
# forward and must be off the link before the next layer's copies arrive; in the backward
# they must be back before the layer that needs them runs. So what one layer moves has one
# layer's forward to go out in and one layer's backward to come back in. A copy that is late
# is late again at the next layer: the delay piles up, layer after layer and micro-batch
# after micro-batch.
#
# Worked, in small numbers: a layer whose forward takes 4 ms (its backward 8 ms) saves 40,
# 40 and 60 MB in three offloadable modules. At 50 GB/s, 50 MB a millisecond, over a stage
# of 16 layers and 8 micro-batches:
#
# | link, modules | one layer's copies | forward window | exposed per layer | per step |
# |---|---|---|---|---|
# | 50 GB/s, all three (140 MB) | 2.8 ms | 4 ms | 0 | 0 |
# | 25 GB/s, all three | 5.6 ms | 4 ms | 1.6 ms | 1.6 ms · 16 · 8 = 204.8 ms |
# | 25 GB/s, the two of 40 MB | 3.2 ms | 4 ms | 0 | 0 |
#
# The backward's 8 ms hold all three even at 25 GB/s: the copy out binds. Halving the link
# does not halve what can move for free; it decides which modules can.

# %% [markdown]
# ## Rule 5: offload, module by module, against one layer's compute
#
# Chapter 06 moves the activations a module saves to host memory right after the module's
# forward, on a side stream, and brings them back one layer ahead in the backward
# (`megatron/core/pipeline_parallel/fine_grained_activation_offload.py`; the modules are
# `attn_norm`, `qkv_linear`, `core_attn`, `attn_proj`, `mlp_norm`,
# `megatron/core/transformer/transformer_config.py:1127-1146`). All copies of a layer share
# one PCIe direction, and the next layer produces its own copies, so in steady state the
# copies of one layer must fit in one layer's forward (device to host) and one layer's
# backward (host to device); what does not fit is exposed. The bytes come from 07.3's
# `layer_saved` with chapter 06's rule of what moves (`_offloaded`: tensors of at least
# `min_offloaded_tensor_size` elements, the attention output once for `core_attn` and once
# for `attn_proj`).
# Prefetching one layer ahead means the copy back of layer $i-1$ overlaps the backward of
# layer $i$: the window is one layer's backward, twice its forward plus recomputation, so
# for the same bytes the forward (copy out) is always the binding window.
# Not modeled: on many servers a GPU's PCIe link is shared with its NIC (GPUDirect RDMA
# crosses the same switch), so offload's copies and the DP traffic compete; the stated 50
# GB/s is then an upper bound.

# %%
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")


def _offloaded_bytes(cfg: MemoryConfig, modules: tuple[str, ...]) -> int:
    """Bytes per layer and micro-batch that offloading `modules` copies each way."""
    if not modules:
        return 0
    model = cfg.model.replace(fine_grained_activation_offloading=True,
                              offload_modules=list(modules))
    sized = cfg.replace(model=model)
    return sum(e.nbytes for e in _offloaded(sized, layer_saved(sized))[1])


def layer_seconds(cfg: MemoryConfig, links: Links = Links()) -> tuple[float, float]:
    """(forward, backward) seconds of one layer and micro-batch on one rank."""
    if links.law is not None:  # a stage without the logits, divided by its layers
        per = cfg.model.num_layers // cfg.pipeline_model_parallel_size
        return tuple(x / per for x in stage_kernel_seconds(cfg, -1, links.law))
    terms = flops_terms(cfg.model, cfg.micro_batch_size, recompute=cfg.recompute_granularity)
    layers = sum(v for k, v in terms.items() if k not in ("logits", "recompute"))
    per = cfg.model.num_layers * cfg.tensor_model_parallel_size * cfg.context_parallel_size
    return (layers / 3 / per / links.flops,
            (layers * 2 / 3 + terms["recompute"]) / per / links.flops)

# %% [markdown]
# `offload_table` puts each module alone against the layer's compute, and
# `best_offload_modules` searches every valid set (`attn_proj` needs `core_attn`, as
# chapter 06 checks) for the one that moves the most bytes and still hides in both
# directions — the default this page suggests for `offload_modules` on a GPU.

# %%
def _module_bytes(cfg: MemoryConfig, name: str) -> int:
    """Bytes one module's offload adds (attn_proj counted on top of core_attn)."""
    if name == "attn_proj":
        return (_offloaded_bytes(cfg, ("core_attn", "attn_proj"))
                - _offloaded_bytes(cfg, ("core_attn",)))
    return _offloaded_bytes(cfg, (name,))


def offload_table(cfg: MemoryConfig, links: Links = Links()) -> list[dict]:
    """Per module (and all five): bytes per layer, copy seconds, the windows, whether it hides."""
    forward, backward = layer_seconds(cfg, links)
    rows = [(name, _module_bytes(cfg, name)) for name in OFFLOAD_MODULES]
    rows.append(("all five", _offloaded_bytes(cfg, OFFLOAD_MODULES)))
    out = []
    for name, nbytes in rows:
        copy = links.latency + nbytes / links.pcie if nbytes else 0.0
        out.append({"module": name, "bytes": nbytes, "copy": copy, "forward": forward,
                    "backward": backward, "hides": copy <= forward and copy <= backward})
    return out

# %% [markdown]
# The search over module sets, and the exposed time of whatever set a run configures: per
# layer, what the copy out exceeds the forward by plus what the copy back exceeds the
# backward by, for every offloaded layer and micro-batch. The step (07.13) adds that as one
# more item.

# %%
def best_offload_modules(cfg: MemoryConfig, links: Links = Links()) -> list[str]:
    """The valid module set with the most bytes whose copies hide in one layer's compute."""
    forward, backward = layer_seconds(cfg, links)
    best, best_bytes = [], 0
    for n in range(1, len(OFFLOAD_MODULES) + 1):
        for combo in itertools.combinations(OFFLOAD_MODULES, n):
            if "attn_proj" in combo and "core_attn" not in combo:
                continue
            nbytes = _offloaded_bytes(cfg, combo)
            copy = links.latency + nbytes / links.pcie
            if copy <= min(forward, backward) and nbytes > best_bytes:
                best, best_bytes = list(combo), nbytes
    return best


def offload_exposed(cfg: MemoryConfig, links: Links, layers: int) -> float:
    """Exposed seconds of the configured offload over one step of a stage with `layers` layers."""
    if not cfg.model.fine_grained_activation_offloading:
        return 0.0
    forward, backward = layer_seconds(cfg, links)
    copy = links.latency + _offloaded_bytes(cfg, tuple(cfg.model.offload_modules)) / links.pcie
    per_layer = max(0.0, copy - forward) + max(0.0, copy - backward)
    return per_layer * layers * cfg.num_microbatches

# %% [markdown]
# ## Demo: chapter 06's regions on the running example
#
# Which of chapter 06's regions can move to the host without slowing the step? For the
# running example and PCIe Gen5 at 50 GB/s, per layer and micro-batch on one rank: each
# module's bytes, its copy time, and the two windows (a layer's forward for the copy out, its
# backward for the copy back). The backward is twice the forward plus the recomputation, so
# the forward is the binding window. Every module fits alone; all five do not; the best set
# that fits moves `attn_norm`, `qkv_linear`, `core_attn` and `attn_proj`: 144 MiB in 3.0 ms
# of a 3.5 ms forward. At PCIe Gen4 (25 GB/s) only the smaller sets fit, so the same search
# gives a smaller default.

# %%
if __name__ == "__main__":
    from dataclasses import replace

    from tinytron.memory.megatron_gap import running_example

    example, links = running_example(), Links()
    fitted = best_offload_modules(example, links)
    print(f"{'module':<12}{'MiB/layer':>10}{'copy':>9}{'forward':>9}{'backward':>10}  hides")
    for row in offload_table(example, links):
        print(f"{row['module']:<12}{row['bytes'] / 2**20:>10.1f}{row['copy'] * 1e3:>7.2f}ms"
              f"{row['forward'] * 1e3:>7.2f}ms{row['backward'] * 1e3:>8.2f}ms  {row['hides']}")
    gen4 = best_offload_modules(example, replace(links, pcie=25e9))
    print("fits at 50 GB/s:", fitted, " at 25 GB/s:", gen4)
    assert fitted == ["attn_norm", "qkv_linear", "core_attn", "attn_proj"]
    assert [_offloaded_bytes(example, m) // 2**20 for m in (tuple(fitted), OFFLOAD_MODULES)] \
        == [144, 176]  # MiB per layer and micro-batch, as this page and chapter 06 quote
    assert all(r["hides"] for r in offload_table(example, links)[:5])
    assert _offloaded_bytes(example, tuple(gen4)) < _offloaded_bytes(example, tuple(fitted))
    layers = example.model.num_layers // example.pipeline_model_parallel_size
    drawn = example.replace(model=example.model.replace(
        fine_grained_activation_offloading=True, offload_modules=fitted))
    assert offload_exposed(drawn, links, layers) == 0.0
    too_much = example.replace(model=example.model.replace(
        fine_grained_activation_offloading=True, offload_modules=list(OFFLOAD_MODULES)))
    too_much_exposed = offload_exposed(too_much, links, layers)
    print(f"all five exposed: {too_much_exposed * 1e3:.1f} ms per step")
    assert too_much_exposed > 0

# %% [markdown]
# The same table at three links: each module's copy (and all five's) against the forward it
# must fit in, at PCIe Gen4, Gen5 and twice Gen5.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 2.8))
    names = [r["module"] for r in offload_table(example, links)]
    for i, (gbs, color) in enumerate(((25, "tab:red"), (50, "tab:blue"), (100, "tab:green"))):
        rows = offload_table(example, replace(links, pcie=gbs * 1e9))
        ax.bar([x + 0.27 * (i - 1) for x in range(len(rows))],
               [r["copy"] * 1e3 for r in rows], 0.27, color=color, label=f"{gbs} GB/s")
    forward = layer_seconds(example, links)[0] * 1e3
    ax.axhline(forward, color="k", ls="--", lw=1, label=f"one layer's forward, {forward:.2f} ms")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set(ylabel="copy of one layer, ms")
    ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()
    gen5_all = offload_table(example, links)[-1]
    assert gen5_all["copy"] > forward / 1e3 > max(r["copy"] for r in offload_table(example, links)[:5])

# %% [markdown]
# *Figure:* every module alone hides at any of the three links; the bar that crosses the
# dashed line is all five together, at 25 and 50 GB/s. What fits is a sum of bars, which is
# why the search tries sets, not modules.
#
# So on an H100 node the suggested `offload_modules` default is
# `["attn_norm", "qkv_linear", "core_attn", "attn_proj"]` — what the model says hides behind
# compute — and offload stays off unless memory asks for it. Offloading all five (176 MiB a
# layer) needs 3.7 ms of copy in a 3.5 ms forward: the demo prints what that exposes per
# step (19 ms here), a small price, but one the four-module set does not pay.
#
# The same search answers for any layout and link: a longer sequence makes a layer's
# compute grow faster than its saved bytes (attention is quadratic in the sequence, the
# saved tensors linear), so more modules fit; a larger TP divides both by the same factor
# and changes nothing; a slower link — PCIe Gen4 — leaves `attn_norm` and `core_attn`
# (80 MiB; `qkv_linear` in place of `attn_norm` moves the same bytes).
# Chapter 06 keeps `offload_modules` empty by default, as Megatron does; when a run turns
# offload on for a GPU, this set is the one that costs no time.

# %% [markdown]
# ## Summary
#
# - Offload hides when one layer's copies fit in one layer's forward (copy out) and backward
#   (copy back); the forward binds, and what does not fit is paid at every layer of every
#   micro-batch.
# - On a 50 GB/s PCIe link `attn_norm`, `qkv_linear`, `core_attn` and `attn_proj` hide for
#   the running example; all five modules need a little more, and at 25 GB/s two fit.
# - `offload_exposed` is rule 5's item; [07.13](step_time.py) adds it to the step.
#
# ## How production does it
#
# Megatron-LM offloads with
# `megatron/core/pipeline_parallel/fine_grained_activation_offload.py` (the modules are
# listed in `megatron/core/transformer/transformer_config.py:1127-1146`) and leaves the
# choice of modules to the user: it has no model of the copies' time. Chapter 06's
# [offload page](../06_recompute_offload/offload.py) runs the same copies on this machine.
#
# ## Exercises
#
# 1. Replace `Links.pcie` by 25 GB/s (PCIe Gen4) and then 100 GB/s: what does
#    `best_offload_modules` return, and what does the ledger (07.5) say each choice saves?
#
#    <details><summary>Answer</summary>
#
#    At 25 GB/s `attn_norm` and `core_attn` (80 MiB a
#    layer); at 50 GB/s the four of the demo (144 MiB); at 100 GB/s all five (176 MiB). On
#    stage 0 the ledger's peak activations go from 22.01 GiB to 18.26, 16.26 and 15.26 GiB:
#    3.75, 5.75 and 6.75 GiB saved.
#
#    </details>
#
# 2. Offload all five modules at 25 GB/s: what does `offload_exposed` charge a step of
#    stage 0?
#
#    <details><summary>Answer</summary>
#
#    The 176 MiB take 7.38 ms each way against a 3.54 ms forward and a 7.34 ms backward:
#    3.84 ms plus 0.05 ms exposed per layer, times 16 layers and 8 micro-batches, 497 ms a
#    step — a quarter of the running example's 1.94 s, against 19 ms at 50 GB/s.
#
#    </details>
#
# 3. Double the sequence to 8,192 tokens and halve the micro-batch to 1 (the same tokens per
#    micro-batch). Which set fits at 50 GB/s, and why?
#
#    <details><summary>Answer</summary>
#
#    All five. The saved bytes are linear in the tokens, so they stay 176 MiB (3.69 ms of
#    copy); attention's compute is quadratic in the sequence, so a layer's forward grows from
#    3.54 to 3.85 ms and the five fit. At 25 GB/s still only `attn_norm` and `core_attn`.
#
#    </details>

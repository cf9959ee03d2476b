# %% [markdown]
# # 06 · Recompute (4/4): activation memory, counted and measured
#
# How many bytes does one transformer layer keep for its backward, and how many does each
# mode of pages 1–3 leave? This page writes the count for this book's model tensor by tensor,
# measures the same thing with chapter 01's live-bytes meter, and checks that the two agree.
# Then it applies the count to the running example at TP 2 with sequence parallelism.
# (Chapter 07 builds the whole-model memory model on top of this per-layer count.)
#
# You will build: `layer_activation_terms`, `layer_activation_bytes`,
# `decoder_activation_bytes` and `measure_activation_bytes`.

# %%
from __future__ import annotations

import torch

from tinytron.main_loop.memory_meter import LiveBytesMeter

__all__ = ["layer_activation_terms", "layer_activation_bytes", "decoder_activation_bytes",
           "rng_snapshot_bytes", "measure_activation_bytes"]

# %% [markdown]
# ## What one layer saves, tensor by tensor
#
# Notation: sequence $s$, micro-batch $b$, hidden $h$, heads $a$, key/value groups $g$, head
# size $d = h/a$, MLP width $f$, TP size $t$; $s' = s/t$ under sequence parallelism ($s$
# otherwise); $e$ bytes per activation element (2 for bf16), $m$ bytes per dropout-mask element
# (1 on CUDA, whose fused dropout keeps a bool mask; $e$ on CPU, whose dropout multiplies by a
# mask of the activation's dtype). Attention is the materialized kind (softmax probabilities
# stored, as in Megatron's unfused path and the memory formula below); dropout is on.
#
# | region (offload name) | saved tensor | elements | bytes each |
# |---|---|---|---|
# | `attn_norm` | its input, as Megatron's fused norm keeps it | $s' b h$ | $e$ |
# | | reciprocal RMS (fp32, one per row) | $s' b$ | 4 |
# | `qkv_linear` | its input, this rank's slice under SP (gathered again in backward) | $s' b h$ | $e$ |
# | `core_attn` | $q$, $k$, $v$ (scaled, GQA-expanded to $a$ heads) | $3 s b h / t$ | $e$ |
# | | softmax probabilities, dropped probabilities | $2 a s^2 b / t$ | $e$ |
# | | dropout mask | $a s^2 b / t$ | $m$ |
# | `attn_proj` | its input (attention output) | $s b h / t$ | $e$ |
# | residual | dropout mask | $s' b h$ | $m$ |
# | `mlp_norm` | as `attn_norm` | $s' b h$, $s' b$ | $e$, 4 |
# | MLP | fc1 input ($s' b h$), fc1 output, SiLU output, fc2 input | $s' b h + 4 s b f / t$ | $e$ |
# | residual | dropout mask | $s' b h$ | $m$ |
#
# In Megatron's units — bf16, 1-byte masks, no SP, $t = 1$, $g = a$, $f = 4h$, a LayerNorm
# instead of an RMSNorm — the same walk gives Korthikanti et al.'s
# $s b h\,(34 + 5 a s / h)$ bytes per layer (their Table 2; Megatron's estimate,
# `megatron/training/theoretical_memory_usage.py:289-291`, keeps only the $34$, written
# $18 + 4 f / h$, because it assumes selective recompute; chapter 07). The norms and the SP linears keep what Megatron's keep (the
# norm its input and $1/\mathrm{rms}$, appendix B; the column-parallel linear its $s/t$ slice,
# gathered again in backward, appendix A); this model differs in the details the table
# shows: GQA's smaller $k$ and $v$ (not modelled in this table) and SwiGLU's $2f$-wide fc1
# output and SiLU output.
#
# **The modes.** Selective `core_attn` replaces the attention rows by the checkpoint's inputs:
# the RoPE'd $q$ ($s b h / t$), $k$ ($s b g d / t$) and $v$, a view that keeps the whole fused
# QKV output ($s b (a + 2g) d / t$) alive. Full recompute keeps each checkpointed run's input,
# $s' b h$ elements ($s b h / t$ with `distribute_saved_activations`). Offload removes, on the
# device, every tensor of the chosen regions with at least `min_offloaded_tensor_size`
# elements — except in the chunk's last layer on the last stage (the margin, page 3). Every
# checkpoint also keeps an RNG snapshot: one generator state per tracker stream plus the CPU
# one (5,056 bytes each for the CPU's Mersenne twister; 16 bytes of CUDA Philox state).

# %%
def layer_activation_terms(config, tp: int = 1, micro_batch_size: int = 1, *,
                           dtype_bytes: int = 2, mask_bytes: int = 1) -> dict[str, dict]:
    """(elements, bytes per element) of each tensor one layer saves without recompute, by region."""
    s, b, h, f = config.seq_length, micro_batch_size, config.hidden_size, config.ffn_hidden_size
    a, e, m = config.num_attention_heads, dtype_bytes, mask_bytes
    sl = s // tp if config.sequence_parallel else s
    dropout = config.dropout > 0

    def norm():
        return {"input": (sl * b * h, e), "reciprocal rms": (sl * b, 4)}
    core = {"q": (s * b * h // tp, e), "k": (s * b * h // tp, e), "v": (s * b * h // tp, e),
            "probabilities": (a * s * s * b // tp, e)}
    if dropout:
        core.update({"dropped probabilities": (a * s * s * b // tp, e),
                     "dropout mask": (a * s * s * b // tp, m)})
    return {
        "attn_norm": norm(),
        "qkv_linear": {"input": (sl * b * h, e)},
        "core_attn": core,
        "attn_proj": {"input": (s * b * h // tp, e)},
        "attn_residual": {"dropout mask": (sl * b * h, m)} if dropout else {},
        "mlp_norm": norm(),
        "mlp": {"fc1 input": (sl * b * h, e), "fc1 output": (2 * s * b * f // tp, e),
                "silu output": (s * b * f // tp, e), "fc2 input": (s * b * f // tp, e)},
        "mlp_residual": {"dropout mask": (sl * b * h, m)} if dropout else {},
    }


def _nbytes(terms: dict) -> int:
    """Total bytes of a {region: {name: (elements, bytes each)}} table."""
    return sum(n * size for region in terms.values() for n, size in region.values())


def rng_snapshot_bytes(num_tracker_streams: int = 3, device: str = "cpu") -> int:
    """Bytes of one checkpoint's RNG snapshot on `device` (CPU states are 5,056 bytes)."""
    if device == "cpu":
        return (num_tracker_streams + 1) * torch.get_rng_state().numel()
    return 0  # CUDA states are read into small host tensors, not device memory

# %% [markdown]
# The per-layer number under a mode, then the decoder of one pipeline chunk. Selective
# recompute is counted for `core_attn`, Megatron's default and the one that pays. (The `mlp`
# and `layernorm` options are implemented and tested for gradients; they are not in the
# measured chart because the meter counts a storage freed by `resize_(0)` at its original
# size.)

# %%
def _mode_terms(config, tp, b, e, m) -> dict:
    """The layer's table with core attention replaced by the selective checkpoint's inputs."""
    terms = layer_activation_terms(config, tp, b, dtype_bytes=e, mask_bytes=m)
    if config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules:
        s, d = config.seq_length, config.head_dim
        a, g = config.num_attention_heads, config.num_query_groups
        terms["core_attn"] = {"q": (s * b * a * d // tp, e), "k": (s * b * g * d // tp, e),
                              "qkv output (held by the v view)": (s * b * (a + 2 * g) * d // tp, e)}
    return terms


def layer_activation_bytes(config, tp: int = 1, micro_batch_size: int = 1, *,
                           dtype_bytes: int = 2, mask_bytes: int = 1,
                           snapshot_bytes: int = 0) -> int:
    """Bytes one layer keeps under the config's selective setting (or none)."""
    terms = _mode_terms(config, tp, micro_batch_size, dtype_bytes, mask_bytes)
    selective = config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
    return _nbytes(terms) + (snapshot_bytes if selective else 0)


def _offloaded_bytes(config, terms: dict) -> int:
    """Device bytes one layer frees by offload: tensors of the chosen regions above the threshold."""
    return sum(n * size for region in config.offload_modules
               for n, size in terms[region].values() if n >= config.min_offloaded_tensor_size)

# %% [markdown]
# The RoPE tables its layers share cost a chunk nothing per micro-batch: the model builds them
# once per sequence length and keeps them ([page B.4](../model/gpt.py)). Full recompute keeps, per checkpointed run, the run's input and an RNG snapshot;
# `block` adds its plain layers. Offload subtracts what the chosen regions free in every layer
# but the margin.

# %%
def decoder_activation_bytes(config, num_layers: int, tp: int = 1, micro_batch_size: int = 1, *,
                             dtype_bytes: int = 2, mask_bytes: int = 1, snapshot_bytes: int = 0,
                             post_process: bool = True) -> int:
    """Bytes the layers of one pipeline chunk keep after its forward, under the config's modes."""
    b, e, m, n = micro_batch_size, dtype_bytes, mask_bytes, num_layers
    rope = 0  # the RoPE tables are the model's cache, not per micro-batch (page B.4)
    if config.recompute_granularity == "full":
        s_local = config.seq_length // tp if config.sequence_parallel else config.seq_length
        run = s_local * b * config.hidden_size * e
        run = run // tp if config.distribute_saved_activations else run
        k = config.recompute_num_layers
        if config.recompute_method == "uniform":
            return rope + -(-n // k) * (run + snapshot_bytes)
        plain = config.replace(recompute_granularity=None, recompute_method=None,
                               recompute_num_layers=None)
        return (rope + min(k, n) * (run + snapshot_bytes)
                + max(0, n - k) * layer_activation_bytes(plain, tp, b, dtype_bytes=e, mask_bytes=m))
    total = rope + n * layer_activation_bytes(config, tp, b, dtype_bytes=e, mask_bytes=m,
                                              snapshot_bytes=snapshot_bytes)
    if config.fine_grained_activation_offloading:
        margin = 1 if post_process else 0
        total -= (n - margin) * _offloaded_bytes(config, _mode_terms(config, tp, b, e, m))
    return total

# %% [markdown]
# ## Measuring it
#
# One training forward and backward of one micro-batch under chapter 01's `LiveBytesMeter`,
# with the parameters tracked first so that they are the baseline: `held` is what the
# micro-batch keeps after its forward (what it costs while it waits for its backward — with
# pipelining, several micro-batches wait at once), `peak` the highest point of forward and
# backward together. The decoder's share is the difference from the same model with no layers
# (`layer_range=(0, 0)`: embedding, head and loss only).

# %%
def measure_activation_bytes(config, grid=None, micro_batch_size: int = 2,
                             layer_range: tuple[int, int] | None = None, seed: int = 0) -> dict:
    """Measured bytes of one micro-batch: held after forward, peak, and bytes moved to host."""
    from tinytron.model.gpt import GPTModel
    from tinytron.parallel import ParallelGrid
    from tinytron.parallel.rng import model_parallel_seed
    from tinytron.recompute.recompute import apply_recompute

    grid = grid if grid is not None else ParallelGrid.single()
    model_parallel_seed(1234, grid)
    model = GPTModel(config, grid, layer_range=layer_range)
    manager = apply_recompute(model)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (micro_batch_size, config.seq_length), generator=g)
    tokens = tokens.to(grid.device)
    with LiveBytesMeter(grid.device) as meter:
        meter.track(model.parameters())
        base = meter.current
        loss = model(tokens, labels=tokens)
        held = meter.settled() - base  # after the loss's all-reduces (see LiveBytesMeter.settled)
        loss.mean().backward()
        peak = meter.peak - base
    moved = sum(manager.offloaded_bytes.values()) if manager is not None else 0
    return {"held": held, "peak": peak, "offloaded": moved}

# %% [markdown]
# ## Demo: measured against counted, mode by mode
#
# The tiny model made wider and longer ($h = 128$, $f = 256$, $s = 128$, 4 layers, 4 heads in
# 2 groups, micro-batch 4, fp32, dropout 0.1), one micro-batch per mode. Offload moves every
# tensor of at least 1,024 elements of all five regions; "selective + offload" recomputes core
# attention and offloads `core_attn`, `attn_proj` and `mlp_norm`. For each mode: the decoder's
# bytes held after the forward (measured) next to the count above, and the peak of forward
# and backward. The claims: the count matches the meter within 3% in every mode (the gap is the
# CPU generator's state in each RNG snapshot, which torch creates outside the dispatcher the
# meter watches), the held bytes fall none > selective > full, and offload leaves on the
# device exactly what it did not move.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.recompute._workers import memory_by_mode

    torch.set_num_threads(1)
    measured = memory_by_mode(tp=1, micro_batch_size=4)
    print(f"{'mode':<22}{'decoder held':>14}{'counted':>12}{'gap':>8}{'peak':>12}{'to host':>11}")
    for name, r in measured.items():
        print(f"{name:<22}{r['decoder']:>14,}{r['predicted']:>12,}"
              f"{r['decoder'] / r['predicted'] - 1:>+8.2%}{r['peak']:>12,}{r['offloaded']:>11,}")

    names = list(measured)
    head = {n: measured[n]["held"] - measured[n]["decoder"] for n in names}  # embedding, head, loss
    fig, ax = plt.subplots(figsize=(8, 3))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [measured[n]["held"] / 2**20 for n in names], 0.4,
           label="held after forward (measured)", color="#4c72b0")
    ax.bar([x + 0.2 for x in xs], [measured[n]["peak"] / 2**20 for n in names], 0.4,
           label="peak, fwd + bwd (measured)", color="#dd8452")
    ax.scatter([x - 0.2 for x in xs], [(measured[n]["predicted"] + head[n]) / 2**20 for n in names],
               marker="_", s=400, color="black", zorder=3,
               label="layers counted (this page) + head measured")
    ax.set_xticks(list(xs), [n.replace(" ", "\n", 1) for n in names], fontsize=7)
    ax.set_ylabel("MiB"), ax.legend(fontsize=7)
    ax.set_title("one micro-batch of the 4-layer model, by mode (CPU, fp32)")
    plt.tight_layout()
    plt.show()

    for r in measured.values():
        assert abs(r["decoder"] / r["predicted"] - 1) < 0.03, r
    held = {n: r["decoder"] for n, r in measured.items()}
    assert held["full uniform k=1"] < held["selective core_attn"] < held["none"]
    peak = {n: r["peak"] for n, r in measured.items()}
    assert peak["full uniform k=1"] < peak["selective core_attn"] < peak["none"]
    assert held["none"] - held["offload"] == measured["offload"]["offloaded"]

# %% [markdown]
# Two things the chart shows that the count alone does not. Full recompute with $k = 3$ holds
# the least after the forward but has the highest peak of the full modes — higher even than
# selective: in backward it rebuilds three layers' activations at once. And offload lowers the
# peak by nearly as much as it moved (16.1 of 16.5 MB here): reloaded tensors come back one
# layer ahead of their use and leave as soon as autograd is done with them.
#
# ## The running example at TP 2 with sequence parallelism
#
# Llama-7B-like ($h = 4096$, $a = 32$, $g = 8$, $f = 14336$, $s = 4096$), micro-batch $b = 2$,
# bf16 with 1-byte masks, TP 2 with SP, PP 2: a stage holds 16 layers. Per rank and per
# micro-batch.
#
# **What this table assumes**, stated because the numbers depend on it:
#
# | | this page's 7B table | chapter 07's ledger of the running example |
# |---|---|---|
# | attention kernel | materialized: softmax probabilities stored, $a s^2 b / t$ each | flash: a log-sum-exp per row, nothing of size $s^2$ |
# | dropout | on ($p = 0.1$): a 1-byte mask per residual and attention dropout | off (the running example trains without dropout) |
# | recompute | each row of the table is one mode: none, selective `core_attn`, full, offload | the run's own setting |
#
# Why the two differ: this page is about what recompute and offload *remove*, and the case
# where they matter most is the one Megatron's memory paper counts, materialized attention
# with dropout, whose $s^2$ tensors (probabilities, dropped probabilities, dropout mask) are
# 2.50 of a layer's 3.22 GiB; with $q$, $k$, $v$ the core-attention region is 2.59.
# Chapter 07 answers another question, "does the run I am about to launch fit?", and the run
# on a GPU uses flash attention without dropout, where selective `core_attn` saves only the log-sum-exp. The same
# model therefore prints 51.5 GiB per stage here and far less in chapter 07; neither is wrong,
# they count different kernels. Exercise 1 below redoes this table under chapter 07's
# assumptions.

# %%
def running_example_table(stage_layers: int = 16, tp: int = 2, micro_batch_size: int = 2) -> dict:
    """GiB one rank's decoder keeps per micro-batch, per mode, for the book's running example."""
    from tinytron.model.config import llama_7b_config

    c = llama_7b_config(dropout=0.1, sequence_parallel=True)
    all_five = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
    modes = {
        "none": c,
        "selective core_attn": c.replace(recompute_granularity="selective"),
        "full uniform k=1": c.replace(recompute_granularity="full", recompute_method="uniform",
                                      recompute_num_layers=1),
        "offload (all five)": c.replace(fine_grained_activation_offloading=True,
                                        offload_modules=all_five),
        "selective + offload": c.replace(recompute_granularity="selective",
                                         fine_grained_activation_offloading=True,
                                         offload_modules=["core_attn", "attn_proj", "mlp_norm"]),
    }
    return {name: decoder_activation_bytes(cfg, stage_layers, tp, micro_batch_size,
                                           post_process=False) / 2**30
            for name, cfg in modes.items()}


if __name__ == "__main__":
    from tinytron.model.config import llama_7b_config

    big = llama_7b_config(dropout=0.1, sequence_parallel=True)
    terms = layer_activation_terms(big, tp=2, micro_batch_size=2)
    per_region = {r: sum(n * sz for n, sz in t.values()) / 2**20 for r, t in terms.items()}
    print("one layer, MiB per region:", {r: round(v) for r, v in per_region.items()})
    table = running_example_table()
    for name, gib in table.items():
        print(f"{name:<22}{gib:>8.2f} GiB per micro-batch on a 16-layer stage")
    assert table["full uniform k=1"] < table["selective core_attn"] < table["none"]
    assert abs(per_region["core_attn"] / 1024 - 2.59) < 0.005  # the whole region
    square = [k for k in terms["core_attn"] if k not in ("q", "k", "v")]  # the s^2 tensors
    s2 = sum(terms["core_attn"][k][0] * terms["core_attn"][k][1] for k in square) / 2**30
    assert abs(s2 - 2.50) < 0.005 and abs(sum(per_region.values()) / 1024 - 3.22) < 0.005

# %% [markdown]
# | mode | per layer | 16-layer stage, one micro-batch |
# |---|---|---|
# | none | 3.22 GiB (2.59 of it core attention) | 51.5 GiB |
# | selective `core_attn` | 0.71 GiB | 11.4 GiB |
# | full, uniform $k = 1$ | 32 MiB (the layer input) | 0.50 GiB |
# | offload, all five regions | 0.50 GiB left on the device | 8.0 GiB |
#
# Without recompute, materialized attention does not fit an 80 GB GPU even for one
# micro-batch, and the first stage of a 1F1B schedule keeps two in flight (chapter 01).
# Selective recompute is what makes it fit, for one extra attention forward; full recompute
# buys another factor of 23 for one extra forward of everything. Offload gets below selective
# without any extra compute, if the PCIe link can move about 2.7 GiB per layer in each
# direction while the layer computes. With flash attention (the usual case on a GPU) the
# $s^2$ tensors are never stored — the kernel keeps a log-sum-exp per row and recomputes the
# probabilities itself — so selective `core_attn` has nothing left to save, which is why
# Megatron warns when it is requested with fused attention (`transformer_config.py:1546-1665`).
#
# ## Summary
#
# - The count above is exact for this model: measured and counted agree to the byte without
#   recompute and with offload, and within the RNG snapshots' CPU states elsewhere.
# - Per layer, materialized attention's $a s^2 b / t$ tensors dwarf everything else at long
#   sequences; selective recompute removes them, full recompute keeps only $s' b h$ per run,
#   offload removes what the chosen regions save.
#
# ## How production does it
#
# - Megatron-LM: `megatron/training/theoretical_memory_usage.py:289-291` (activation memory
#   $s b h (18 + 4 f / h)$ per layer, divided by $t$ with SP: Table 2 of Korthikanti et al.
#   with selective recompute, so the $5 a s / h$ term of the softmax tensors is already gone,
#   and $34$ at $f = 4h$), and chapter 07 of this book for the whole-model version.
# - PyTorch: `torch.cuda.memory._record_memory_history()` and the snapshot viewer show the
#   same held/peak picture per allocation on a GPU.
#
# ## Exercises
#
# 1. Redo the running-example table with flash attention (drop the three $a s^2 b/t$ terms,
#    add a log-sum-exp of $a s b / t$ fp32 elements). Which mode is worth its cost now?
#    <details><summary>Answer</summary>
#
#    From `layer_activation_terms` with those changes: no
#    recompute keeps 0.72 GiB per layer, 11.5 GiB per 16-layer stage (the log-sum-exp is
#    0.5 MiB). Selective `core_attn` keeps 0.71 GiB, 11.4 GiB: 0.13 GiB saved for an extra
#    attention forward, not worth it. Full recompute still keeps 0.50 GiB a stage, for one
#    extra forward of everything: worth it only when 11.5 GiB per micro-batch in flight does
#    not fit.
#
#    </details>
#
# 2. Megatron's column-parallel layers save their $s/t$ input shard under SP and gather again
#    in backward. How much would that save per layer in the running example?
#    <details><summary>Answer</summary>
#
#    Against keeping the gathered input: each
#    column-parallel linear (`linear_qkv` and `linear_fc1`) keeps $s b h / t$ instead of
#    $s b h$ elements, $(1 - 1/2) \cdot 4096 \cdot 2 \cdot 4096 \cdot 2$ B = 32 MiB less; 64 MiB per
#    layer, 1 GiB per 16-layer stage. The table above already counts the shard ($s' b h$), as
#    this model keeps it too.
#
#    </details>

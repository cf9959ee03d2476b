# %% [markdown]
# # 07.7 · Memory: the ledger against Megatron — term by term
#
# [07.6](measured.py) held the ledger against two meters on a CPU. This page holds it against
# the chapter's other model, Megatron's own estimate ([07.1](megatron_model.py)), on the
# running example, and takes the difference apart into named terms that add up to it.
# [07.8](config_ledger.py) then builds the same ledger from a trainer's config, and
# [07.9](calculator.py) makes both the console script `tinytron-memory`.
#
# You will build: `running_example`, `peak_parts`, `megatron_gap` and `format_gap`.
#
# **Why take it apart.** For DP rank 0 of the first and the last pipeline stage of the
# running example (flash attention, no dropout, selective recompute, as on the front page)
# the ledger of 07.5 says:
#
# | term | stage 0 | stage 1 |
# |---|---|---|
# | weights (bf16 param buffer) | 3,829.2 MiB | 3,829.3 MiB |
# | grad buffer (fp32) | 7,658.5 MiB | 7,658.5 MiB |
# | fp32 masters, $1/64$ | 119.7 MiB | 119.7 MiB |
# | Adam moments, $1/64$ | 239.3 MiB | 239.3 MiB |
# | activations at the peak | 22,537.6 MiB | 18,278.6 MiB |
# | **total on the device** | **34,384.4 MiB** | **30,125.4 MiB** |
# | where the peak is | backward of micro-batch 0, 2 in flight | forward of micro-batch 0, 1 in flight |
#
# Megatron's estimate for the same layout is 11,846.75 MiB of weights and optimizer state and
# 16,416.06 MiB of activations, 28,262.81 MiB for every stage: 6,121.57 MiB less than the
# ledger on stage 0 and 1,862.57 MiB less on stage 1. The resident parts agree to 12,672 B
# (07.2 explains the difference: where the final norm is counted). The activations do not:
# Megatron charges 512 MiB per layer and micro-batch, this ledger 696 MiB (07.3), for the
# same 32 layer-micro-batches on stage 0 — 16 layers, 2 micro-batches in flight. Both fit an
# 80 GiB device; only the ledger says by how much, and a difference without its reason is no
# use to someone sizing a job: which of the two should they trust, and for which term?

# %%
from __future__ import annotations

import math

from tinytron.memory.activations import chunk_saved, saved_bytes
from tinytron.memory.ledger import RankLedger, megatron_args_from, rank_ledger, stage_ledgers
from tinytron.memory.megatron_model import (_embedding_terms, _pipeline_factor, megatron_args,
                                            megatron_theoretical_memory)
from tinytron.memory.peak import activation_peak
from tinytron.memory.states import MemoryConfig, buffer_layouts
from tinytron.model.config import stage_layer_ranges

__all__ = ["running_example", "peak_parts", "megatron_gap", "format_gap"]

# %% [markdown]
# The running example, written out once as a `MemoryConfig`: the 7B model on 256 GPUs, TP 2
# with SP, PP 2, DP 64, micro-batch 2, 8 micro-batches, bf16, the distributed optimizer and
# selective recompute. Every later page of the chapter starts from it; 07.8 reads the same
# layout from its TOML file.

# %%
def running_example() -> MemoryConfig:
    """The book's 7B example: TP2 (SP) · PP2 · DP64, mbs 2, m 8, bf16, DistOpt, selective."""
    from tinytron.model.config import llama_7b_config

    return MemoryConfig(llama_7b_config(sequence_parallel=True, recompute_granularity="selective"),
                        tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        data_parallel_size=64, micro_batch_size=2, num_microbatches=8,
                        use_distributed_optimizer=True)


# %% [markdown]
# ## Where the ledger and Megatron's estimate part ways, term by term
#
# Megatron's number comes from `report_theoretical_memory`
# (`megatron/training/theoretical_memory_usage.py:428` at e03878b5f). The difference is
# taken apart into named terms that add up to it; each term is one place where Megatron's
# formula leaves something out or counts it another way:
#
# | term | what Megatron's formula does | what the ledger does |
# |---|---|---|
# | parameters on the stage | one "most loaded" shard: the layers and norms spread evenly over the stages, plus one embedding table | this stage's own tensors (the final norm sits on the last stage) |
# | padding of the buffers | none | the distributed optimizer's param and grad buffers padded to 64-element starts and $\mathrm{lcm}(d_{cp}, 128)$ bucket ends (07.2) |
# | bytes per parameter | $2 + 4$ for weights and grads (mixed precision) | the config's dtypes: $4 + 4$ for an fp32 model |
# | optimizer states | $12$ bytes per parameter, or $12/d$ with the distributed optimizer ($d$ without CP) | the owned shard over $d \cdot c$, the optimizer's own moments, no master copy for an fp32 model, nothing for what is offloaded |
# | a layer's norms, linear_qkv input, attention, MLP, dropout masks | Korthikanti et al.'s Table 2: $s b h (18 + 4 f/h)/t$ with SP and selective recompute, else $s b h (10 + 24/t) \cdot 1.05$ | appendix B's model tensor by tensor (07.3): Megatron's norms and SP linear inputs (plus $1/\mathrm{rms}$), GQA, the SwiGLU chain, no masks without dropout |
# | layer-micro-batches in flight | $L$ layers times $\min(1, m/p)$ or the interleaving penalty, the first stage's count, for every stage | the replayed schedule's in-flight set at the peak (07.4) |
# | embedding | token ids and a 1-byte dropout mask, $p$ micro-batches | local ids and the out-of-range mask of the micro-batches in flight |
# | received activations, send buffers | none | the stage input each in-flight micro-batch keeps, the message a send still holds |
# | head: cross-entropy softmax, the rest | only with $p = 1$: $4 s b (h + V)/t$ | the last stage's fp32 softmax, final norm, output-layer input, targets and loss |
# | transients at the peak | none | the temporaries alive inside the operation where the peak falls (07.4) |
#
# Megatron's per-layer number is not split by module in its code
# (`megatron/training/theoretical_memory_usage.py:280` with SP and selective recompute, `:354`
# without), but the paper's count is (Korthikanti et al., §4.2), and the split below follows
# it: the two norm inputs, 2 bytes
# each; the QKV input, 2; q, k, v and the projection's input, 8 (GQA not modelled); the fc1
# input 2 plus $4f/h$ for the MLP's intermediates; two 1-byte dropout masks. Without SP the
# same parts, with the TP-split ones divided by $t$ and $24/t$ standing for $f = 4h$.

# %%
_MIB = 2**20
_LAYER_GROUPS = {"attn_norm": "norms", "mlp_norm": "norms", "qkv_linear": "linear_qkv input",
                 "core_attn": "attention", "attn_proj": "attention", "mlp": "MLP",
                 "bda": "dropout masks", "recompute": "recompute checkpoints"}
_OTHER = "other layer tensors"
_LABELS = {  # the printed order
    "params": "parameters on the stage vs Megatron's shard",
    "padding": "padding of the param and grad buffers",
    "bytes_per_param": "weights + grads: the config's dtypes vs 2 + 4 B",
    "optimizer": "optimizer states: owned shard, moments, offload",
    "norms": "layers' norms: input, 1/rms", "linear_qkv input": "layers' "
    "linear_qkv input", "attention": "layers' attention: q, k, v (GQA), output",
    "MLP": "layers' MLP: fc1 input and the SwiGLU chain", "dropout masks": "layers' dropout masks",
    "recompute checkpoints": "recompute: run inputs, RNG snapshots",
    _OTHER: "layers' other saved tensors", "in_flight": "layer-micro-batches in flight",
    "embedding": "embedding: token ids and masks", "stage_input": "received activations "
    "(stage inputs)", "logits": "head: fp32 cross-entropy softmax (logits)",
    "head": "head: final norm, output-layer input, targets",
    "transient": "transients inside the op at the peak", "p2p": "send buffers in transit (p2p)"}


def _megatron_pieces(cfg: MemoryConfig) -> dict:
    """Megatron's activation estimate as parts that add up to it (bytes, floats)."""
    a = megatron_args(megatron_args_from(cfg))
    s, b, h, t = a.seq_length, a.micro_batch_size, a.hidden_size, a.tensor_model_parallel_size
    f, v, p = a.ffn_hidden_size, a.padded_vocab_size, a.pipeline_model_parallel_size
    if a.sequence_parallel and a.recompute_granularity == "selective":  # :280-351, all / t
        per_h, head, scale = {"norms": 4, "linear_qkv input": 2, "attention": 8,
                              "MLP": 2 + 4 * f / h, "dropout masks": 2}, (4 * v, 4 * h), 1 / t
    else:  # :354-425: TP-only, times 1.05
        per_h, head, scale = {"norms": 4, "linear_qkv input": 2, "attention": 8 / t,
                              "MLP": 2 + 16 / t, "dropout masks": 2}, (2 * v / t, 2 * h), 1.05
    factor = _pipeline_factor(a, cfg.num_microbatches)
    return {"layer": {k: s * b * h * c * scale for k, c in per_h.items()},
            "layers": a.num_layers * factor,
            "embedding": _embedding_terms(a) * factor * scale,
            "logits": s * b * head[0] * scale if p == 1 else 0.0,
            "head": s * b * head[1] * scale if p == 1 else 0.0}

# %% [markdown]
# On the ledger's side the peak is one moment of the replayed schedule (07.4): the kept bytes
# of the chunk-micro-batches in flight, plus the transient of the operation running, plus a
# send buffer. `activation_peak` reports the sum, where it falls, and what it is made of: the
# in-flight set itself, so that its tensors can be sorted into the table's terms, and the
# transient of the step running. A backward's peak can fall before its chunk is freed (the
# layers' backward) or after (the embedding's end of backward); the replay keeps the set of
# whichever of the two was larger. `peak_parts` checks that the parts add up to the reported
# peak to the byte.

# %%
def peak_parts(cfg: MemoryConfig, pp_rank: int) -> dict:
    """The activation peak taken apart: the chunks in flight at it, the transient, the p2p."""
    pk = activation_peak(cfg, pp_rank)
    live, transient = pk["in_flight_at_peak"], pk["transient_at_peak"]
    if sum(pk["per_chunk"][c] for c in live) + transient + pk["p2p_buffers"] != pk["peak"]:
        raise RuntimeError(f"peak_parts: stage {pp_rank}'s parts do not add up to its peak")
    return {"in_flight": live, "transient": transient, "p2p": pk["p2p_buffers"], "at": pk["at"]}

# %% [markdown]
# With both sides in parts, `megatron_gap` subtracts them. The resident terms come from the
# buffers of 07.2: with $n$ the stage's parameters, $n_M$ Megatron's and $B$ its bytes per
# parameter ($18$, or $6 + 12/d$), the four terms are $(n - n_M) B$, the buffers' padding
# elements at their dtypes, $(P + G - 6)\,n$, and the optimizer's device bytes less
# $(B - 6)\,n$ — they add up to the resident difference by construction. The activation terms
# are, per group of a layer's tensors, the ledger's bytes in flight less Megatron's bytes of
# that group times the ledger's layer-micro-batches $N$; then Megatron's per-layer total
# times $N - N_M$; then the embedding and the head, each the ledger's bytes less Megatron's,
# and the stage inputs, the transient and the send buffer, which Megatron has no term for.
# Megatron's side is in floating point (its formula divides), so the terms add up to the
# difference to within floating-point rounding: the test holds them to a byte.

# %%
def _resident_terms(cfg: MemoryConfig, pp_rank: int, led: RankLedger, meg: dict) -> dict:
    """The four resident terms of the gap: parameters, padding, bytes per parameter, optimizer."""
    bpp = 6 + 12 / cfg.data_parallel_size if cfg.use_distributed_optimizer else 18
    layouts = buffer_layouts(cfg, pp_rank)
    n = sum(p.count for params, _ in layouts for p in params)
    padded = sum(layout.numel for _, layout in layouts)
    d = led.device
    return {"params": n * bpp - meg["weight_and_optimizer"],
            "padding": (d["weights"] - cfg.param_bytes * n) + cfg.grad_bytes * (padded - n),
            "bytes_per_param": (cfg.param_bytes + cfg.grad_bytes - 6) * n,
            "optimizer": d["master_params"] + d["optimizer_state"] + d["fp32_grad_copies"]
            - (bpp - 6) * n}

# %% [markdown]
# `megatron_gap` starts from those four, then sorts the tensors of the chunks in flight at the
# peak into the activation terms and subtracts Megatron's piece for each.

# %%
def megatron_gap(cfg: MemoryConfig, pp_rank: int, dp_rank: int = 0) -> dict:
    """Ledger − Megatron on one stage: the totals, and named terms (bytes) that add up to it."""
    led = rank_ledger(cfg, pp_rank, dp_rank)
    meg = megatron_theoretical_memory(megatron_args_from(cfg), cfg.num_microbatches)
    terms = _resident_terms(cfg, pp_rank, led, meg)
    parts, pieces = peak_parts(cfg, pp_rank), _megatron_pieces(cfg)
    ranges = stage_layer_ranges(cfg.model.num_layers, cfg.pipeline_model_parallel_size,
                                cfg.num_chunks, pp_rank)
    held = {k: 0 for k in (*pieces["layer"], "recompute checkpoints", _OTHER, "embedding",
                           "stage_input", "logits", "head")}
    for c in parts["in_flight"]:
        saved = chunk_saved(cfg, pp_rank, c)
        for e in saved["layers"]:
            held[_LAYER_GROUPS.get(e.module, _OTHER)] += e.nbytes
        for e in saved["head"]:
            held["logits" if e.what.startswith("cross-entropy softmax") else "head"] += e.nbytes
        held["embedding"] += saved_bytes(saved["embedding"])
        held["stage_input"] += saved_bytes(saved["stage_input"])
    layers = sum(ranges[c][1] - ranges[c][0] for c in parts["in_flight"])
    for group, value in held.items():
        terms[group] = value - pieces["layer"].get(group, 0) * layers - pieces.get(group, 0)
    terms.update(in_flight=sum(pieces["layer"].values()) * (layers - pieces["layers"]),
                 transient=parts["transient"], p2p=parts["p2p"])
    meg_stage = meg["weight_and_optimizer"] + meg["activation"]
    return {"pp_rank": pp_rank, "ledger": {"resident": led.resident, "flowing": led.flowing,
                                           "total": led.total},
            "megatron": {"resident": meg["weight_and_optimizer"], "flowing": meg["activation"],
                         "total": meg_stage},
            "difference": led.total - meg_stage, "terms": terms, "peak": parts,
            "layer_microbatches": (layers, pieces["layers"]),
            "megatron_layer_bytes": sum(pieces["layer"].values())}

# %% [markdown]
# Printed, the terms that are zero on every stage are left out, each value is rounded to
# 0.01 MiB (so the printed terms may miss the printed difference by a few hundredths), and
# `--json` carries every term in bytes. The in-flight line names both counts and the bytes
# Megatron charges per layer and micro-batch, because that is the one number a reader can
# check against Megatron's log line "Activation memory footprint per transformer layer".

# %%
def format_gap(cfg: MemoryConfig, dp_rank: int = 0) -> list[str]:
    """The ledger next to Megatron's formula per stage, and the difference by term, in MiB."""
    gaps = [megatron_gap(cfg, led.pp_rank, dp_rank) for led in stage_ledgers(cfg, dp_rank)]
    counts = "/".join(str(g["layer_microbatches"][0]) for g in gaps)
    per_layer = gaps[0]["megatron_layer_bytes"] / _MIB
    labels = {**_LABELS, "in_flight": f"{_LABELS['in_flight']}: {counts} vs Megatron's "
              f"{gaps[0]['layer_microbatches'][1]:g} x {per_layer:,.1f} MiB"}
    rows = [(label, [g["terms"][key] for g in gaps]) for key, label in labels.items()
            if any(abs(g["terms"][key]) >= 0.005 * _MIB for g in gaps)]
    rows.append(("sum of the terms = the difference", [g["difference"] for g in gaps]))
    width = max(40, *(len(label) for label, _ in rows))
    heads = "".join(f"{'stage ' + str(g['pp_rank']):>12}" for g in gaps)
    lines = [f"{'ledger vs Megatron (MiB)':<{width + 2}}{heads}{'Megatron':>12}"]
    for key, name in (("resident", "weights + grads + optimizer states"),
                      ("flowing", "activations + p2p at the peak"), ("total", "total")):
        lines.append(f"  {name:<{width}}" + "".join(f"{g['ledger'][key] / _MIB:>12,.2f}"
                                                   for g in gaps)
                     + f"{gaps[0]['megatron'][key] / _MIB:>12,.2f}")
    lines.append(f"{'difference by term (ledger - Megatron, MiB)':<{width + 2}}{heads}")
    lines += [f"  {label:<{width}}" + "".join(f"{v / _MIB:>+12,.2f}" for v in values)
              for label, values in rows]
    return lines

# %% [markdown]
# The running example's gap, as the command prints it:

# %%
if __name__ == "__main__":
    print("\n".join(format_gap(running_example())))
    gap0, gap1 = (megatron_gap(running_example(), r) for r in (0, 1))
    assert all(abs(math.fsum(g["terms"].values()) - g["difference"]) < 1 for g in (gap0, gap1))
    assert gap1["terms"]["in_flight"] == -8192 * _MIB and gap0["terms"]["in_flight"] == 0

# %% [markdown]
# The same terms drawn, stage by stage: each bar is one named difference, ledger minus
# Megatron, in MiB; the bars of a stage add up to its difference.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    keys = [k for k in _LABELS if max(abs(gap0["terms"][k]), abs(gap1["terms"][k])) >= _MIB]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for i, (g, color) in enumerate(((gap0, "tab:blue"), (gap1, "tab:orange"))):
        ax.barh([y + 0.2 - 0.4 * i for y in range(len(keys))],
                [g["terms"][k] / _MIB for k in keys], 0.4, color=color,
                label=f"stage {g['pp_rank']}: {g['difference'] / _MIB:+,.0f} MiB in all")
    ax.set_yticks(range(len(keys)), [_LABELS[k] for k in keys], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("ledger − Megatron, MiB (running example, DP rank 0)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    plt.show()
    assert abs(sum(gap0["terms"][k] for k in keys) - gap0["difference"]) < 2 * _MIB * len(_LABELS)

# %% [markdown]
# *Figure:* the two estimates part ways in what a layer keeps (the SwiGLU chain) on stage 0
# and in what the formula leaves out on stage 1 — the head, its transient and the
# micro-batches a later stage does not hold.

# %% [markdown]
# Read the stage-0 column first. Its 6,121.57 MiB are almost all "what a layer keeps": per
# layer and micro-batch ($s b h / t$ = 16 Mi elements at TP 2) the two norms keep their bf16
# inputs as Megatron's do, plus the $1/\mathrm{rms}$ rows the formula leaves out (32 KiB);
# the linear_qkv input is the same $s/t$ slice on both sides (the column-parallel layer
# gathers it again in backward, A.2), so that line is gone; attention holds 120 MiB against
# 128 (GQA's 8 KV groups make k and v smaller than Megatron's $h$-wide ones), the MLP 512 MiB
# against 256 (fc1's input plus SwiGLU's gate, up, silu and product, $4 f_t$ bf16 elements
# per token — Megatron's $4 f/h$ term counts two, a GELU MLP's input and output), and no
# dropout masks against Megatron's 32 MiB (the model has no dropout; the formula always
# charges two 1-byte masks). That is 696.03 MiB against 512 MiB, times 32 layer-micro-batches:
# +5,889 MiB. Both sides agree on those 32 — 2 micro-batches of 16 layers — so the in-flight
# line is zero. The rest is small: the backward's 264.50 MiB transient (fc2's backward,
# 07.4), and the embedding's 31.92 MiB that Megatron charges for a 1-byte dropout mask the
# model does not have.
#
# Stage 1 is where the two disagree in kind. Megatron's formula is the first stage's and is
# reported for every stage, so it charges stage 1 for 32 layer-micro-batches; stage 1 holds one
# micro-batch of its 16 layers at its peak, so the in-flight line gives back 8,192 MiB (16
# times 512). In exchange the formula has no head for $p > 1$: the fp32 cross-entropy
# softmax, $4 b s V/t$ = 2,004 MiB, the final norm, output-layer input and targets (96.12
# MiB) and, largest, the 5,042 MiB transient of the cross-entropy chain (bf16 logits, their
# fp32 copy, the shifted logits and their exponential, 07.4) — the moment stage 1 peaks in.
# The stage input it received (32 MiB) is kept too. Net: +1,862.57 MiB. The ledger's numbers
# are themselves a model, checked against two meters on a CPU in 07.6; what this table shows
# is where the two models differ and by how much, not which one a GPU would confirm.
#
# <details><summary>Megatron detail: the output layer's input</summary>
#
# Of the head's 96.12 MiB, the output layer's input is the gathered sequence, 64 MiB, where
# Megatron's column-parallel output layer keeps the 32 MiB slice.
#
# </details>
#


# %% [markdown]
# ## Summary
#
# - The ledger and Megatron's estimate agree on the resident state to a few kB; they part
#   ways in the activations, and `megatron_gap` names every difference so the terms add up
#   to it.
# - On stage 0 the difference is what a layer keeps (the SwiGLU chain, GQA, no dropout
#   masks); on stage 1 it is what the formula leaves out for $p > 1$ (the head and the
#   cross-entropy's transient) against the micro-batches it charges and the stage does not
#   hold.
# - Both are models (the ledger was held against meters in 07.6); the terms say where to
#   look when a GPU's measurement disagrees with either.
#
# ## How production does it
#
# Megatron's estimate is `megatron/training/theoretical_memory_usage.py:428`, printed once at
# the first iteration; its activation term is the paper's count
# (`megatron/training/theoretical_memory_usage.py:280`). It states no assumptions and takes
# no stage apart; [07.8](config_ledger.py) builds this page's ledger from a trainer's config
# and [07.9](calculator.py) puts it behind a command.
#
# ## Exercises
#
# 1. Give the running example dropout 0.1 (on CUDA). Which lines of stage 0's difference
#    change, and by how much?
#
#    <details><summary>Answer</summary>
#
#    Two. The layers' dropout masks line goes from −1,024 MiB to nothing: the ledger now keeps
#    the two 1-byte masks per layer that the formula always charges (2 × 16 MiB, times 32
#    layer-micro-batches). The embedding line goes from −31.92 to +0.08 MiB: the embedding's
#    own mask (16 MiB per micro-batch, 2 in flight) is kept too. Stage 0's difference grows
#    from +6,121.57 to +7,177.57 MiB, by 1,056 MiB. Flash attention takes dropout on CUDA,
#    so nothing else changes.
#
#    </details>
#
# 2. Lay the same 256 GPUs out without a pipeline: TP 2 · PP 1 · DP 128, 4 micro-batches
#    per step. What becomes of the head's lines and of the in-flight line?
#
#    <details><summary>Answer</summary>
#
#    With $p = 1$ the formula counts the head: its $4 s b V/t$ for the cross-entropy softmax
#    is the ledger's fp32 softmax to the byte (2,004 MiB), so the logits line is gone, and the
#    head's other line shrinks to +32.12 MiB (the ledger's final norm, output-layer input and
#    targets, 96.12 MiB, against the formula's $4 s b h/t$, 64 MiB). The in-flight line is
#    zero too: one micro-batch of 32 layers on both sides. What stays is the layers' difference (+5,889 MiB, as on stage 0 above),
#    the embedding (−15.96 MiB) and the cross-entropy's 5,042 MiB transient, now on the only
#    stage: +10,947.16 MiB in all, 51,223 MiB against Megatron's 40,276.
#
#    </details>

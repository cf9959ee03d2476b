# %% [markdown]
# # 07.6 · Memory: the ledger against measurement
#
# A memory model is only as good as its agreement with what the program allocates. This page
# builds real layouts — TP, SP, CP, PP with and without interleaving, DP with and without the
# distributed optimizer, CPU offload, fp32 and bf16, dropout, several micro-batch sizes — on
# gloo worlds, measures every term, and puts the ledger and Megatron's estimate beside each.
#
# You will build: `VALIDATION_GRID`, `run_grid`, `compare`, `error_table` and
# `plot_comparison`.

# %%
from __future__ import annotations

import statistics

from tinytron.memory._workers import case_config, measure_cases, predict
from tinytron.memory.ledger import megatron_args_from
from tinytron.memory.megatron_model import megatron_theoretical_memory

__all__ = ["VALIDATION_GRID", "DEMO_GRID", "run_grid", "compare", "error_table",
           "plot_comparison", "STATE_TERMS"]

# %% [markdown]
# ## What is measured, and how
#
# Each case runs on every rank of a 4-rank world (DP fills what TP × CP × PP leaves) and
# builds appendix B's model chunks, chapter 05's DDP buffers and chapter 02's optimizer in
# the case's precision. Then, per rank:
#
# | term | measured as |
# |---|---|
# | weights, grad buffer | `storage_bytes` of the parameters and of the DDP grad buffers |
# | masters, moments, host copies | `storage_bytes` of the optimizer's fp32 masters and state after one step; chapter 01's `LiveBytesMeter` around building and stepping the optimizer must see exactly their sum |
# | kept activations, per chunk | the meter's live bytes right after one micro-batch's forward (inputs created inside, as a data loader would) |
# | peak activations | the meter's peak over one `forward_backward` of $m$ micro-batches through chapter 01's schedule (1F1B, interleaved or none) |
#
# Activations are the smaller of two runs: on a loaded machine a gloo work object or Python's
# cycle collector can hold a freed buffer a moment longer, which only ever adds bytes.
#
# The meter counts every tensor storage allocated inside its block that is still alive —
# autograd's saved tensors, outputs, p2p buffers, transient gradients — so nothing has to be
# listed by hand for the measurement side; the ledger, on the other side, is pure arithmetic.
#
# The grid below has 42 cases; the tests run all of them (in one world of 4 ranks), this page
# runs the six of `DEMO_GRID`, and `benchmarks/bench_memory.py` runs the grid and larger
# models and writes the error table to `benchmarks/results/memory.json`.

# %%
_SMALL = dict(hidden_size=128, seq_length=128, ffn_hidden_size=256, num_layers=4)

_ALL_OFFLOAD = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]

VALIDATION_GRID: list[dict] = [
    {}, {"distopt": True}, {"distopt": True, "offload": 0.5},
    {"bf16": False}, {"bf16": False, "distopt": True}, {"grad_fp32": False, "distopt": True},
    {"mbs": 2, "m": 2}, {"tp": 2}, {"tp": 2, "sp": True},
    {"tp": 2, "sp": True, "distopt": True, "mbs": 2},
    {"tp": 4, "sp": True, "num_query_groups": 4},
    {"tp": 4, "bf16": False, "num_query_groups": 4}, {"cp": 2}, {"cp": 2, "distopt": True},
    {"cp": 2, "tp": 2, "sp": True}, {"cp": 4, "m": 2},
    {"tie_embeddings": False}, {"dropout": 0.1}, {"dropout": 0.1, "tp": 2, "sp": True},
    {"overlap": True, "bucket_size": 20_000, "distopt": True},
    {"pp": 2, "m": 3}, {"pp": 2, "m": 4, "distopt": True, "num_layers": 4},
    {"pp": 4, "m": 4, "num_layers": 4}, {"pp": 4, "m": 2, "num_layers": 4},
    {"pp": 2, "vpp": 2, "m": 4, "num_layers": 4},
    {"pp": 2, "vpp": 2, "m": 4, "num_layers": 8, "distopt": True},
    {"tp": 2, "pp": 2, "sp": True, "m": 4}, {"tp": 2, "pp": 2, "m": 2, "bf16": False},
    {"cp": 2, "pp": 2, "m": 2}, {"pp": 2, "m": 2, "dropout": 0.1, "cp": 2},
    {"tp": 2, "pp": 2, "sp": True, "m": 4, "vocab_size": 2048},
    {"pp": 2, "m": 4, **_SMALL}, {"tp": 2, "sp": True, "pp": 2, "m": 4, "mbs": 2, **_SMALL},
    {"recompute": "selective", "num_layers": 4},
    {"recompute": "selective", "tp": 2, "sp": True, "pp": 2, "m": 4, "num_layers": 4},
    {"recompute": "selective", "modules": ["core_attn", "mlp"], "dropout": 0.1},
    {"recompute": "full", "method": "uniform", "recompute_layers": 1, "num_layers": 4},
    {"recompute": "full", "method": "uniform", "recompute_layers": 2, "num_layers": 4, "pp": 2,
     "m": 2},
    {"recompute": "full", "method": "block", "recompute_layers": 1, "num_layers": 4,
     "dropout": 0.1},
    {"recompute": "full", "method": "uniform", "recompute_layers": 1, "tp": 2, "distribute": True},
    {"act_offload": _ALL_OFFLOAD, "min_offload": 1024, "num_layers": 4},
    {"act_offload": ["qkv_linear", "core_attn"], "min_offload": 1024, "num_layers": 4, "pp": 2,
     "m": 2},
]

# %% [markdown]
# The page itself runs six of those cases, one per family of layouts, and compares these
# resident terms one by one.

# %%
DEMO_GRID: list[dict] = [{"distopt": True}, {"tp": 2, "sp": True}, {"cp": 2},
                         {"pp": 2, "m": 3}, {"pp": 2, "vpp": 2, "m": 4, "num_layers": 4},
                         {"dropout": 0.1, "offload": 0.5}]

STATE_TERMS = ("weights", "grad_buffer", "master_params", "optimizer_state", "host_optimizer",
               "fp32_grad_copies")

# %% [markdown]
# ## Running a grid and comparing
#
# `run_grid` starts one world for a list of cases and returns every rank's measurements;
# `compare` computes the ledger's prediction for each (in this process, from the case alone)
# and Megatron's estimate, and flattens both into rows of (case, rank, term, measured,
# predicted, Megatron). Megatron estimates one number for "weights and optimizer" and one for
# the first stage's activations, so it is compared with the resident total of every rank and
# with the measured peak of pipeline stage 0.

# %%
def run_grid(cases: list[dict], world_size: int = 4, backend: str = "gloo",
             timeout: float = 600.0) -> list[dict]:
    """Measure every case on every rank of one world; a flat list of per-rank results."""
    from tinytron.launch import run_on_ranks

    per_rank = run_on_ranks(measure_cases, world_size, cases, backend=backend, timeout=timeout)
    return [r for rank_results in per_rank for r in rank_results]


def _label(case: dict) -> str:
    """A short name for a case: its non-default keys."""
    return " ".join(f"{k}={v}" for k, v in case.items()) or "dp4"


# %% [markdown]
# `compare` puts each rank's measurement beside the two predictions: every state term, the
# resident total (where Megatron has a number), the optimizer's new bytes, each chunk's kept
# activations and the schedule's peak (Megatron's only for stage 0).

# %%
def compare(results: list[dict], predictor=predict) -> list[dict]:
    """Rows of (case, rank, term, measured, predicted, megatron) for every measured term."""
    rows = []
    for res in results:
        pred = predictor(res)
        base = {"case": _label(res["case"]), "rank": res["rank"], "pp_rank": res["pp_rank"]}
        cfg = case_config(res["case"], res["world_size"], res["device"])
        meg = megatron_theoretical_memory(megatron_args_from(cfg), cfg.num_microbatches)
        for term in STATE_TERMS:
            rows.append({**base, "term": term, "measured": res["states"].get(term, 0),
                         "predicted": pred["states"].get(term, 0), "megatron": None})
        resident = sum(res["states"].get(t, 0) for t in STATE_TERMS if t != "host_optimizer")
        rows.append({**base, "term": "resident", "measured": resident,
                     "predicted": sum(pred["states"].get(t, 0) for t in STATE_TERMS
                                      if t != "host_optimizer"),
                     "megatron": meg["weight_and_optimizer"]})
        rows.append({**base, "term": "optimizer_new_bytes",
                     "measured": res["states"]["optimizer_new_bytes"],
                     "predicted": sum(pred["states"].get(t, 0) for t in STATE_TERMS[2:]),
                     "megatron": None})
        for i, (m, p) in enumerate(zip(res["chunks"], pred["chunks"])):
            rows.append({**base, "term": "kept_activations", "chunk": i,
                         "measured": m["kept"], "predicted": p["kept"], "megatron": None})
        rows.append({**base, "term": "peak_activations", "measured": res["schedule"]["peak"],
                     "predicted": pred["schedule"]["peak"],
                     "megatron": meg["activation"] if res["pp_rank"] == 0 else None})
    return rows


# %% [markdown]
# The summary per term is the largest and the median relative error, for the ledger and for
# Megatron where it has a number.

# %%
def _rel(pred, meas) -> float:
    """Relative error of a prediction (0 when both are 0)."""
    return 0.0 if pred == meas else (pred - meas) / meas if meas else float("inf")


def error_table(rows: list[dict]) -> dict[str, dict]:
    """Per term: how many comparisons, max and median |relative error| of ledger and Megatron."""
    out = {}
    for term in dict.fromkeys(r["term"] for r in rows):
        sel = [r for r in rows if r["term"] == term]
        ledger = [abs(_rel(r["predicted"], r["measured"])) for r in sel]
        meg = [abs(_rel(r["megatron"], r["measured"])) for r in sel if r["megatron"] is not None]
        out[term] = {"n": len(sel), "ledger_max": max(ledger),
                     "ledger_median": statistics.median(ledger),
                     "megatron_max": max(meg) if meg else None,
                     "megatron_median": statistics.median(meg) if meg else None}
    return out


# %% [markdown]
# ## The picture
#
# Predicted over measured, one dot per (case, rank, term): the ledger's dots sit on 1, and
# Megatron's estimate (crosses) is off by factors — on these small models the terms its
# formula does not count are a large share of the activations: above all the head's fp32
# logits (left out when $p > 1$), then SwiGLU's wider MLP and, in the fp32 cases, activations
# of 4 bytes where the formula counts 2.

# %%
def plot_comparison(rows: list[dict], ax=None):
    """Predicted / measured per term: ledger (dots) and Megatron (crosses), log scale."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    terms = [t for t in dict.fromkeys(r["term"] for r in rows)
             if any(r["measured"] for r in rows if r["term"] == t)]
    for x, term in enumerate(terms):
        sel = [r for r in rows if r["term"] == term and r["measured"]]
        ax.scatter([x - 0.1] * len(sel), [r["predicted"] / r["measured"] for r in sel], s=12,
                   color="#4c72b0", label="ledger" if x == 0 else None)
        meg = [r for r in sel if r["megatron"] is not None]
        ax.scatter([x + 0.1] * len(meg), [r["megatron"] / r["measured"] for r in meg], s=18,
                   marker="x", color="#c44e52", label="Megatron" if meg and x == 1 else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(terms)), [t.replace("_", "\n") for t in terms], fontsize=7)
    ax.set_ylabel("predicted / measured")
    ax.legend(fontsize=8)
    return ax


# %% [markdown]
# ## Demo: six layouts on a 4-rank world
#
# The six cases of `DEMO_GRID` — DP 4 with the distributed optimizer, TP 2 with SP, CP 2,
# 1F1B over PP 2, interleaved PP 2 × 2, and dropout (so the math attention kernel) with half
# the optimizer offloaded — measured live; the table shows, per term, the largest and the
# median relative error of each model.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    demo_rows = compare(run_grid(DEMO_GRID))
    table = error_table(demo_rows)
    print(f"{'term':<22}{'n':>4}{'ledger max':>12}{'median':>9}{'Megatron max':>14}{'median':>9}")
    for term, e in table.items():
        meg = (f"{e['megatron_max']:>14.1%}{e['megatron_median']:>9.1%}"
               if e["megatron_max"] is not None else "")
        print(f"{term:<22}{e['n']:>4}{e['ledger_max']:>12.2%}{e['ledger_median']:>9.2%}{meg}")
    ax = plot_comparison(demo_rows)
    ax.set_title("6 layouts x 4 ranks, measured with LiveBytesMeter (gloo, CPU)", fontsize=9)
    ax.figure.tight_layout()
    plt.show()
    assert all(table[t]["ledger_max"] == 0 for t in STATE_TERMS + ("resident",
                                                                   "optimizer_new_bytes"))
    assert table["kept_activations"]["ledger_max"] <= 0.03
    assert table["peak_activations"]["ledger_max"] <= 0.03

# %% [markdown]
# ## The result on the whole grid
#
# On all 42 cases × 4 ranks (`python -m pytest tests/test_memory_measured.py`, or
# `python benchmarks/bench_memory.py`, which reprints this table):
#
# | term | comparisons | ledger max error | ledger median | Megatron max | Megatron median |
# |---|---|---|---|---|---|
# | weights, grad buffer, masters, moments, host copies, fp32 grad copies | 168 each | 0 | 0 | | |
# | resident total | 168 | 0 | 0 | 88.6% | 0.03% |
# | kept activations (per chunk, one micro-batch) | 176 | 0 | 0 | | |
# | peak activations (one `forward_backward`) | 168 | 2.6% | 0.95% | 90.2% | 39.6% |
#
# The state terms agree **to the byte** on every rank, including the DP ranks that own fewer
# elements of a padded bucket and the host copies of CPU offload. The kept activations agree
# to the byte in all 176 comparisons, recompute and activation offload included. The schedule
# peaks are within 3% (8% is allowed for the five cases that run the CPU
# math attention kernel, whose $s \times s$ temporaries are approximated): the replayed
# in-flight count is exact, and what remains is the timing of transient buffers inside one
# operation.
#
# Megatron's estimate is close on resident memory for bf16 + Adam layouts (it has no notion of
# fp32 training, offload or padding, hence its maximum) and off by large factors on
# activations here: small hidden sizes make the terms it leaves out — the last stage's logits,
# SwiGLU's wider MLP — dominate. On the running example (page 07.5) the resident part agrees
# to 12,672 bytes and the activations differ by the same terms, at 7B scale.
#
# ## What this agreement is worth: by construction, fitted, measured twice
#
# Agreement with a meter proves little if the prediction and the measurement share a cause.
# Term by term:
#
# - **Resident terms — predicted from first principles, measured on the real buffers.** Page
#   07.2 lays the buffers out from the parameter shapes and Megatron's padding and bucket
#   rules written out there, and splits the offloaded optimizer with the hybrid optimizer's
#   rule; it calls neither chapter 05's `compute_param_layout` nor chapter 02's
#   `split_by_fraction`, which sized what the trainer allocates. The parameter list itself is
#   checked name by name against the built model. `tests/test_memory_independent.py`
#   compares the layout with chapter 05's real `ParamAndGradBuffer` on 15 layouts (odd DP
#   sizes, tied tables split over stages, small buckets, interleaving) to the byte, and a
#   planted change to chapter 05's 64-element alignment shows up there as a disagreement.
# - **Kept activations — written from the program, compared with the same meter.** The
#   saved-tensor table of 07.3 was written by reading what autograd keeps on CPU and is
#   checked against chapter 01's meter; the CPU generator's RNG snapshots are left out of
#   both sides, because the meter cannot see them. On its own this is not independent.
# - **Peak activations — fitted.** The transient terms of 07.4 were written down from the
#   meter's readings, so the 2.6% above is a fit on the instrument it is checked against.
#
# **A second instrument.** PyTorch ships its own tracker,
# `torch.distributed._tools.mem_tracker.MemTracker` (present in torch 2.13, and it runs on
# CPU): a dispatch mode of its own that keeps a weak reference to each storage it sees and
# sums sizes per category. `chapters/07_memory/_second_ruler.py` measures 8 of the 42 layouts
# with it on 4 gloo ranks (DP 4 plain, with the distributed optimizer, with half the optimizer
# offloaded; TP 2 + SP; PP 2; fp32; dropout; PP 2 × 2 interleaved) — 32 rank-cases, sharing
# no code with the meter. Results:
#
# | quantity | rank-cases equal to the byte | examples (bytes) |
# |---|---|---|
# | resident (model + DDP buffers + optimizer after one step) vs the ledger | 32 / 32 | 1,922,688 (DP 4); 961,920 (distributed optimizer); 1,076,352-1,174,400 (offload 0.5, per DP rank); 1,709,056 (fp32) |
# | kept bytes of one micro-batch vs the ledger | 32 / 32 | 504,384 (DP 4); 273,408 (TP 2 + SP); 977,472 (dropout) |
# | forward and backward peak vs the meter | 32 / 32 | 710,464 and 636,224 (DP 4) |
#
# **Where they disagreed, and why.** A tracker *started after the model was built* does not
# agree: it attributes storages that already existed to whatever first touches them. Started
# before the model, the tracker has seen every storage and the two instruments agree exactly.
#
# <details><summary>Megatron detail: what a late tracker counted</summary>
#
# On DP 4 it counted 213,632 B of weights when the modules first ran, the RoPE tables passed
# into the layers as inputs (2,048 B then, when the model cached half-width tables), and the
# 427,264 B fp32 grad buffer once the backward's in-place accumulation wrote into it — all of
# it still reported alive after the backward, where the meter (which counts only what is
# allocated inside it) reported 0.
#
# </details>
#
# What
# neither can see is the same for both: memory allocated inside one C++ operator that never
# surfaces as a tensor, and on CUDA the allocator's rounding, caching and fragmentation. Both
# count tensor bytes; neither is GPU memory.
#
# ## What is not measured here
#
# - Selective recompute of `layernorm`: the output-discarding checkpoint frees a storage with
#   `resize_(0)`, which the meter still counts at its original size (chapter 06 says the
#   same); the ledger's entry for it is a formula.
# - **CUDA**: on a GPU the meter reads the allocator. `tests/test_memory_measured.py` has two
#   `gpu` tests — the ledger against allocator statistics on an NCCL world of 1, and the math
#   attention kernel's saved tensors (fp32 scores, bool dropout mask) against autograd's — and
#   `scripts/gpu_check.sh` runs them with every `gpu` test. Neither has run for this page: no
#   number on it is a GPU measurement.

# %% [markdown]
# ## Measured on a GPU
#
# On a GPU the allocator is the meter. `bash scripts/gpu_check.sh 1` records the largest
# `torch.cuda.max_memory_allocated` of the ~1B trainer run (`configs/gpt_1b.toml` on one GPU:
# selective recompute, the distributed optimizer, micro-batch 4 of 2048 tokens) beside this
# chapter's ledger for the same config, and runs `test_ledger_against_cuda_allocator`. The
# allocator also holds what the ledger does not model (its block rounding, library
# workspaces), so peak / ledger reads as the ledger's miss plus that overhead.
# `chapters/_gpu_results.py` renders the table from `benchmarks/results/gpu/<device>.json`.

# %%
if __name__ == "__main__":
    from tinytron._gpu_results import gpu_table

    print(gpu_table("measured"))

# %% [markdown]
# ## How production does it
#
# - Megatron compares its estimate with `torch.cuda.max_memory_allocated` in its logs
#   (`megatron/training/utils/common_utils.py:282`, `report_memory`); its unit test checks the
#   weight formula against exact expected numbers (`tests/unit_tests/training/test_weight_and_optimizer_memory.py`).
# - PyTorch's memory snapshot (`torch.cuda.memory._record_memory_history`) attributes every
#   allocation to a stack trace — the GPU counterpart of this page's dispatch-mode meter.
#
# ## Exercises
#
# 1. Add a case with `mbs=4`: which ledger term grows linearly with it, and which does not?
#
#    <details><summary>Answer</summary>
#
#    The activations: on the DP 4 case one micro-batch
#    keeps 422,464 B at $b = 1$ and 1,689,856 B at $b = 4$, and the peak goes from 627,264 to
#    2,509,056 B, exactly 4 times. The resident terms (weights 213,632, grad buffer 427,264,
#    masters 427,264, moments 854,528 B) do not move: they depend on the parameters, not the
#    batch.
#
#    </details>
#
# 2. Change appendix A's column-parallel layer to save only its local SP slice (exercise 1 of
#    page 07.3) and rerun the grid: which rows stop agreeing until the ledger is updated?
#
#    <details><summary>Hint</summary>
#
#    The layer now does this, and 07.3's table already
#    counts `linear_qkv` and `linear_fc1` inputs as "this rank's SP slice" (`_mlp` and the
#    attention rows). Only activation rows can move, kept and peak, and only in the 9 cases
#    with `sp` and `tp > 1`: each such input shrinks by $(t-1)/t$. The state rows never
#    look at activations.
#
#    </details>

# %% [markdown]
# # 07.5 · Memory: the whole ledger of one rank, and what each dimension cuts
#
# The resident part (page 07.2) and the flowing part (pages 07.3 and 07.4) added up for one
# rank: the first and the last pipeline stage of any layout, in bytes. Then the running example, worked
# end to end, and the picture the front page promised: the ledger shrinking as TP, SP, PP,
# DP with the distributed optimizer, and recompute are switched on one at a time.
#
# You will build: `RankLedger`, `rank_ledger`, `stage_ledgers`, `megatron_args_from` and
# `plot_ledgers`.

# %%
from __future__ import annotations

from dataclasses import dataclass, field

from tinytron.memory.peak import activation_peak
from tinytron.memory.megatron_model import megatron_theoretical_memory
from tinytron.memory.states import MemoryConfig, state_ledger

__all__ = ["RankLedger", "rank_ledger", "stage_ledgers", "megatron_args_from", "plot_ledgers",
           "DEVICE_TERMS"]

# %% [markdown]
# ## One rank, term by term
#
# | term | kind | from |
# |---|---|---|
# | `weights` | resident | the rank's parameters (the padded param buffer with the distributed optimizer) |
# | `grad_buffer` | resident | chapter 05's `main_grad` buffer, padding included |
# | `master_params`, `optimizer_state` | resident | chapter 02's fp32 masters and moments on the device |
# | `fp32_grad_copies` | resident | fp32 copies of bf16 grads (only without `grad_reduce_in_fp32`) |
# | `activations` | flowing | the replayed schedule's peak: kept tensors of the micro-batches in flight + the largest transient |
# | `p2p_buffers` | flowing | pipeline messages in transit |
# | `host_optimizer` | host | what CPU offload moved off the device |
#
# What is *not* in the ledger, because it is not a tensor the program allocates: the CUDA
# context (~0.5 GiB per process), NCCL's internal buffers, the caching allocator's
# fragmentation and cuBLAS/cuDNN workspaces. Those are the difference between this ledger and
# `nvidia-smi`; allocator statistics (`torch.cuda.max_memory_allocated`) see what the ledger
# counts.

# %%
DEVICE_TERMS = ("weights", "grad_buffer", "master_params", "optimizer_state",
                "fp32_grad_copies", "activations", "p2p_buffers")


@dataclass
class RankLedger:
    """The bytes one rank holds: resident and flowing terms on the device, and on the host."""

    pp_rank: int
    dp_rank: int
    device: dict[str, int]
    host: dict[str, int]
    peak: dict = field(default_factory=dict)
    """The schedule replay: when the peak happens, in-flight count, per-chunk bytes."""

    @property
    def resident(self) -> int:
        """Weights, grads and optimizer state on the device."""
        return sum(v for k, v in self.device.items() if k not in ("activations", "p2p_buffers"))

    @property
    def flowing(self) -> int:
        """Peak activations and pipeline messages."""
        return self.device["activations"] + self.device["p2p_buffers"]

    @property
    def total(self) -> int:
        """Everything on the device at the peak."""
        return sum(self.device.values())


# %% [markdown]
# A rank's ledger is the two earlier pages side by side: 07.2's resident terms for its
# pipeline and DP rank, and 07.4's replayed peak for its pipeline rank. `stage_ledgers` takes
# the two ends of the pipeline, where the embedding and the head make the stages differ.

# %%
def rank_ledger(cfg: MemoryConfig, pp_rank: int = 0, dp_rank: int = 0) -> RankLedger:
    """The exact ledger of pipeline rank `pp_rank`, DP (x CP) rank `dp_rank`."""
    states = state_ledger(cfg, pp_rank, dp_rank)
    peak = activation_peak(cfg, pp_rank)
    device = {k: states.get(k, 0) for k in DEVICE_TERMS[:5]}
    device.update(activations=peak["activations"], p2p_buffers=peak["p2p_buffers"])
    return RankLedger(pp_rank, dp_rank, device, {"host_optimizer": states["host_optimizer"]},
                      peak)


def stage_ledgers(cfg: MemoryConfig, dp_rank: int = 0) -> list[RankLedger]:
    """The first and the last pipeline stage (one entry when there is one stage)."""
    last = cfg.pipeline_model_parallel_size - 1
    return [rank_ledger(cfg, r, dp_rank) for r in sorted({0, last})]


# %% [markdown]
# ## Megatron's estimate for the same layout
#
# `megatron_args_from` translates a `MemoryConfig` into the argument names of page 07.1, so
# that every ledger can be printed beside Megatron's two numbers. Two translations are worth
# naming: `data_parallel_size` is DP without CP, as Megatron's args hold it, and the
# normalization is RMSNorm (appendix B's model).

# %%
def megatron_args_from(cfg: MemoryConfig) -> dict:
    """Megatron's argument names and values for this layout and model."""
    m = cfg.model
    return dict(num_layers=m.num_layers, hidden_size=m.hidden_size,
                num_attention_heads=m.num_attention_heads,
                group_query_attention=m.num_query_groups != m.num_attention_heads,
                num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
                swiglu=True, normalization="RMSNorm", padded_vocab_size=m.vocab_size,
                seq_length=m.seq_length, micro_batch_size=cfg.micro_batch_size,
                untie_embeddings_and_output_weights=not m.tie_embeddings,
                tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                sequence_parallel=m.sequence_parallel,
                pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
                context_parallel_size=cfg.context_parallel_size,
                data_parallel_size=cfg.data_parallel_size,
                use_distributed_optimizer=cfg.use_distributed_optimizer,
                recompute_granularity=cfg.recompute_granularity)


# %% [markdown]
# ## A picture of the ledger
#
# One horizontal bar per ledger, each term a segment, resident terms in cool colors and the
# flowing ones in warm colors; a dashed line marks a device budget.

# %% tags=["hide-input"]
_COLORS = {"weights": "#4c72b0", "grad_buffer": "#64b5cd", "master_params": "#8172b3",
           "optimizer_state": "#b39ddb", "fp32_grad_copies": "#999999",
           "activations": "#dd8452", "p2p_buffers": "#c44e52"}


def plot_ledgers(ledgers: dict, ax=None, budget_bytes: float | None = None, unit: float = 2**30,
                 unit_name: str = "GiB"):
    """Stacked horizontal bars, one per named RankLedger."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(ledgers)))
    names = list(ledgers)
    left = [0.0] * len(names)
    for term in DEVICE_TERMS:
        widths = [ledgers[n].device.get(term, 0) / unit for n in names]
        if any(widths):
            ax.barh(names, widths, left=left, color=_COLORS[term], label=term.replace("_", " "))
            left = [a + w for a, w in zip(left, widths)]
    if budget_bytes:
        ax.axvline(budget_bytes / unit, color="black", ls="--", lw=1)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit_name} per device")
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    return ax


# %% [markdown]
# ## The running example, worked
#
# TP 2 with SP, PP 2, DP 64, micro-batch 2, $m = 8$, bf16 with fp32 grads, the distributed
# optimizer, selective recompute — on a GPU, so flash attention and bool dropout masks (the
# model has no dropout anyway). Per GPU, from the code below:
#
# | | first stage | last stage |
# |---|---|---|
# | weights (bf16, padded param buffer) | 4,015,259,648 B | 4,015,267,840 B |
# | grad buffer (fp32) | 8,030,519,296 B | 8,030,535,680 B |
# | masters + Adam moments (this rank's 64th) | 376,430,592 B | 376,431,360 B |
# | **resident** | **12,422,209,536 B** | **12,422,234,880 B** |
# | activations at the peak | 22.01 GiB: 2 micro-batches in flight, in the first backward | 17.85 GiB: 1 in flight, in the logits chain |
#
# Megatron's estimate puts 12,422,222,208 B on "weights and optimizer" for *the* most loaded
# rank; the ledger is 12,672 B below it on the first stage and 12,672 B above it on the last
# (Megatron spreads the final norm evenly over the stages and ignores the padding). The
# activations differ much more: the ledger finds what this model keeps — a $4 f_t$ SwiGLU,
# GQA's smaller K and V, no dropout masks (07.3's table) — and adds the last stage's logits,
# which Megatron leaves out for $p > 1$.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.model.config import llama_7b_config

    example = MemoryConfig(llama_7b_config(sequence_parallel=True,
                                           recompute_granularity="selective"),
                           tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                           data_parallel_size=64, micro_batch_size=2, num_microbatches=8,
                           use_distributed_optimizer=True)
    first, last = stage_ledgers(example)
    megatron = megatron_theoretical_memory(megatron_args_from(example), 8)
    for led in (first, last):
        print(f"stage {led.pp_rank}: " + ", ".join(f"{k} {v / 2**30:.2f} GiB"
                                                   for k, v in led.device.items() if v)
              + f" | total {led.total / 2**30:.2f} GiB, peak at {led.peak['at']}, "
              f"{led.peak['max_in_flight']} in flight")
    print(f"Megatron: weights+optimizer {megatron['weight_and_optimizer'] / 2**30:.2f} GiB, "
          f"activations {megatron['activation'] / 2**30:.2f} GiB")
    assert (first.resident, last.resident) == (12_422_209_536, 12_422_234_880)
    assert first.resident - megatron["weight_and_optimizer"] == -12_672
    assert last.resident - megatron["weight_and_optimizer"] == 12_672
    assert last.device["activations"] > 0 and first.peak["max_in_flight"] == 2
    # the table above, to the printed digit: 22.01 and 17.85 GiB of activations at the peak
    assert [f"{led.device['activations'] / 2**30:.2f}" for led in (first, last)] == ["22.01",
                                                                                    "17.85"]

# %% [markdown]
# ## Where Megatron's estimate and the ledger part ways
#
# Page 07.1 listed what the estimate leaves out. On the running example, one switch at a time
# (activations only; Megatron's number is for the first stage, the ledger's for the stage
# that holds the most):
#
# - **CP 2** halves every per-token tensor on a rank; the estimate does not change.
# - **Full recompute** keeps one input per layer; the estimate falls back to its second
#   formula, which assumes all activations are kept.
# - **Interleaving** ($v = 2$): the estimate multiplies by $1 + (p-1)/(p v) = 1.25$; the replay
#   finds 5 half-stage chunks in flight on stage 0, the same 2.5 stage-equivalents.
# - **The last stage**: with $p > 1$ the estimate has no output layer or cross-entropy term;
#   the ledger's last stage peaks in the logits chain.

# %%
if __name__ == "__main__":
    def most_loaded(cfg):
        return max(stage_ledgers(cfg), key=lambda led: led.device["activations"])

    sp_sel = example.model
    variants = {"running example": example,
                "CP 2 (DP 32)": example.replace(context_parallel_size=2, data_parallel_size=32,
                                                num_microbatches=16),
                "full recompute": example.replace(model=sp_sel.replace(
                    recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)),
                "VPP 2": example.replace(virtual_pipeline_model_parallel_size=2)}
    print(f"{'':>18} {'Megatron':>10} {'ledger':>9}  (GiB of activations, most loaded stage)")
    for name, cfg in variants.items():
        meg = megatron_theoretical_memory(megatron_args_from(cfg), cfg.num_microbatches)
        led = most_loaded(cfg)
        print(f"{name:>18} {meg['activation'] / 2**30:>10.2f} "
              f"{led.device['activations'] / 2**30:>9.2f}  (stage {led.pp_rank}, "
              f"{led.peak['max_in_flight']} in flight)")
    cp2 = variants["CP 2 (DP 32)"]
    assert (megatron_theoretical_memory(megatron_args_from(cp2), 16)["activation"]
            == megatron_theoretical_memory(megatron_args_from(example), 8)["activation"])
    assert most_loaded(cp2).device["activations"] < 0.6 * first.device["activations"]
    assert stage_ledgers(variants["VPP 2"])[0].peak["max_in_flight"] == 5

# %% [markdown]
# ## What each dimension cuts
#
# Start from the 7B model on one GPU's share of a 256-GPU job with plain data parallelism
# (every rank holds everything), then switch on one mechanism at a time. Each bar is the
# ledger of the *most loaded* stage. The dashed line is the budget of an "80 GB" device:
# such a device reports its capacity in binary units, so the line sits at 80 GiB, the budget
# [07.9](calculator.py)'s search passes too, not at $80 \cdot 10^9$ B $= 74.5$ GiB. From PP 2
# on, the most loaded rank fits under it.
#
# | switch | what it divides |
# |---|---|
# | TP 2 | every matrix and its grads and optimizer state; the per-layer attention and MLP activations |
# | SP | the norms, dropout masks and residual-stream activations (not the linear inputs here) |
# | PP 2 | the layers, hence weights, grads and state; activations per micro-batch, but stage 0 now keeps 2 in flight |
# | DistOpt over DP 64 | masters and moments: 12 bytes per parameter become 12/64 |
# | selective recompute | with a flash kernel, only the logsumexp |
# | full recompute (uniform, 1 layer) | everything but each layer's input |

# %%
if __name__ == "__main__":
    steps = {"DP 256": example.replace(model=llama_7b_config(), tensor_model_parallel_size=1,
                                       pipeline_model_parallel_size=1, data_parallel_size=256,
                                       num_microbatches=2, use_distributed_optimizer=False)}
    steps["+ TP 2"] = steps["DP 256"].replace(tensor_model_parallel_size=2, data_parallel_size=128,
                                              num_microbatches=4)
    steps["+ SP"] = steps["+ TP 2"].replace(model=llama_7b_config(sequence_parallel=True))
    steps["+ PP 2"] = steps["+ SP"].replace(pipeline_model_parallel_size=2, data_parallel_size=64,
                                            num_microbatches=8)
    steps["+ DistOpt"] = steps["+ PP 2"].replace(use_distributed_optimizer=True)
    sp = steps["+ SP"].model
    steps["+ selective"] = steps["+ DistOpt"].replace(
        model=sp.replace(recompute_granularity="selective"))
    steps["+ full (uniform 1)"] = steps["+ DistOpt"].replace(model=sp.replace(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    worst = {name: max(stage_ledgers(c), key=lambda led: led.total) for name, c in steps.items()}
    for name, led in worst.items():
        print(f"{name:>20}: resident {led.resident / 2**30:6.1f} GiB, flowing "
              f"{led.flowing / 2**30:6.1f} GiB (stage {led.pp_rank})")
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=150)
    plot_ledgers(worst, ax, budget_bytes=80 * 2**30)
    ax.set_title("Each switch divides a different term; from PP 2 on, the 7B rank fits an "
                 "80 GiB device (dashed)", fontsize=8)
    fig.tight_layout()
    plt.show()
    totals = [led.total for led in worst.values()]
    assert totals[0] > totals[1] > totals[2] and totals[3] < totals[2]
    assert worst["+ DistOpt"].resident < worst["+ PP 2"].resident / 2
    assert worst["+ SP"].total > 80 * 2**30 > worst["+ PP 2"].total  # the caption's claim

# %% [markdown]
# ## Resident and flowing, closed
#
# The front page's first thread ends here. On the running example the **resident** part —
# weights, grads, masters, moments — is about 12 GB per GPU and does not depend on the batch:
# TP and PP divide it, the distributed optimizer removes most of the optimizer's share, and
# the fp32 grad buffer (8 GB) is now the largest single term. The **flowing** part scales with
# micro-batch size, sequence length and the number of micro-batches the schedule keeps in
# flight; SP, CP and recompute divide it, and interleaving multiplies it. Every memory trick
# in this book moves bytes across that border: recompute turns kept activations into
# recomputed ones, offload turns device bytes into host bytes, ZeRO turns replicated state into
# sharded state.
#
# ## How production does it
#
# - Megatron: `megatron/training/theoretical_memory_usage.py` (the estimate),
#   `megatron/training/training.py` (calls `report_memory`,
#   `megatron/training/utils/common_utils.py:282`, after the first iterations: allocator
#   statistics next to the estimate).
# - PyTorch: `torch.cuda.memory_stats`, `torch.cuda.memory._record_memory_history` and the
#   memory snapshot viewer show allocations by stack trace — the measured side of this ledger.
#
# ## Exercises
#
# 1. Where does the last stage's peak happen in the running example, and which single change
#    (a fused cross-entropy that never materializes fp32 logits) would lower it most?
#
#    <details><summary>Answer</summary>
#
#    In the forward of micro-batch 0, inside the logits
#    chain: its one micro-batch keeps 12.93 GiB (1.96 GiB of it the fp32 softmax the head keeps
#    for backward) and the chain adds 4.92 GiB, 17.85 GiB in all. A fused cross-entropy removes
#    the chain and, if it never keeps fp32 logits either, the softmax: up to about 6.9 GiB,
#    leaving stage 0's 22.01 GiB further ahead.
#
#    </details>
#
# 2. Switch the running example to interleaving with $v = 2$. Which stage becomes the most
#    loaded, and by how much?
#
#    <details><summary>Answer</summary>
#
#    Stage 0 stays the most loaded: its activations go from
#    22.01 to 27.45 GiB (5 half-stage chunks in flight, Megatron's factor 1.25), its total from
#    33.58 to 39.02 GiB. Stage 1 grows too, from 29.42 to 34.89 GiB, with 3 chunks in flight
#    and its peak still in the logits chain.
#
#    </details>

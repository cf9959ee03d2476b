# %% [markdown]
# # 07.13 · Memory: the step in time — what stays exposed
#
# [07.10](step_compute.py) timed the compute, [07.11](step_overlap.py) gave four transfers
# their windows by Megatron's rules and [07.12](step_offload.py) the fifth, offload, against
# one layer's compute. This page puts the step together: `estimate_step` applies the five
# rules to every stage and keeps, per item, what sticks out. The running example then reads
# item by item. The next page ([07.14](step_published.py)) holds the model against
# Megatron's published H100 throughput and against real runs of the trainer on this machine.
#
# You will build: `StepItem`, `StepTime`, `tp_layer_seconds`, `optimizer_seconds` and
# `estimate_step`.

# %%
from __future__ import annotations

from dataclasses import dataclass, field, replace

from tinytron.kernels.roofline import gemm_seconds
from tinytron.memory._layout_cache import LAYOUT_CACHE, layout_key
from tinytron.memory.states import MemoryConfig
from tinytron.memory.step_compute import (STREAM_BYTES, Links, StepOptions, _pieces,
                                          collective_seconds, layer_gemms, stage_compute,
                                          stage_flops, stage_kernel_seconds)
from tinytron.memory.step_overlap import (aligned_gather_exposed, all_gather_exposed,
                                          checkpoint_bytes, checkpoint_items, dp_buckets,
                                          p2p_seconds, pipeline_seconds, reduce_scatter_exposed,
                                          schedule_1f1b)
from tinytron.memory.step_offload import (OFFLOAD_MODULES, best_offload_modules, layer_seconds,
                                          offload_exposed, offload_table)

__all__ = ["Links", "StepOptions", "StepItem", "StepTime", "stage_flops", "stage_compute",
           "collective_seconds",
           "dp_buckets", "reduce_scatter_exposed", "all_gather_exposed", "p2p_seconds",
           "pipeline_seconds", "checkpoint_items", "offload_table", "best_offload_modules",
           "estimate_step", "schedule_1f1b", "optimizer_seconds", "layer_seconds",
           "checkpoint_bytes", "offload_exposed", "OFFLOAD_MODULES", "STREAM_BYTES",
           "layer_gemms", "stage_kernel_seconds", "aligned_gather_exposed", "tp_layer_seconds"]

# %% [markdown]
# ## The step: compute plus what stays exposed
#
# `estimate_step` applies the five rules to every stage and keeps, per item, the transfer's
# seconds, its window and what sticks out. TP's all-reduces (and SP's all-gathers and
# reduce-scatters, the same bytes) run on the compute stream between the GEMMs that need
# them: exposed in full unless Transformer Engine's `tp_comm_overlap` is on
# (`megatron/core/model_parallel_config.py:184`, off by default). CP's K/V exchange is
# counted the same way (Transformer Engine overlaps its ring with the attention blocks; not
# modeled). The optimizer step streams its state once: per stepped element the fp32 gradient,
# the fp32 master and the moments read and written, and the bf16 parameter written, at
# `memory` bandwidth. A save's exposed seconds are spread over its `save_interval` steps.
#
# The result is a `StepTime`: the compute, the bubble and the optimizer, and one `StepItem`
# per transfer with its seconds alone, its window and its exposed part (per stage where the
# rule is per stage, and the spans of the first stage's buckets for the drawing). `total` is
# the sum that the calculator's search ranks by.
#
# Why stage 1's one bucket hides behind slack in the running example: its last backward
# ends 117 ms (stage 0's last backward) before the step's backward does, and its 40 ms
# reduce-scatter fits in that. Megatron's comment says the same in words: data-parallel
# communication of later stages is "not on the critical path".

# %%
@dataclass
class StepItem:
    """One transfer: its seconds, the window it can hide in, what stays exposed (per step)."""

    item: str
    seconds: float
    window: float
    exposed: float
    spans: list = field(default_factory=list)
    """(start, end) of each bucket on the first stage, for the drawing."""
    per_stage: list = field(default_factory=list)
    """Exposed seconds on each pipeline stage, where the rule is per stage."""


@dataclass
class StepTime:
    """The step of a layout: compute, bubble, optimizer and the items, all in seconds."""

    compute: float
    bubble: float
    optimizer: float
    items: list[StepItem]

    @property
    def exposed(self) -> float:
        """Seconds of transfers not hidden behind compute."""
        return sum(i.exposed for i in self.items)

    @property
    def total(self) -> float:
        """Seconds per iteration."""
        return self.compute + self.bubble + self.optimizer + self.exposed

    def item(self, name: str) -> StepItem:
        """The item whose name starts with `name`."""
        return next(i for i in self.items if i.item.startswith(name))

# %% [markdown]
# <details><summary>Megatron detail: where each rule lives (all at e03878b5f)</summary>
#
# | rule | code |
# |---|---|
# | grad sync only in the last micro-batch | `megatron/core/pipeline_parallel/schedules.py:741-742`, `:2384`, `:2411`, `:2428` |
# | a parameter counts as ready only then | `megatron/core/distributed/param_and_grad_buffer.py:800-822` |
# | buckets in reverse order, default size | `megatron/core/distributed/param_and_grad_buffer.py:915`, `distributed_data_parallel.py:69` |
# | one bucket on later pipeline stages | `megatron/core/distributed/distributed_data_parallel.py:95-106` |
# | all-gather waited for by the pre-hook, next one dispatched | `distributed_data_parallel.py:413-447`, `param_and_grad_buffer.py:494-529` |
# | p2p shapes with SP; blocking unless `overlap_p2p_comm` | `schedules.py:2080-2085`, `:2123-2126`; `model_parallel_config.py:304-312` |
# | TP traffic on the compute stream unless `tp_comm_overlap` | `megatron/core/model_parallel_config.py:184` |
# | warm-up and cool-down p2p blocking even with `overlap_p2p_comm` | `schedules.py:1575-1672`, `:1896-2011`; warm-up count `:891-892` |
# | aligned chunk gathers with virtual stages | `schedules.py:1161-1163`, `:1283-1296` |
# | the checkpoint's blocking copy | `megatron/core/dist_checkpointing/strategies/async_utils.py:264-273` |
# | offload's modules | `megatron/core/transformer/transformer_config.py:1127-1146` |
#
# </details>
#
# What the model leaves out, on purpose: the data loader (chapter 04 prefetches it), kernel
# launch gaps, the scalar all-reduces of the step (gradient norm, found-inf, the logged loss:
# microseconds on a GPU network), stragglers (a step waits for the slowest rank), and
# contention between a transfer and the compute beyond the `interference` input. Each is
# small on a healthy GPU cluster; 07.14's CPU check shows what they add on a crowded CPU.

# %% [markdown]
# The DP rules per stage: the reduce-scatter of stage $s$ has its last backward plus the
# backwards of the stages below it as window; the all-gather's exposed parts add up along
# the pipeline's fill, since every stage's first forward lies on it.

# %%
def _stage_gather(cfg: MemoryConfig, links: Links, options: StepOptions, buckets: list[dict],
                  forward: float, s: int, num_stages: int, dp: int, bw: float,
                  aligned: bool) -> tuple[float, float, list]:
    """One stage's parameter all-gather: (exposed, seconds, spans), by rule 2 or aligned."""
    order = buckets[::-1]
    ag = [collective_seconds("all_gather", b["numel"] * cfg.param_bytes, dp, bw,
                             links.latency) for b in order]
    exposed, spans = all_gather_exposed(ag, [b["share"] * forward for b in order],
                                        options.overlap_param_gather)
    if aligned:
        per_chunk = [sum(a for a, b in zip(ag, order) if b["chunk"] == c)
                     for c in range(cfg.num_chunks)]
        exposed = aligned_gather_exposed(per_chunk, forward / cfg.num_chunks, num_stages, s)
    return exposed, sum(ag), spans

# %% [markdown]
# `_dp_items` runs both rules stage by stage and keeps, per item, the longest transfer and
# what each stage leaves exposed.

# %%
def _dp_items(cfg: MemoryConfig, links: Links, options: StepOptions,
              stages: list[tuple[float, float]]) -> list[StepItem]:
    """The gradient reduce-scatter (or all-reduce) and the parameter all-gather."""
    dp, stride = cfg.data_parallel_size * cfg.context_parallel_size, cfg.tensor_model_parallel_size
    bw = links.link(stride * dp, min(dp, links.gpus_per_node // stride))
    distopt = cfg.use_distributed_optimizer
    kind = "all_reduce" if (not distopt or links.reduce_scatter_as_all_reduce) else "reduce_scatter"
    rs_seconds, rs_spans, ag_seconds, ag_spans, rs_stage, ag_stage = 0, [], 0, [], [], []
    aligned = cfg.num_chunks > 1 and options.overlap_param_gather and options.align_param_gather
    if cfg.overlap_grad_reduce != options.overlap_grad_reduce:  # it decides the buckets
        cfg = cfg.replace(overlap_grad_reduce=options.overlap_grad_reduce)
    for s, (forward, backward) in enumerate(stages):
        buckets = dp_buckets(cfg, s)
        times = [collective_seconds(kind, b["numel"] * cfg.grad_bytes, dp, bw, links.latency)
                 for b in buckets]
        slack = sum(b for _, b in stages[:s])
        exposed, spans = reduce_scatter_exposed(times, [b["ready"] for b in buckets], backward,
                                                slack, options.overlap_grad_reduce)
        rs_stage.append(exposed)
        rs_seconds = max(rs_seconds, sum(times))
        rs_spans = rs_spans or spans
        if distopt:
            exposed, seconds, spans = _stage_gather(cfg, links, options, buckets, forward, s,
                                                    len(stages), dp, bw, aligned)
            ag_stage.append(exposed)
            ag_seconds = max(ag_seconds, seconds)
            ag_spans = ag_spans or spans
    items = [StepItem(f"DP grad {kind.replace('_', '-')}", rs_seconds, stages[0][1],
                      max(rs_stage), rs_spans, rs_stage)]
    if distopt:
        items.append(StepItem("DP param all-gather", ag_seconds, stages[0][0],
                              max(ag_stage) if aligned else sum(ag_stage), ag_spans, ag_stage))
    return items


# %% [markdown]
# The model-parallel items come from the pipeline formula of rule 3 and the TP and CP
# traffic per layer and micro-batch: with TP each layer does two all-reduce-sized exchanges
# of one activation ($P \cdot s/c \cdot b \cdot h$ bytes) in its forward and two in its
# backward, two more when full recompute repeats the forward; CP gathers the K/V heads of
# every layer forward and reduce-scatters their gradients backward. The optimizer's time
# counts the elements the rank steps (its shard with the distributed optimizer).

# %%
def _model_parallel_items(cfg: MemoryConfig, links: Links, options: StepOptions,
                          stages: list[tuple[float, float]]) -> tuple[dict, list[StepItem]]:
    """The pipeline (compute, bubble, p2p) and the TP and CP traffic on the compute stream."""
    m, t, c = cfg.model, cfg.tensor_model_parallel_size, cfg.context_parallel_size
    mb, layers = cfg.num_microbatches, m.num_layers // cfg.pipeline_model_parallel_size
    tau = p2p_seconds(cfg, links)
    pipe = pipeline_seconds(stages, mb, cfg.num_chunks, tau, options.overlap_p2p_comm)
    tp_seconds, tp_exposed = (mb * layers * x for x in tp_layer_seconds(cfg, links, options))
    kv = 2 * cfg.param_bytes * m.seq_length * cfg.micro_batch_size * m.num_query_groups \
        * m.head_dim // t
    cp = mb * layers * 2 * collective_seconds("all_gather", kv, c, links.link(t * c), links.latency)
    items = [StepItem("TP all-reduce" if not options.tp_comm_overlap else "TP (tp_comm_overlap)",
                      tp_seconds, 0.0, tp_exposed), StepItem("CP K/V exchange", cp, 0.0, cp),
             StepItem("PP p2p", 2 * (mb * cfg.num_chunks + cfg.pipeline_model_parallel_size - 2)
                      * tau if cfg.pipeline_model_parallel_size > 1 else 0.0, 0.0, pipe["p2p"])]
    return pipe, items

# %% [markdown]
# TP's traffic per layer and micro-batch: all-reduce-sized exchanges on the compute stream,
# or, with `tp_comm_overlap`, only what each exchange exceeds its GEMM piece by.

# %%
def tp_layer_seconds(cfg: MemoryConfig, links: Links,
                     options: StepOptions) -> tuple[float, float]:
    """(seconds, exposed seconds) of one layer's TP traffic for one micro-batch."""
    m, t, c = cfg.model, cfg.tensor_model_parallel_size, cfg.context_parallel_size
    unit = cfg.param_bytes * (m.seq_length // c) * cfg.micro_batch_size * m.hidden_size
    ops = 6 if cfg.recompute_granularity == "full" else 4  # forward 2, backward 2, recompute 2
    gather = collective_seconds("all_gather", unit, t, links.link(t), links.latency)
    seconds = ops * 2 * gather  # an all-reduce moves an all-gather and a reduce-scatter
    if not options.tp_comm_overlap or t == 1 or links.law is None:
        return seconds, seconds
    exposed = 0.0  # each gather or reduce-scatter rides inside its GEMM, one piece per rank
    for name, mm, nn, kk in layer_gemms(cfg):
        forward, dgrad = (p * gemm_seconds(mm // p, a, b, links.law)
                          for p, a, b in zip(_pieces(name, t), (nn, kk), (kk, nn)))
        exposed += (ops // 2 - 1) * max(0.0, gather - forward) + max(0.0, gather - dgrad)
    return seconds, exposed

# %% [markdown]
# The optimizer step streams its state once: per stepped element the grad, the fp32 master
# and moments read and written, and the bf16 weight written back.

# %%
def optimizer_seconds(cfg: MemoryConfig, links: Links = Links()) -> float:
    """One optimizer step of a first-stage rank, streaming its state once at `memory` bandwidth."""
    from tinytron.memory.states import _MOMENTS, state_ledger

    key = ("states",) + layout_key(cfg, 0) + (cfg.optimizer_cpu_offload,
                                              cfg.optimizer_offload_fraction)
    if key not in LAYOUT_CACHE:
        LAYOUT_CACHE[key] = state_ledger(cfg, 0)
    states = LAYOUT_CACHE[key]
    elements = (states["master_params"] + states["optimizer_state"]) \
        / 4 / (1 + _MOMENTS[cfg.optimizer]) if cfg.bf16 else states["optimizer_state"] / 4 \
        / _MOMENTS[cfg.optimizer]
    per_element = cfg.grad_bytes + 8 * (1 + _MOMENTS[cfg.optimizer]) + (cfg.param_bytes if cfg.bf16
                                                                        else 0)
    return elements * per_element / links.memory


# %% [markdown]
# `estimate_step` puts it together. The exposed part of a save is divided by the save
# interval, so the step it reports is the average step of a long run. The interference term
# (zero by default) charges the compute for every second of DP traffic that was hidden.
# Worked: 100 ms of compute hiding a 30 ms all-reduce with `interference` 0.4 costs
# 100 + 0.4 · 30 = 112 ms — on a CPU, where gloo's thread takes a core the compute wanted,
# that is the order of what the check measures; on a GPU it would be a few percent.

# %%
def estimate_step(cfg: MemoryConfig, links: Links = Links(),
                  options: StepOptions = StepOptions()) -> StepTime:
    """Seconds of one iteration: compute, bubble, optimizer and each item's exposed part."""
    stages = stage_compute(cfg, links, options)
    pipe, items = _model_parallel_items(cfg, links, options, stages)
    items = _dp_items(cfg, links, options, stages) + items
    layers = cfg.model.num_layers // cfg.pipeline_model_parallel_size
    off = offload_exposed(cfg, links, layers)
    if cfg.model.fine_grained_activation_offloading:
        items.append(StepItem("offload copies", off, 0.0, off))
    hidden = sum(i.seconds - i.exposed for i in items if i.item.startswith("DP"))
    if links.interference and hidden > 0:
        items.append(StepItem("compute lost to hidden DP traffic", hidden, 0.0,
                              links.interference * hidden))
    step = StepTime(pipe["compute"], pipe["bubble"], optimizer_seconds(cfg, links), items)
    for c in checkpoint_items(cfg, links, options, step.total, pipe["compute"]):
        items.append(StepItem(c["item"], c["seconds"] / options.save_interval,
                              c["window"] / options.save_interval,
                              c["exposed"] / options.save_interval))
    return step

# %% [markdown]
# ## Demo: the running example, item by item
#
# The model on the running example with Megatron's switches on (`overlap_grad_reduce`,
# `overlap_param_gather`, a blocking save every 500 steps, all three as the running example's
# `configs/llama7b_tp2_pp2_dp64.toml` sets them). First the four rows of the
# back-of-envelope [07.10](step_compute.py) started from, recomputed: each transfer, its
# window by the rules of [07.11](step_overlap.py), and what stays exposed.
# Each row is one transfer of one stage; "time" is the transfer alone on its link, "window"
# is what the rule lets it hide behind (for stage 1's reduce-scatter: its own last backward
# plus stage 0's, the slack), "exposed" is what the step pays. Below the table the whole
# step: compute is the slowest stage's eight micro-batches, the bubble what the pipeline's
# fill and drain add, then each item.

# %%
if __name__ == "__main__":
    from tinytron.memory.calculator import running_example

    example = running_example().replace(overlap_grad_reduce=True)
    links, options = Links(), StepOptions(save_interval=500)  # as in its config file
    step = estimate_step(example, links, options)
    (f0, b0), (f1, b1) = stage_compute(example, links)
    rs, ag = step.item("DP grad"), step.item("DP param")
    ckpt = checkpoint_items(example, links, options, step.total, step.compute)[0]
    staged = checkpoint_items(example, links, replace(options, checkpoint="staged"),
                              step.total, step.compute)[0]
    everything = offload_table(example, links)[-1]
    print(f"{'item':<42}{'time':>9}{'window':>10}{'exposed':>10}")
    for name, t, w, e in (
            ("grad reduce-scatter, stage 0 (7.9 GB fp32)", rs.seconds, b0, rs.per_stage[0]),
            ("grad reduce-scatter, stage 1 (one bucket)", rs.seconds, b1 + b0, rs.per_stage[1]),
            ("param all-gather, stage 0", ag.seconds, f0, ag.per_stage[0]),
            ("param all-gather, stage 1 (one bucket)", ag.seconds, f1, ag.per_stage[1]),
            ("checkpoint D2H, blocking (per save)", ckpt["seconds"], 0.0, ckpt["exposed"]),
            ("checkpoint D2H, staged (per save)", staged["seconds"], staged["window"],
             staged["exposed"]),
            ("offload, all five modules (per layer)", everything["copy"],
             everything["forward"], everything["copy"] - everything["forward"])):
        print(f"{name:<42}{t * 1e3:>7.1f}ms{w * 1e3:>8.1f}ms{e * 1e3:>8.1f}ms")
    print(f"step {step.total:.3f} s = compute {step.compute:.3f} + bubble {step.bubble:.3f} "
          f"+ optimizer {step.optimizer * 1e3:.2f} ms + exposed {step.exposed * 1e3:.1f} ms")
    for i in step.items:
        print(f"  {i.item:<32} {i.seconds * 1e3:8.2f} ms, exposed {i.exposed * 1e3:7.2f} ms")

# %% [markdown]
# What the table says, row by row:
#
# - **The reduce-scatter fits its window, and still sticks out.** Stage 0's 7.9 GB of fp32
#   gradients take 40 ms against a last backward of 117 ms — yet 6 ms are exposed. The rule
#   is bucket by bucket: the last bucket in backward order is the input embedding alone
#   (128,256 / 2 × 4096 = 263 M elements; the tied table gets a bucket of its own), and its
#   gradient is the last one the backward produces. Its 5 ms, plus the queue in front of it,
#   can only start when there is nothing left to hide behind. Stage 1's single bucket starts
#   later still, but it has stage 0's whole last backward as slack: hidden.
# - **The all-gather has the opposite problem on stage 1.** One bucket (Megatron's choice for
#   every stage but the first, made for the reduce-scatter) means its first forward waits for
#   the whole gather: 17 ms exposed. Stage 0 waits only for its first bucket, the embedding
#   again (3 ms). Together 20 ms, more than the reduce-scatter leaves exposed.
# - **The checkpoint's copy** is 9 ms per save per rank: blocking, 0.02 ms per step at one save
#   every 500 steps; staged, nothing. The write (440 MB at 1 GB/s) hides easily in 500 steps.
# - **Offloading all five modules** (rule 5, [07.12](step_offload.py)) would move 176 MiB
#   per layer and micro-batch each way: 3.7 ms against a 3.5 ms forward, just too slow. The
#   example's config leaves offload off; a run that set the four modules that fit would pay
#   nothing for them, as the last assert checks.
#
# In total the model gives 1.94 s per step, of which 0.12 s is exposed transfer — TP's
# collectives (76 ms, on the compute stream: the example's config leaves `tp_comm_overlap`
# off), the all-gather (20 ms), the p2p (11 ms) and the reduce-scatter's last bucket (6 ms)
# — and 0.17 s pipeline bubble. With `tp_comm_overlap` the TP traffic hides inside its GEMMs,
# which run in two pieces each and slow by 0.2%: 1.86 s, the number 07.9's search quotes.

# %%
if __name__ == "__main__":
    assert 0.3 < rs.seconds / b0 < 0.4 and 0.1 < rs.per_stage[0] / rs.seconds < 0.25
    assert rs.per_stage[1] == 0.0 and ag.per_stage[1] > 0.8 * ag.seconds > ag.per_stage[0]
    assert ckpt["exposed"] == ckpt["seconds"] and staged["exposed"] == 0.0
    assert everything["copy"] > everything["forward"] and not everything["hides"]
    assert abs(step.total - (step.compute + step.bubble + step.optimizer + step.exposed)) < 1e-12
    assert 1.9 < step.total < 2.0 and step.exposed / step.total < 0.1
    overlapped = estimate_step(example, links, replace(options, tp_comm_overlap=True))
    assert 1.8 < overlapped.total < step.total - 0.05
    naive = step.compute + step.bubble + sum(i.seconds for i in step.items)  # nothing hidden
    assert step.total < naive - 0.03
    fitted = example.model.replace(fine_grained_activation_offloading=True,
                                   offload_modules=best_offload_modules(example, links))
    assert estimate_step(example.replace(model=fitted), links, options).item("offload").exposed == 0

# %% [markdown]
# Each item drawn twice: the transfer alone on its link, and what the step pays for it.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    shown = [i for i in step.items if i.seconds > 1e-4][::-1]
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ys = range(len(shown))
    ax.barh([y + 0.2 for y in ys], [i.seconds * 1e3 for i in shown], 0.4, color="0.75",
            label="the transfer alone")
    ax.barh([y - 0.2 for y in ys], [i.exposed * 1e3 for i in shown], 0.4, color="tab:red",
            label="exposed in the step")
    ax.set_yticks(list(ys), [i.item for i in shown], fontsize=8)
    ax.set(xlabel="ms per step")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    tp = step.item("TP")
    assert tp.exposed == tp.seconds and tp.exposed > step.exposed / 2

# %% [markdown]
# *Figure:* what a transfer costs is set by its window, not its size — TP's traffic, which
# has no window without `tp_comm_overlap`, is most of the 0.12 s the step pays, while twice
# its DP bytes hide all but a few milliseconds or, on stage 1's one bucket, a third.

# %% [markdown]
# ## Measured on a GPU
#
# `bash scripts/gpu_check.sh 1` times the ~1B trainer on one GPU (`configs/gpt_1b.toml`, 16
# sequences of 2048 tokens per iteration), and the model predicts the same layout with
# appendix C's kernel law of that GPU and the run's own options: on one GPU nothing is
# exposed, so the error is how far the law's GEMM, attention and bandwidth fractions are from
# what the kernels achieved. With two or more GPUs, `bash scripts/gpu_check.sh 2` also traces
# the DP 2 and PP 2 runs of 07.14's CPU check over NCCL. `chapters/_gpu_results.py` renders
# the tables from `benchmarks/results/gpu/<device>.json`.

# %%
if __name__ == "__main__":
    from tinytron._gpu_results import gpu_table

    print(gpu_table("step_time"))

# %% [markdown]
# ## Summary
#
# - `estimate_step` applies the five rules (four on [07.11](step_overlap.py), offload on
#   [07.12](step_offload.py)) to every stage: compute + bubble + optimizer + what each
#   transfer cannot hide.
# - For the running example the rules leave 0.12 s of 1.94 s exposed, most of it TP's
#   traffic on the compute stream; among DP items the later stage's one-bucket all-gather
#   exposes more than the reduce-scatter.
# - The layouts' ranking (07.9's search) changes with the rules: without a pipeline there is
#   no bubble and no one-bucket all-gather, so PP1 layouts that fit come first.
#
# ## How production does it
#
# - Megatron-LM has no step-time model; its timers (chapter 08) measure the phases.
# - torchtitan stages the checkpoint's copy (`maybe_wait_for_staging`) and leaves the layout
#   to the user; NeMo's auto-configurator ranks layouts by short profiling runs.
#
# <details><summary>Megatron detail: where tinytron differs</summary>
#
# The staged checkpoint copy of rule 4 is tinytron's (chapter 03), Megatron blocks for the
# copy before it forks its writer; the played 1F1B schedule and the closed form are this
# book's, Megatron's schedules only run; and the rules are read from Megatron's code as it is
# at `e03878b5f`, including its choice of one bucket on later pipeline stages, which the
# model shows costs the running example's all-gather most of its overlap.
#
# </details>
#
# ## Exercises
#
# 1. Halve `Links.network`. Which window does the reduce-scatter miss first, and what does
#    `bucket_size` do to the exposed part?
#
#    <details><summary>Answer</summary>
#
#    At 25 GB/s stage 0's reduce-scatter takes 79 ms
#    against its 117 ms last backward and exposes 14.1 ms instead of 6.3: the window it misses
#    is the last bucket's, the embedding's, which has no backward left behind it. Stage 1's
#    one bucket still hides in its 252 ms of slack. The step grows from 1.935 to 1.978 s.
#    Buckets of 10 M elements bring the reduce-scatter down to 12.1 ms but expose 13.2 ms of
#    stage 0's all-gather instead of 7.1 (1.982 s); 400 M leave 26.9 ms exposed (1.995 s).
#    The default, 40 M, is the best of the three.
#
#    </details>
#
# 2. Give every pipeline stage the first stage's buckets (`bucket_size` on all ranks): how
#    much of stage 1's all-gather hides, and what does that cost the reduce-scatter?
#
#    <details><summary>Answer</summary>
#
#    With `bucket_size_for` giving stage 1 stage 0's size
#    (18 buckets on each), stage 1's all-gather exposes 0.55 ms instead of 17.2: nearly all of
#    it hides, and the DP all-gather item drops from 20.4 to 3.7 ms. The reduce-scatter costs
#    nothing: stage 1's buckets still hide in stage 0's backward (0 ms exposed). Only the
#    interference term grows, 3.95 to 5.97 ms, with the extra hidden traffic. The step: 1.935
#    to 1.921 s.
#
#    </details>
#
# 3. Turn on interleaving (`virtual_pipeline_model_parallel_size=2`) with
#    `overlap_p2p_comm`: how much of the p2p and of the bubble goes away?
#
#    <details><summary>Answer</summary>
#
#    The bubble halves, 174 to 87 ms ($v = 2$ divides it).
#    The p2p first doubles, 10.7 to 21.5 ms exposed (twice the sends, still blocking); with
#    `overlap_p2p_comm` 5.4 ms of it stays, the warm-up and cool-down sends, which block
#    anyway. The DP items gain too (all-gather 20.4 to 11.2 ms, reduce-scatter 6.3 to
#    1.2 ms). The step: 1.935 s, then 1.846 s with interleaving, 1.830 s with both.
#
#    </details>
#
# 4. Stage the checkpoint (`StepOptions(checkpoint="staged")`) and set `save_interval` to 1:
#    which of the copy and the write is exposed now, and by how much?
#
#    <details><summary>Answer</summary>
#
#    Neither: the 8.8 ms copy hides in the next step's
#    1.643 s of compute and the 439 ms write in the 1.935 s step, so the step stays 1.935 s.
#    Blocking at the same interval would pay the whole copy every step: 1.944 s.
#
#    </details>

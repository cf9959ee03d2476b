# %% [markdown]
# # 01 · Resident and flowing memory, measured over one iteration
#
# The front page promised a thread through the book: **resident** memory (parameters,
# gradients, optimizer state) is allocated once and only zeroed between steps; **flowing**
# memory (activations, pipeline messages, temporaries) is created by every micro-batch's
# forward and freed by its backward. This page measures both, operator by operator, over one
# real `train_step` of the three schedules — no pipelining, 1F1B and interleaved 1F1B — on
# small gloo worlds, with the [live-bytes meter](memory_meter.py). Chapter 07 takes the
# ledger from here.

# %%
from __future__ import annotations

__all__ = ["BYTES_PER_PARAM", "resident_bytes_per_param", "flowing_series", "plot_iteration"]

# %% [markdown]
# ## What is resident, byte by byte
#
# Per parameter, for the configurations this book uses (Megatron's accounting,
# `megatron/training/theoretical_memory_usage.py`):
#
# | what | fp32 training, plain Adam (the demo below) | bf16 + fp32 main grads + DistributedOptimizer over $d$ ranks |
# |---|---|---|
# | parameters | 4 B (they are their own master copy) | 2 B (bf16, in DDP's param buffer) |
# | gradients | 4 B (DDP's contiguous `main_grad` buffer) | 4 B (fp32 `main_grad`, full size on every rank) |
# | optimizer state | 8 B (Adam's `exp_avg`, `exp_avg_sq`) | $12/d$ B (fp32 master + two moments, sharded) |
# | **total** | **16 B** | $6 + 12/d$ B |
#
# The running example (TP 2 · PP 2 · DP 64): each GPU holds about $2.008 \cdot 10^9$ of the
# 7.5 B parameters (`count_parameters_per_rank`), so its resident memory is
# $2.008 \cdot 10^9 \cdot (6 + 12/64)$ B $= 11.6$ GiB: 3.7 GiB of bf16 weights, 7.5 GiB of fp32
# gradients and 0.35 GiB of optimizer state. None of it depends on the batch, the sequence
# length or the schedule.
#
# ## What flows
#
# Everything else a step allocates is flowing: the activations autograd saves in each forward
# (freed by that micro-batch's backward), the `[s, b, h]` tensors a pipeline stage sends and
# receives, the logits and the loss on the last stage, and the optimizer's temporaries. How
# much is alive *at once* is what the schedule decides:
#
# - **no pipelining**: one micro-batch of the whole model at a time (forward, then its
#   backward);
# - **1F1B**: stage $r$ of $p$ holds at most $p - r$ micro-batches of its layers;
# - **interleaved**: more micro-batch *chunks* in flight for the same stage, about
#   $1 + \frac{p-1}{p v}$ times 1F1B's activations on the first stage (chapter 07).
#
# The measurement: build the model and run one warm-up step (so Adam's state exists, as in
# every later iteration), then run one more `train_step` inside a `LiveBytesMeter` that also
# tracks the resident tensors. The resident bytes are a flat floor; flowing = live − resident.

# %%
BYTES_PER_PARAM = {"fp32 + Adam": 4 + 4 + 8}


def resident_bytes_per_param(param_bytes: int, grad_bytes: int, dp: int,
                             distributed_optimizer: bool = True) -> float:
    """Bytes per parameter that live all run: params + grads + (fp32 master, m, v) [/ dp]."""
    master = 4 if param_bytes != 4 else 0          # fp32 params are their own master copy
    state = master + 8
    return param_bytes + grad_bytes + (state / dp if distributed_optimizer else state)


def flowing_series(run: dict, t_ref: float) -> tuple[list[float], list[float]]:
    """(ms since t_ref, flowing MiB) from a memory_timeline result."""
    resident = sum(run["resident"].values())
    xs = [1e3 * (run["t0"] + t - t_ref) for t, _ in run["timeline"]]
    ys = [(b - resident) / 2 ** 20 for _, b in run["timeline"]]
    return xs, ys

# %% [markdown]
# The picture: one panel per (schedule, stage). The gray band is the resident floor, the
# colored area the flowing bytes on top of it, and the strip underneath the forward (blue)
# and backward (orange) of each micro-batch as the schedule ran them (chunk 1 of the
# interleaved schedule hatched). All stages of one schedule share one clock.

# %%
def _spans(ax, run: dict, t_ref: float, y: float, h: float) -> None:
    """The stage's forward/backward spans as a strip at height y."""
    for chunk, mb, kind, start, end in run["events"]:
        x0, x1 = 1e3 * (run["t0"] + start - t_ref), 1e3 * (run["t0"] + end - t_ref)
        ax.broken_barh([(x0, x1 - x0)], (y, h), facecolors="tab:blue" if kind == "forward"
                       else "tab:orange", hatch="//" if chunk else None, edgecolor="white")
        ax.text((x0 + x1) / 2, y + h / 2, str(mb), ha="center", va="center", fontsize=6)


def plot_iteration(panels: list[tuple[str, dict, float]], ymax: float):
    """Stacked resident + flowing MiB over time, one axis per (title, run, shared t_ref)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.9 * len(panels)), sharey=True)
    for ax, (title, run, t_ref) in zip(axes, panels):
        xs, ys = flowing_series(run, t_ref)
        floor = sum(run["resident"].values()) / 2 ** 20
        ax.fill_between(xs, 0, floor, color="0.8", step="post", label="resident")
        ax.fill_between(xs, floor, [floor + y for y in ys], step="post", color="tab:green",
                        alpha=0.6, label="flowing")
        _spans(ax, run, t_ref, -0.16 * ymax, 0.12 * ymax)
        ax.set_ylim(-0.18 * ymax, ymax)
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylabel("MiB")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("ms since the iteration began")
    fig.tight_layout()
    return fig

# %% [markdown]
# ## Demo: three schedules, one iteration each
#
# The tiny GPT with 4 layers ($h = 64$, $s = 128$, micro-batch 2, 4 micro-batches, fp32,
# Adam): 1F1B and interleaved ($v = 2$) on a 2-rank gloo world, each stage measured on its own
# rank, then no pipelining on rank 0 alone (`tinytron.main_loop._loop_workers.memory_timelines_pp2`).

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    from tinytron.launch import run_on_ranks
    from tinytron.main_loop._loop_workers import memory_timelines_pp2

    ranks = run_on_ranks(memory_timelines_pp2, 2, 4, timeout=300)
    single = ranks[0]["none"]
    runs = [("no pipelining", single)] + [(f"{k}, stage {r[k]['stage']}", r[k])
                                          for k in ("1F1B", "interleaved") for r in ranks]
    print(f"{'schedule, stage':<24}{'params':>10}{'resident B':>12}{'B/param':>9}"
          f"{'peak flowing':>14}{'flowing after':>15}")
    for name, run in runs:
        res = sum(run["resident"].values())
        print(f"{name:<24}{run['num_params']:>10,}{res:>12,}{res / run['num_params']:>9.1f}"
              f"{run['peak'] - res:>14,}{run['end'] - res:>15,}")
    t_ref = {k: min(r[k]["t0"] for r in ranks) for k in ("1F1B", "interleaved")}
    panels = [("no pipelining (1 rank, 4 layers)", single, single["t0"])]
    panels += [(f"{k}: stage {r[k]['stage']} (p = 2{', v = 2' if k == 'interleaved' else ''})",
                r[k], t_ref[k]) for k in ("1F1B", "interleaved") for r in ranks]
    ymax = 1.1 * max(run["peak"] for _, run in runs) / 2 ** 20
    plot_iteration(panels, ymax)
    plt.show()

    s_b_h = 128 * 2 * 64 * 4   # one fp32 [s, b, h] pipeline message
    for name, run in runs:
        assert sum(run["resident"].values()) == 16 * run["num_params"], name
        # after the step only the last received input (and its .grad) of each non-first chunk
        # is still referenced, by the chunk itself, until the next iteration replaces it
        assert run["end"] - sum(run["resident"].values()) == 2 * s_b_h * run["held_inputs"], name
    for r in ranks:
        flow = {k: r[k]["peak"] - sum(r[k]["resident"].values()) for k in ("1F1B", "interleaved")}
        assert flow["interleaved"] > 1.1 * flow["1F1B"], (r["1F1B"]["stage"], flow)

# %% [markdown]
# What the numbers say:
#
# - **Resident is exactly 16 B per parameter** on every rank and never moves during the
#   iteration: the meter sees parameters, the gradient buffer and Adam's two moments and
#   nothing else at the start and at the end. Pipeline parallelism halves it per rank (each
#   stage holds half the layers); the schedule does not change it at all.
# - **Flowing rises and falls with the schedule.** Without pipelining there is one hill per
#   micro-batch. On 1F1B's stage 0 the first forward is followed by a second before any
#   backward (warmup 1), so two micro-batches overlap; stage 1 never holds more than one.
#   The interleaved schedule starts more chunk-forwards before its first backward, and its
#   peak is higher on both stages (here about 1.3×), the price of its smaller bubble.
# - **Almost nothing flows past the end of the step**: what is left is the last activation each
#   non-first chunk received (its input and that input's gradient, $2 \times [s, b, h]$),
#   which the chunk keeps referenced until the next iteration's first receive. Megatron's
#   model keeps it the same way (`set_input_tensor`).
# - The last stage's hill includes the logits and the loss (a $[b, s, V]$ fp32 tensor and its
#   gradient), which is why it is not simply half of stage 0's.
#
# ## Summary
#
# - Resident memory = parameters + gradient buffer + optimizer state, fixed by the model, the
#   precision and the sharding: 16 B/param in fp32 with Adam, $6 + 12/d$ B with bf16 and the
#   distributed optimizer (11.6 GiB per GPU in the running example).
# - Flowing memory is what the schedule lets overlap: micro-batches in flight times the
#   activations of one, plus messages and temporaries.
# - Measured on a CPU by counting live tensor storages per operator; on a GPU the same
#   worker reads the caching allocator.
#
# ## How production does it
#
# - Megatron reports allocator statistics in `training_log` (`megatron/training/training.py:2361`,
#   `report_memory`) and *predicts* both parts in `megatron/training/theoretical_memory_usage.py`
#   (`compute_weight_and_optimizer_memory`, `compute_activation_memory`) — the formulas
#   chapter 07 rebuilds and checks against measurements like these.
# - PyTorch's `torch.cuda.memory._record_memory_history` + the snapshot viewer draw the same
#   picture on a GPU, per allocation.
#
# **Handed to chapter 07**: the resident ledger per parameter (this page's table), and the
# flowing peak per stage as a function of the schedule, which 07 turns into activation-memory
# formulas (per layer, with TP/SP/CP, recompute) and checks against this meter.
#
# ## Exercises
#
# 1. Run the 1F1B worker with 8 micro-batches instead of 4. Which stage's peak changes, and
#    why does the other's not?
#
#    <details><summary>Hint</summary>
#
#    1F1B bounds the micro-batches in flight on stage $r$ by
#    $p - r$ whatever $m$ is, so the activations alone change neither peak. Look for what
#    does grow with $m$ (what one stage keeps per micro-batch until the step ends, such as the
#    last stage's loss reports) and measure it before predicting.
#
#    </details>
#
# 2. Switch the demo to bf16 parameters with `grad_reduce_in_fp32`: predict the resident bytes
#    per parameter first.
#
#    <details><summary>Answer</summary>
#
#    18 B: 2 B of bf16 parameters, 4 B of fp32 gradients,
#    and 12 B of optimizer state, since bf16 weights need an fp32 master copy beside Adam's two
#    moments. `resident_bytes_per_param(2, 4, 1)` gives 18, against 16 for the fp32 demo: the
#    master copy costs more than the halved weights save.
#
#    </details>
#
# 3. With the distributed optimizer on DP 2 (two more ranks), which part of the resident band
#    halves?
#
#    <details><summary>Answer</summary>
#
#    Only the optimizer state: Adam's 8 B per parameter
#    become 4 B, while the parameters and the full-size gradient buffer stay on every rank.
#    `resident_bytes_per_param(4, 4, 2)` gives 12 B instead of 16.
#
#    </details>

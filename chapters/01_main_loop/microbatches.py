# %% [markdown]
# # 01 · The batch system: global batch, micro-batch, and how many of them
#
# One optimizer step consumes one **global batch**. No GPU holds it at once: each data-parallel
# rank runs a few **micro-batches** one after the other and accumulates their gradients. This
# page builds the arithmetic that decides how many, Megatron's two calculators (a constant
# batch and a step schedule that grows it), and the unit every other piece counts in:
# **consumed samples**.

# %%
from __future__ import annotations

from tinytron.main_loop._microbatch_checks import check_schedule, positive_int, positive_sizes

__all__ = ["num_microbatches", "ConstantNumMicroBatchesCalculator",
           "StepBatchsizeNumMicroBatchesCalculator", "parse_numeric_value",
           "parse_step_batch_size_schedule",
           "build_num_microbatches_calculator", "train_iters_from_samples",
           "samples_in_iterations"]

# %% [markdown]
# ## Three sizes and one division
#
# - **micro-batch size** $b$: the samples (sequences) one forward/backward processes on one
#   rank (`--micro-batch-size`);
# - **global batch size** $B$: the samples one optimizer step sees, summed over all
#   data-parallel ranks (`--global-batch-size`);
# - **data-parallel size** $d$: the number of model replicas that each see different data.
#
# Each step, every replica runs $m$ micro-batches, so $B = m \cdot b \cdot d$ and
#
# $$m = \frac{B}{b \cdot d}.$$
#
# The $d$ here is the data-parallel size **without** context parallelism
# (`mpu.get_data_parallel_world_size()`, `megatron/core/num_microbatches_calculator.py:340`):
# the CP ranks of one replica split the *sequence* of the same samples, they do not read more
# samples. Tensor and pipeline ranks likewise share their replica's samples.
#
# **The running example.** TP 2 · PP 2 · DP 64 on 256 GPUs, $b = 2$, $B = 1024$:
# $m = 1024 / (2 \cdot 64) = 8$. Each of the 64 replicas runs 8 micro-batches of 2 sequences of
# 4096 tokens per step; one step consumes $1024 \cdot 4096 = 4\,194\,304$ tokens. If CP 2 were
# added on 512 GPUs, $d$ would still be 64 and $m$ still 8.
#
# | $B$ | $b$ | $d$ | $m$ | |
# |---|---|---|---|---|
# | 1024 | 2 | 64 | 8 | the running example |
# | 1024 | 1 | 64 | 16 | smaller micro-batches: more of them, less activation memory each |
# | 1024 | 2 | 128 | 4 | twice the replicas: half the accumulation |
# | 1000 | 2 | 64 | — | 1000 is not a multiple of 128: an error, or run 896 and skip 104 |
#
# A bad combination must fail before anything is built, with the numbers in the message.
# The plain argument checks (sizes that are not positive ints, a step schedule whose
# thresholds do not increase or whose batch shrinks) live in
# `chapters/01_main_loop/_microbatch_checks.py`; the page keeps the divisibility rules.

# %%
def num_microbatches(global_batch_size: int, micro_batch_size: int,
                     data_parallel_size: int) -> int:
    """m = B / (b · d); ValueError naming the numbers when it does not divide."""
    positive_sizes(global_batch_size, micro_batch_size, data_parallel_size)
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) is not divisible by micro_batch_size "
            f"({micro_batch_size}) x data_parallel_size ({data_parallel_size}) = {per_step}")
    return global_batch_size // per_step

# %% [markdown]
# ## The constant calculator, and `decrease_batch_size_if_needed`
#
# `ConstantNumMicroBatchesCalculator` (`num_microbatches_calculator.py:340`) computes $m$ once.
# With `decrease_batch_size_if_needed` it does not fail on a remainder: it rounds the global
# batch **down** to a multiple of $b \cdot d$ and runs that. The samples it did not run are
# not silently forgotten: each iteration the loop adds
# `current_global_batch_size - current_running_global_batch_size` to `skipped_train_samples`
# (`megatron/training/training.py:3622-3628`). This is the knob for a job that loses a few
# nodes and restarts with a smaller $d$: $B = 1024$ on $d = 60$, $b = 2$ runs
# $\lfloor 1024/120 \rfloor \cdot 120 = 960$ samples per step and counts 64 as skipped.

# %%
class ConstantNumMicroBatchesCalculator:
    """m = B / (b·d) for the whole run; optionally round B down and count the rest as skipped."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool = False):
        positive_sizes(global_batch_size, micro_batch_size, data_parallel_size)
        per_step = micro_batch_size * data_parallel_size
        if decrease_batch_size_if_needed:
            running = (global_batch_size // per_step) * per_step
            if running == 0:
                raise ValueError(
                    f"global_batch_size ({global_batch_size}) is smaller than micro_batch_size "
                    f"({micro_batch_size}) x data_parallel_size ({data_parallel_size}) = "
                    f"{per_step}: not one micro-batch per rank fits")
        else:
            num_microbatches(global_batch_size, micro_batch_size, data_parallel_size)
            running = global_batch_size
        self.micro_batch_size, self.data_parallel_size = micro_batch_size, data_parallel_size
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // per_step

    def get(self) -> int:
        """The number of micro-batches per step."""
        return self.num_micro_batches

    @property
    def skipped_samples_per_iteration(self) -> int:
        """Samples of the nominal global batch that each step does not run."""
        return self.current_global_batch_size - self.current_running_global_batch_size

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Nothing changes with consumed samples."""

# %% [markdown]
# ## A batch size that grows: the step schedule
#
# Large runs often start with a small global batch (noisy early gradients are cheap to
# follow) and grow it later. At this commit Megatron expresses that as a **step schedule**,
# `--step-batch-size-schedule "THRESHOLD:BS THRESHOLD:BS ..."`
# (`StepBatchsizeNumMicroBatchesCalculator`, `num_microbatches_calculator.py:402`):
#
# - entries separated by spaces (or commas); thresholds and sizes accept the suffixes
#   `K` = $10^3$, `M` = $10^6$, `B` = $10^9$, `T` = $10^{12}$ (`250B` = $2.5 \cdot 10^{11}$);
# - with `seq_length` given, thresholds are **tokens** and are converted to samples by integer
#   division; without it they are samples;
# - entries are sorted; the first threshold must be 0 and thresholds strictly increase; batch
#   sizes are positive;
# - the current batch size is the entry with the largest threshold $\le$ consumed samples;
# - divisibility by $b \cdot d$ is checked for the *current* entry only (an early entry may be
#   too small for a bigger cluster the run was later moved to).
#
# The older `--rampup-batch-size START INCR SAMPLES` is deprecated and ignored at this commit
# (`num_microbatches_calculator.py:64`). tinytron's key is Megatron's,
# `[training] step_batch_size_schedule`, in Megatron's units: Megatron passes the model's
# `seq_length` to the calculator (`megatron/training/global_vars.py:127-135`), so a GPT run's
# thresholds are **tokens**, and so are tinytron's (the trainer passes `model.seq_length`).
# A schedule fixes the batch, so an explicit `global_batch_size` beside it is refused, as
# Megatron refuses `--global-batch-size` with `--step-batch-size-schedule`
# (`megatron/training/arguments.py:696-699`).
#
# **A schedule must not shrink.** The training loop asserts that the number of micro-batches
# never decreases (`megatron/training/training.py:3443-3446`), because the sampler, the learning-rate
# schedule and a checkpoint saved at the change all assume the batch only grows. We reject a
# shrinking schedule when it is parsed, with both entries in the message, instead of
# thousands of iterations into the run.
#
# Numbers are read as Megatron reads them, `int(float(digits) * multiplier)`
# (`num_microbatches_calculator.py:499`), binary floating point included: `'2.01K'` is 2009,
# because `2.01` is stored as 2.00999…; write `2010` to mean 2010.
#
# Example with the running example's $s = 4096$: `"0:256 1M:512 2M:1024"` in tokens is
# thresholds $0$, $\lfloor 10^6/4096 \rfloor = 244$ and $488$ samples. With $b = 2$, $d = 64$:
# $m = 2$ for the first 244 samples (one step), $m = 4$ until 488, then $m = 8$.

# %%
_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def parse_numeric_value(text: str) -> int:
    """'250B' -> 250_000_000_000; '1.5K' -> 1500; '2.01K' -> 2009, as Megatron's float rule."""
    s = text.strip().upper()
    mult = _SUFFIXES.get(s[-1:], 1)
    digits = s[:-1] if mult != 1 else s
    try:
        return int(float(digits) * mult)   # Megatron's rounding (toward zero), not exact decimals
    except (ValueError, OverflowError):
        raise ValueError(f"not a number with an optional K/M/B/T suffix: {text!r}") from None


def parse_step_batch_size_schedule(schedule: str, seq_length: int | None = None
                                   ) -> list[tuple[int, int]]:
    """'0:768 250B:1536' -> [(threshold in samples, global batch size)], sorted and checked."""
    entries = []
    for entry in schedule.replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"schedule entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        t, b = entry.split(":", 1)
        threshold = parse_numeric_value(t)
        if seq_length is not None:
            threshold //= positive_int("seq_length", seq_length)  # tokens -> samples
        entries.append((threshold, parse_numeric_value(b)))
    entries.sort(key=lambda e: e[0])
    check_schedule(entries)
    return entries

# %% [markdown]
# The calculator looks up the current entry; `update` is called by the loop before every
# step with the samples consumed so far.

# %%
class StepBatchsizeNumMicroBatchesCalculator:
    """The global batch follows a step schedule in consumed samples; m = B_now / (b·d)."""

    def __init__(self, micro_batch_size: int, data_parallel_size: int, schedule: str,
                 seq_length: int | None = None):
        self.micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
        self.data_parallel_size = positive_int("data_parallel_size", data_parallel_size)
        self.schedule = parse_step_batch_size_schedule(schedule, seq_length)
        self.current_global_batch_size = self.current_running_global_batch_size = None
        self.num_micro_batches = None
        self.update(0, consistency_check=False)

    def get(self) -> int:
        """The number of micro-batches per step at the last update."""
        return self.num_micro_batches

    @property
    def skipped_samples_per_iteration(self) -> int:
        """Always 0: a step schedule cannot be combined with decrease_batch_size_if_needed."""
        return 0

    def batch_size_at(self, consumed_samples: int) -> int:
        """The entry with the largest threshold <= consumed_samples."""
        return [b for t, b in self.schedule if t <= consumed_samples][-1]

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Move to the schedule entry for consumed_samples; check divisibility if asked."""
        gbs = self.batch_size_at(consumed_samples)
        per_step = self.micro_batch_size * self.data_parallel_size
        if consistency_check and gbs % per_step:
            raise ValueError(
                f"current global batch size ({gbs}, at {consumed_samples} consumed samples) is "
                f"not divisible by micro_batch_size ({self.micro_batch_size}) x "
                f"data_parallel_size ({self.data_parallel_size}) = {per_step}")
        self.current_global_batch_size = self.current_running_global_batch_size = gbs
        self.num_micro_batches = gbs // per_step

# %% [markdown]
# ## Building the calculator, and iterations from samples
#
# `build_num_microbatches_calculator` takes Megatron's arguments and picks one
# (`_build_num_microbatches_calculator`, `num_microbatches_calculator.py:227`); a step schedule
# with `decrease_batch_size_if_needed` is rejected, and a `global_batch_size` beside a schedule
# is ignored here (the config has refused one the user set, and filled in $b \cdot d$, as
# Megatron's arguments do). A run given in samples
# (`train_samples`) is converted to iterations once (`update_train_iters`,
# `megatron/training/training.py:1485`): $\lfloor \text{samples} / B \rfloor$ for a constant
# batch, and by walking the schedule otherwise (an iteration that starts before the target
# counts, so the last one may overshoot it).
#
# **Why samples, not iterations.** Everything that must survive a change of batch size
# counts samples: the learning-rate scheduler advances by $m \cdot b \cdot d$ per successful
# step (`training.py:2316-2318`), the sampler resumes at `consumed_train_samples`, the checkpoint
# stores it. When the batch doubles, the learning rate keeps its place on its curve and the
# data loader reads the next unseen sample.

# %%
def build_num_microbatches_calculator(global_batch_size: int | None, micro_batch_size: int,
                                      data_parallel_size: int,
                                      decrease_batch_size_if_needed: bool = False,
                                      step_batch_size_schedule: str | None = None,
                                      seq_length: int | None = None):
    """Constant calculator, or the step-schedule one when a schedule is given."""
    if step_batch_size_schedule is not None:   # global_batch_size is then ignored, as in Megatron
        if decrease_batch_size_if_needed:
            raise ValueError("step_batch_size_schedule cannot be combined with "
                             "decrease_batch_size_if_needed")
        return StepBatchsizeNumMicroBatchesCalculator(micro_batch_size, data_parallel_size,
                                                      step_batch_size_schedule, seq_length)
    if global_batch_size is None:
        raise ValueError("global_batch_size is required without a step_batch_size_schedule")
    return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size,
                                             data_parallel_size, decrease_batch_size_if_needed)


def train_iters_from_samples(calculator, train_samples: int) -> int:
    """Iterations that consume train_samples (training.py:1485, update_train_iters)."""
    positive_int("train_samples", train_samples)
    if isinstance(calculator, ConstantNumMicroBatchesCalculator):
        return train_samples // calculator.current_global_batch_size
    iters, consumed = 0, 0
    while consumed < train_samples:
        consumed += calculator.batch_size_at(consumed)
        iters += 1
    return iters

# %% [markdown]
# The learning-rate schedule counts samples, so every length given in iterations must become
# samples the same way: the samples the first $n$ iterations consume. With a constant batch
# that is $n \cdot B$; with a step schedule it is the walk above, e.g. 10 iterations of
# `"0:16 10K:32"` at 128 tokens a sample are $5 \cdot 16 + 5 \cdot 32 = 240$ samples, not
# $10 \cdot 16 = 160$ (chapter 02's scheduler, [factory](../02_optimizer/factory.py)).

# %%
def samples_in_iterations(calculator, iterations: int) -> int:
    """Samples the first `iterations` iterations consume under the calculator's batch sizes."""
    if isinstance(calculator, ConstantNumMicroBatchesCalculator):
        return iterations * calculator.current_global_batch_size
    consumed = 0
    for _ in range(max(0, iterations)):
        consumed += calculator.batch_size_at(consumed)
    return consumed

# %% [markdown]
# ## Demo: the running example, a shrunk cluster, and a growing batch
#
# First the table above, computed; then a job that lost 4 of its 64 replicas; then the
# token-threshold step schedule over the first 1200 samples, drawn, next to what happens to
# the consumed-sample counter.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    for gbs, mbs, dp in ((1024, 2, 64), (1024, 1, 64), (1024, 2, 128)):
        print(f"B={gbs:5d} b={mbs} d={dp:3d} -> m = {num_microbatches(gbs, mbs, dp)}")
    try:
        num_microbatches(1000, 2, 64)
    except ValueError as e:
        print("B=1000:", e)
    assert num_microbatches(1024, 2, 64) == 8

    shrunk = ConstantNumMicroBatchesCalculator(1024, 2, 60, decrease_batch_size_if_needed=True)
    print(f"d=60: runs {shrunk.current_running_global_batch_size} samples in "
          f"{shrunk.get()} micro-batches, skips {shrunk.skipped_samples_per_iteration} per step")
    assert (shrunk.get(), shrunk.skipped_samples_per_iteration) == (8, 64)

    calc = build_num_microbatches_calculator(None, 2, 64, step_batch_size_schedule=
                                             "0:256 1M:512 2M:1024", seq_length=4096)
    print("schedule in samples:", calc.schedule)
    consumed, xs, ms = 0, [], []
    while consumed < 1200:
        calc.update(consumed)
        xs.append(consumed)
        ms.append(calc.get())
        consumed += calc.current_running_global_batch_size
    print("m per step:", ms)
    assert calc.schedule == [(0, 256), (244, 512), (488, 1024)]
    assert ms == [2, 4, 8]   # steps start at 0, 256 and 768; at 1792 > 1200 the walk stops
    fig, ax = plt.subplots(figsize=(6.5, 2.6))
    ax.step(xs + [consumed], [m * 128 for m in ms] + [ms[-1] * 128], where="post")
    for t, _ in calc.schedule:
        ax.axvline(t, color="gray", lw=0.6, ls="--")
    ax.set_xlabel("consumed samples at the start of the step")
    ax.set_ylabel("global batch (samples)")
    ax.set_title("step schedule 0:256 1M:512 2M:1024 tokens at s = 4096")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# The second step starts at 256 consumed samples, past the 244-sample threshold, so it already
# runs 512; the threshold is reached *between* steps, and the change applies to the next one.
#
# ## Summary
#
# - $m = B / (b \cdot d)$ with $d$ the data-parallel size without CP; an error names all
#   three numbers.
# - `decrease_batch_size_if_needed` runs the largest multiple of $b \cdot d$ and counts the
#   rest as skipped samples every step.
# - A step schedule grows the batch (thresholds in tokens for a GPT run, in samples without
#   `seq_length`); it may never shrink, and it replaces `global_batch_size`.
# - Consumed samples, not iterations, are the unit of the scheduler, the sampler and the
#   checkpoint.
#
# ## How production does it
#
# - Megatron: `megatron/core/num_microbatches_calculator.py` (`ConstantNumMicroBatchesCalculator:340`,
#   `StepBatchsizeNumMicroBatchesCalculator:402`, `_build_num_microbatches_calculator:227`),
#   `megatron/training/training.py` (`update_train_iters:1485`, the per-iteration update and the
#   non-decreasing assertion `:3433-3458`, consumed and skipped samples `:3616-3628`).
# - torchtitan fixes `global_batch_size` and derives gradient-accumulation steps as
#   `global_batch_size // (local_batch_size * dp_degree)` (`torchtitan/trainer.py`), with no
#   batch-size schedule.
#
# ## Exercises
#
# 1. With the running example, what is $m$ on DP 48 with `decrease_batch_size_if_needed`, and
#    how many samples are skipped over 10 000 steps?
#
#    <details><summary>Answer</summary>
#
#    $1024 / (2 \cdot 48) = 10.67$, so $m = 10$: each step
#    runs $10 \cdot 2 \cdot 48 = 960$ samples and skips 64 (`ConstantNumMicroBatchesCalculator`
#    says the same). Over 10 000 steps that is 640,000 samples skipped.
#
#    </details>
#
# 2. Write the step schedule that doubles the batch from 256 to 2048 every 100 B tokens, and
#    compute `train_iters_from_samples` for 2 T tokens at $s = 4096$.
#
#    <details><summary>Answer</summary>
#
#    `"0:256 100B:512 200B:1024 300B:2048"`, thresholds in
#    samples 0, 24,414,062, 48,828,125 and 73,242,187. 2 T tokens are
#    $2 \cdot 10^{12} / 4096$ = 488,281,250 samples, and the walk of `train_iters_from_samples`
#    gives 369,550 iterations: about 95 k at 256, 48 k at 512, 24 k at 1024 and 203 k at
#    2048.
#
#    </details>
#
# 3. Why would a schedule that shrinks break a resumed run's data order?
#
#    <details><summary>Hint</summary>
#
#    Follow the consumed-sample counter: the sampler resumes at
#    `consumed_train_samples`, and the learning-rate schedule and the checkpoint saved at the
#    change assume each step read at least as many samples as the last. See the assertion the
#    loop makes (`megatron/training/training.py:3443-3446`) and what `_advance_microbatches`
#    does at a change of $m$.
#
#    </details>

# %% [markdown]
# # 08 · Observability: the progress bar, JSONL and TensorBoard logs, the memory report
#
# A long run is watched three ways: a person glances at the **console** (is it moving, how
# fast, when will it end), a dashboard plots **TensorBoard** scalars (is the loss curve healthy,
# did the grad norm spike), and scripts read a **JSONL** file (one JSON object per logged
# iteration: easy to grep, diff and load into pandas). All three are fed from the same record
# chapter 01's `training_log` builds every `log_interval` iterations; this page writes them,
# with Megatron's scalar names so that existing dashboards work, and adds the memory report.

# %%
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from typing import Optional, TextIO

import torch
import torch.distributed as dist

__all__ = ["LoggingConfig", "memory_report", "format_memory_report", "megatron_scalars",
           "SCALAR_UNITS", "TIMER_UNIT", "PER_INTERVAL_TIMERS", "scalar_unit", "ProgressBar",
           "MetricsLogger", "read_tensorboard_scalars"]

# %% [markdown]
# ## Megatron's scalar names
#
# `training_log` (`megatron/training/training.py:2361`) writes, at every
# `tensorboard_log_interval` (default 1), each scalar twice — against the iteration and, with
# the suffix ` vs samples`, against the consumed samples (so that runs with different batch
# sizes line up):
#
# | scalar | value |
# |---|---|
# | `learning-rate`, `learning-rate vs samples` | LR of the first param group |
# | `batch-size`, `batch-size vs samples` | global batch size |
# | `lm loss`, `lm loss vs samples` (one pair per loss key) | mean over the interval's advanced iterations |
# | `loss-scale`, `loss-scale vs samples` | fp16 loss scale (1 for bf16) |
# | `world-size`, `world-size vs samples` | ranks |
# | `grad-norm`, `grad-norm vs samples`; `num-zeros`; `params-norm` | when computed |
# | `iteration-time`, `throughput` | seconds per iteration; TFLOP/s per GPU |
# | `mem-reserved-bytes`, `mem-allocated-bytes`, `mem-max-allocated-bytes`, `mem-allocated-count` | CUDA caching allocator |
# | `skipped-train-samples` | when any were skipped |
# | `<timer>-time` | each timer's max over ranks, seconds per iteration (below) |
# | `lm loss validation`, `lm loss validation vs samples` | evaluation |
#
# Only the **last rank** writes (it holds the loss on the last pipeline stage). Here the
# record arrives every `log_interval`, so that is the TensorBoard interval too; set
# `log_interval = 1` for a point per iteration. `LoggingConfig` holds the switches, with
# Megatron's names where they exist.

# %%
@dataclass
class LoggingConfig:
    """Where and how a run reports itself."""

    tensorboard_dir: Optional[str] = None
    """TensorBoard event directory (None: no TensorBoard)."""
    jsonl_path: Optional[str] = None
    """One JSON object per logged iteration (None: no JSONL)."""
    progress_bar: bool = True
    """Console progress bar (a bar on a terminal, a line per record otherwise)."""
    timing_log_level: int = 0
    """Timers kept: 0 coarse, 1 + fwd/bwd/optimizer parts, 2 + compute/batch/p2p."""
    timing_log_option: str = "minmax"
    """minmax | max | all."""
    log_timers_to_tensorboard: bool = True
    """Also send '<timer>-time' (max over ranks) to TensorBoard."""
    log_memory_to_tensorboard: bool = True
    """Also send the memory report's byte counts."""


# %% [markdown]
# ## The memory report
#
# Megatron's `report_memory` (`megatron/training/utils/common_utils.py:282`; `utils` is a
# package at this commit) prints, per rank, the CUDA caching allocator's `allocated`,
# `max allocated`, `reserved` and `max reserved` in MB at every logged iteration up to the
# first one past `loaded + 1` — with `log_interval = 1` from a fresh start, iterations 1 and 2
# (`training.py:2694-2704`) — so that the optimizer state, allocated at the first step, is
# included. *Allocated* is what live tensors hold; *reserved* is what
# the allocator holds from the driver (allocated + cached free blocks). On a CPU there is no
# caching allocator: the report gives the process's resident set size (current from
# `/proc/self/statm`, peak from `getrusage`), which includes Python and torch itself — an
# upper bound, not a tensor count (chapter 01's `LiveBytesMeter` counts tensors).

# %%
def memory_report(device: torch.device | str | None = None) -> dict[str, int]:
    """Byte counts under Megatron's TensorBoard names (CUDA allocator, or process RSS on CPU)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return {"mem-allocated-bytes": s.get("allocated_bytes.all.current", 0),
                "mem-max-allocated-bytes": s.get("allocated_bytes.all.peak", 0),
                "mem-reserved-bytes": s.get("reserved_bytes.all.current", 0),
                "mem-max-reserved-bytes": s.get("reserved_bytes.all.peak", 0),
                "mem-allocated-count": s.get("allocation.all.current", 0)}
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * page
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"mem-rss-bytes": rss, "mem-max-rss-bytes": max(peak, rss)}


def format_memory_report(report: dict[str, int], name: str, rank: int = 0) -> str:
    """Megatron's one-line memory report, in MB."""
    mb = {k: v / 2 ** 20 for k, v in report.items()}
    if "mem-allocated-bytes" in mb:
        body = (f"allocated: {mb['mem-allocated-bytes']:.1f} | max allocated: "
                f"{mb['mem-max-allocated-bytes']:.1f} | reserved: {mb['mem-reserved-bytes']:.1f}"
                f" | max reserved: {mb['mem-max-reserved-bytes']:.1f}")
    else:
        body = f"rss: {mb['mem-rss-bytes']:.1f} | max rss: {mb['mem-max-rss-bytes']:.1f}"
    return f"[Rank {rank}] {name} memory (MB) | {body}"


# %% [markdown]
# ## From a record to scalars, a JSONL line and a console line
#
# `megatron_scalars` maps chapter 01's record to `(name, value, step)` triples. The progress bar
# shows what a person wants at a glance — loss, LR, tokens/s, MFU, memory and the ETA, which is
# the remaining iterations times the last interval's ms per iteration. On a terminal it
# rewrites one line (`\r`); in a log file (not a TTY) it prints one line per record, since
# carriage returns make log files unreadable.

# %%
def megatron_scalars(record: dict, world_size: int = 1,
                     memory: Optional[dict] = None) -> list[tuple[str, float, int]]:
    """(name, value, global step) triples under Megatron's TensorBoard names."""
    it, samples = record["iteration"], record.get("consumed_train_samples", 0)
    if "validation" in record:
        out = []
        for k, v in record["validation"].items():
            out += [(f"{k} validation", float(v), it), (f"{k} validation vs samples", float(v),
                                                        samples)]
        return out
    pairs = {"learning-rate": record["learning_rate"], "batch-size": record["global_batch_size"],
             **record["losses"], "loss-scale": record["loss_scale"], "world-size": world_size}
    for key, name in (("grad_norm", "grad-norm"), ("num_zeros_in_grad", "num-zeros"),
                      ("params_norm", "params-norm")):
        if record.get(key) is not None:
            pairs[name] = record[key]
    out = []
    for name, value in pairs.items():
        out += [(name, float(value), it), (f"{name} vs samples", float(value), samples)]
    out += [("iteration-time", record["ms_per_iteration"] / 1000.0, it),
            ("throughput", record["tflops_per_device"], it)]
    if record.get("tokens_per_second") is not None:  # tinytron's: Megatron logs no token rate
        out.append(("tokens-per-second", float(record["tokens_per_second"]), it))
    if record.get("mfu") is not None:  # None where no peak is known (a CPU)
        out.append(("mfu", float(record["mfu"]), it))
    if record.get("skipped_train_samples"):
        out.append(("skipped-train-samples", float(record["skipped_train_samples"]), it))
    out += [(k, float(v), it) for k, v in (memory or {}).items()]
    return out


# %% [markdown]
# The progress bar renders a line from the same record without any I/O (`render`, easy to
# test), and `update` decides how to draw it: rewrite in place on a terminal, a new line in a log.
#
# The progress bar's code, the JSON conversion of a record and the TensorBoard reader live in
# the chapter's private module `tinytron.reliability._logging_io`
# (`chapters/08_reliability/_logging_io.py`): they draw and convert, and decide nothing.
#
# A worked example of the line: iteration 12 of 1 000, loss 7.4132, 1 250 ms per iteration,
# 4 × 2 048 tokens per iteration. The bar is `int(24 · 12 / 1000) = 0` marks of 24; the
# throughput $8\,192 / 1.25 = 6\,553.6$ tokens/s prints as `6.6k tok/s`; the ETA is
# $(1000 - 12) \cdot 1.25 = 1\,235$ s, printed `0:20:35`. The ETA uses the *last* interval's
# speed, not the mean since the start: the first interval includes compilation and warm-up,
# and a run that slows down (a straggler, a throttled GPU) should show a later end at once.

# %%
from tinytron.reliability._logging_io import (ProgressBar, _fmt_seconds,  # noqa: F401
                                              _jsonable, described_scalar,
                                              read_tensorboard_scalars)


# %% [markdown]
# ## Units, and what a timer scalar covers
#
# Megatron's tags carry no unit: `iteration-time` is seconds per iteration
# (`training.py:2624`), `throughput` TFLOP/s per GPU (`:2641`, the console's "throughput per
# GPU (TFLOP/s/GPU)"), and each `<timer>-time` the slowest rank's seconds divided by
# `log_interval` (`megatron/core/timers.py:452-485`, called with `normalizer=log_interval` at
# `training.py:2710`). tinytron keeps the tags, so that a dashboard built for Megatron reads a
# tinytron run, and writes the unit into the event file as each tag's description: the first
# point of the tag carries it (TensorBoard shows it beside the chart, and
# `EventAccumulator.SummaryMetadata(tag).summary_description` reads it back).
#
# The timers are read and **reset** at every record. Megatron writes them with `reset=False`
# and resets them in the console report right after (`:2710-2713`), and a timer that did not
# run since is left out (`_get_global_min_max_time` keeps only values above zero,
# `timers.py:318-336`). Without the reset every value would be the sum since the start of the
# run, and `save-checkpoint-time` would repeat the last save's total at every record.
#
# <details><summary>Megatron detail: the divisor and tinytron's extra tags</summary>
#
# Megatron divides by `log_interval`; tinytron by the iterations since the previous record
# (the first record covers one iteration, where Megatron would divide its one iteration by the
# interval). `save-checkpoint-time` is tinytron's: Megatron prints the save timer on the
# console and writes no scalar for it (`save_checkpoint_and_time`, `training.py:2796-2843`).
# It is the seconds spent saving since the previous record, not divided by anything, and
# written only in an interval in which a save ran. A save comes after its iteration's record (as
# in Megatron), so it shows at the next record: a save at iteration 2 with `log_interval = 1` is
# the point at step 3. `tokens-per-second` (the whole job's) and `mfu` are tinytron's tags
# too: Megatron prints neither to TensorBoard. `mfu` is written only where the device's peak
# is known, so a CPU run has no `mfu` tag (see chapter 01's `training_log`).
#
# </details>

# %%
SCALAR_UNITS = {
    "iteration-time": "seconds per iteration, mean over the log interval",
    "throughput": "TFLOP/s per device (model FLOPs over the log interval's wall time)",
    "tokens-per-second": "tokens per second over all ranks, over the log interval",
    "mfu": "model FLOP utilization: throughput / the device's peak TFLOP/s (0 to 1)",
}
TIMER_UNIT = "seconds per iteration, slowest rank, mean over the log interval"
PER_INTERVAL_TIMERS = {
    "save-checkpoint": "seconds spent saving since the previous record, slowest rank "
                       "(written only when a save ran)",
}


def scalar_unit(tag: str) -> Optional[str]:
    """The unit a tag's description states, or None (the name says it, or it has none)."""
    if tag in SCALAR_UNITS:
        return SCALAR_UNITS[tag]
    if tag.endswith("-time"):
        return PER_INTERVAL_TIMERS.get(tag[:-len("-time")], TIMER_UNIT)
    return None


# %% [markdown]
# Two methods of the logger write the scalars that need more than a name: the timers, read,
# divided and reset at each record as the section above says, and a tag with a unit, whose
# first point is written with its description.

# %%
class TimedScalars:
    """The logger's timer scalars and the unit-carrying first point of a tag."""

    def _write_timers(self, iteration: int) -> None:
        """`<name>-time` for the timers that ran since the last record, then reset them."""
        iterations = 1 if self._timed_through is None else max(iteration - self._timed_through, 1)
        self._timed_through = iteration
        ms = self.timers.get_min_max(self.timer_names, reset=True)   # collective; ran > 0 only
        for name, (_, slowest) in ms.items() if self.writer is not None else ():
            per = 1 if name in PER_INTERVAL_TIMERS else iterations
            self._add_scalar(f"{name}-time", slowest / 1000.0 / per, iteration)

    def _add_scalar(self, tag: str, value: float, step: int) -> None:
        """add_scalar; the first point of a tag with a unit carries it as its description."""
        unit = scalar_unit(tag)
        if unit is None or tag in self._described:
            self.writer.add_scalar(tag, value, step)
            return
        self._described.add(tag)
        self.writer.file_writer.add_summary(described_scalar(tag, value, unit), step)


# %% [markdown]
# ## The logger the loop calls
#
# `MetricsLogger` is a `log_fn` for chapter 01's `train(...)`: it receives every record (and
# every validation record) on every rank, and on the last rank writes the JSONL line, the
# TensorBoard scalars through the `tensorboard` package's own writer
# (`torch.utils.tensorboard.SummaryWriter`, which writes the standard event files), and the
# progress bar. `add_timers` lets the trainer pass the timers and their names so that
# `<name>-time` is written too (a collective: every rank must call the logger).
# On a job of several nodes each node's last rank prints the console lines too (the files stay
# the last rank's): torchrun shows each node only its own ranks' output, and a run whose progress
# appears on the last node alone looks hung from the first. With `progress_bar = false` each
# record is printed instead as Megatron's log line
# (`training.py:2627-2692`, chapter 01's `format_log_line`), so that a batch job's log shows
# every `log_interval`; `flush_timers` writes the timers that ran after the last record — the
# final save's — at the last iteration.
#
# First where the output goes: which ranks print, the two files only the writing rank opens,
# and their flush and close.

# %%
def _last_local_rank_of_a_node(world: int) -> bool:
    """On a job of several nodes, the last rank of each node: every node's console shows the run."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return (world > local and int(os.environ.get("LOCAL_RANK", 0)) == local - 1)


class LoggerSinks:
    """The logger's TensorBoard writer and JSONL file: opened on the writing rank, closed."""

    def _open_sinks(self, config: LoggingConfig) -> None:
        if self.is_writer and config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=config.tensorboard_dir, max_queue=100)
        if self.is_writer and config.jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(config.jsonl_path)), exist_ok=True)
            self.jsonl = open(config.jsonl_path, "a", buffering=1)  # line-buffered: tail -f

    def flush_timers(self, iteration: int) -> None:
        """The timers that ran after the last record (the final save) at `iteration` (collective)."""
        if self.timers is not None and self.timer_names:
            self._write_timers(iteration)

    def close(self) -> None:
        """Flush and close the files."""
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


# %% [markdown]
# The logger: what each rank is, and per record the timers (every rank), then the JSONL line,
# the scalars and the bar or log line (the console ranks).

# %%
class MetricsLogger(LoggerSinks, TimedScalars):
    """JSONL + TensorBoard + progress bar from training_log records (writes on the last rank)."""

    def __init__(self, config: LoggingConfig, train_iters: int, device=None,
                 stream: TextIO | None = None, timers=None, timer_names: tuple = ()):
        self.config, self.device = config, device
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.world_size = world
        self.is_writer = (dist.get_rank() if dist.is_initialized() else 0) == world - 1
        self.is_console = self.is_writer or _last_local_rank_of_a_node(world)
        self.timers, self.timer_names = timers, list(timer_names)
        self.bar = ProgressBar(train_iters, stream) if config.progress_bar else None
        self.stream = stream  # without the bar: Megatron's log line, on stdout by default
        self.writer, self.jsonl = None, None
        self._timed_through: Optional[int] = None   # the iteration the timers were last read at
        self._described: set[str] = set()            # tags whose unit is already written
        self._open_sinks(config)

    def __call__(self, record: dict) -> None:
        """Log one record (call on every rank: the timer report is a collective)."""
        memory = memory_report(self.device) if self.config.log_memory_to_tensorboard else None
        if self.timers is not None and self.timer_names and "validation" not in record:
            self._write_timers(record["iteration"])
        if not self.is_console:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(dict(record, time=time.time(), memory=memory),
                                        default=_jsonable) + "\n")
        if self.writer is not None:
            for name, value, step in megatron_scalars(record, self.world_size, memory):
                self._add_scalar(name, value, step)
        if self.bar is not None and "validation" not in record:
            self.bar.update(record, memory)
        elif "validation" not in record and "losses" in record:  # a batch job's log shows it
            from tinytron.main_loop.training_log import format_log_line
            import sys
            print(format_log_line(record), file=self.stream or sys.stdout, flush=True)


# %% [markdown]
# ## Demo: a short real run, logged three ways and read back
#
# Appendix B's tiny GPT trains for 12 iterations on random tokens; chapter 01's `training_log`
# builds a record every 2 iterations; the logger writes JSONL, TensorBoard and the console line.
# Then the TensorBoard file is read back with the `tensorboard` package's event reader and the
# loss curve is drawn **from the file**.

# %%
if __name__ == "__main__":
    import io
    import tempfile

    import matplotlib.pyplot as plt

    from tinytron.main_loop.training_log import LogState, training_log
    from tinytron.model import GPTModel, tiny_config

    tmp = tempfile.mkdtemp()
    cfg = LoggingConfig(tensorboard_dir=f"{tmp}/tb", jsonl_path=f"{tmp}/log.jsonl")
    console = io.StringIO()
    iters = 12
    logger = MetricsLogger(cfg, train_iters=iters, stream=console)
    torch.manual_seed(0)
    model_cfg = tiny_config()
    model = GPTModel(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = LogState()
    g = torch.Generator().manual_seed(0)
    for it in range(1, iters + 1):
        x = torch.randint(0, 64, (4, 32), generator=g)   # a 64-token sub-vocabulary: learnable
        opt.zero_grad()
        loss = model(x, labels=torch.roll(x, -1, 1)).mean()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        rec = training_log({"lm loss": loss}, state, iteration=it, train_iters=iters,
                           skipped_iter=0, learning_rate=3e-3, loss_scale=1.0, grad_norm=norm,
                           num_zeros_in_grad=None, consumed_train_samples=4 * it,
                           skipped_train_samples=0, batch_size=4, seq_length=32, flops=0,
                           world_size=1, peak_flops=None, log_interval=2)
        if rec is not None:
            logger(rec)
    logger({"iteration": iters, "consumed_train_samples": 4 * iters,
            "validation": {"lm loss": 4.0}})
    logger.close()
    print(console.getvalue().strip().splitlines()[-1])
    print(format_memory_report(memory_report("cpu"), "(after 12 iterations)"))

# %% [markdown]
# Read back: the JSONL lines and the TensorBoard scalars hold the same losses, at the first
# iteration and then every 2, with the samples twin and the memory tags beside them.

# %%
if __name__ == "__main__":
    lines = [json.loads(x) for x in open(cfg.jsonl_path)]
    scalars = read_tensorboard_scalars(cfg.tensorboard_dir)
    print(f"JSONL: {len(lines)} lines; TensorBoard tags: {sorted(scalars)[:6]} ...")
    steps = [s for s, _ in scalars["lm loss"]]
    assert steps == [1, 2, 4, 6, 8, 10, 12] and len(lines) == 8   # first iteration, then every 2
    assert [round(v, 5) for _, v in scalars["lm loss"]] == \
        [round(x["losses"]["lm loss"], 5) for x in lines if "losses" in x]
    assert [s for s, _ in scalars["lm loss vs samples"]] == [4 * s for s in steps]
    assert {"learning-rate", "batch-size", "grad-norm", "iteration-time", "world-size",
            "mem-rss-bytes", "lm loss validation"} <= set(scalars)
    assert scalars["lm loss"][-1][1] < scalars["lm loss"][0][1]      # it learned something

# %% [markdown]
# And the curves, drawn from the event file:

# %%
if __name__ == "__main__":
    fig, ax = plt.subplots(1, 2, figsize=(7.5, 2.4))
    ax[0].plot(*zip(*scalars["lm loss"]), "o-")
    ax[0].set(xlabel="iteration", title="lm loss (read back from TensorBoard)")
    ax[1].plot(*zip(*scalars["grad-norm"]), "o-", color="tab:orange")
    ax[1].set(xlabel="iteration", title="grad-norm")
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Summary
#
# - One record per `log_interval` feeds the console, a JSONL file and TensorBoard, on the last
#   rank, with Megatron's scalar names (`lm loss`, `learning-rate`, `grad-norm`,
#   `iteration-time`, `mem-allocated-bytes`, … and their ` vs samples` twins).
# - Timer scalars cover the interval since the previous record (read and reset there), so a
#   timer that did not run is not written; units travel as each tag's TensorBoard description.
# - The memory report is the CUDA allocator's allocated/reserved bytes, or the process RSS on
#   a CPU.
# - The TensorBoard files are the standard event format, written by the `tensorboard`
#   package's writer and read back by its reader.
#
# ## How production does it
#
# - `megatron/training/training.py:2361` (`training_log`: scalars, console line, timers at
#   `timing_log_level`), `megatron/training/utils/common_utils.py:282` (`report_memory`),
#   `megatron/training/global_vars.py` (the TensorBoard and W&B writers on the last rank),
#   `megatron/core/timers.py:452` (`write`).
# - torchtitan: `torchtitan/components/metrics.py` (`MetricsProcessor`: TensorBoard or W&B
#   loggers, memory via `torch.cuda.memory_stats`, tokens per second, MFU).
#
# ## Exercises
#
# 1. Why does Megatron log against consumed samples as well as iterations? Construct two runs
#    whose loss-vs-iteration curves differ but whose loss-vs-samples curves match.
#
#    <details><summary>Hint</summary>
#
#    An iteration is not a fixed amount of data: the global
#    batch can change (batch-size ramp-up, a resumed run with another batch size), and a
#    skipped iteration still consumes its samples. Compare one run at global batch $B$ with
#    one that ramps up to $B$: look at what `megatron_scalars` writes as `lm loss vs
#    samples`.
#
#    </details>
#
# 2. On a GPU, `mem-reserved-bytes` stays far above `mem-allocated-bytes` after the first
#    iteration. What is the difference made of, and when would `empty_cache` help?
#
#    <details><summary>Hint</summary>
#
#    Reserved is what PyTorch's caching allocator holds from
#    the driver; allocated is what live tensors use. The gap is freed blocks kept for reuse
#    (activations of the last step) and fragments of them. `empty_cache` returns unused
#    cached blocks to the driver: it helps only when something outside the allocator (NCCL,
#    another process) needs that memory, never the step's own peak.
#
#    </details>

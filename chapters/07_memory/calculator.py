# %% [markdown]
# # 07.9 · Memory: `tinytron-memory` — the command and the layout search
#
# [07.7](megatron_gap.py) took one layout's ledger apart against Megatron's estimate and
# [07.8](config_ledger.py) read it from a trainer's config, its assumptions stated. This page
# makes that a command and asks the question a ledger alone cannot answer: of every layout
# of a model on a number of GPUs, which fit the device, and which of those is fastest?
# `tinytron-memory --config run.toml --world-size 256` prints the ledger of one layout;
# `tinytron-memory --example --search --gpu-memory 80GiB --gpus 256` lists the layouts that
# fit, ranked by the overlap-aware step time of pages 07.10 to 07.13.
#
# You will build: `Hardware`, `step_time`, `candidate_layouts`, `search_layouts`,
# `format_ledgers` and `main`.

# %%
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from tinytron.memory.config_ledger import (_DEFAULT_WHY, assumption_lines, memory_config_from,
                                           parse_bytes, resolve_device)
from tinytron.memory.ledger import (DEVICE_TERMS, RankLedger, megatron_args_from, plot_ledgers,
                                    stage_ledgers)
from tinytron.memory.megatron_gap import format_gap, megatron_gap, peak_parts, running_example
from tinytron.memory.megatron_model import megatron_theoretical_memory
from tinytron.memory.peak import activation_peak
from tinytron.memory.states import MemoryConfig, state_ledger
from tinytron.memory.step_time import estimate_step

__all__ = ["parse_bytes", "resolve_device", "memory_config_from", "running_example", "Hardware",
           "step_time", "candidate_layouts", "search_layouts", "peak_parts", "megatron_gap",
           "format_gap", "assumption_lines", "format_ledgers", "layout_name", "main"]

# %% [markdown]
# ## An estimated step time
#
# To rank the layouts that fit, the search needs a time per iteration: the overlap-aware
# model of pages 07.10 to 07.13 (`tinytron.memory.step_time.estimate_step`). Compute is
# every kernel of a micro-batch timed by appendix C's law from the device's datasheet (H100
# SXM by default); the pipeline bubble follows from the stages' compute; each TP, DP and PP
# transfer is charged only for what its window — by Megatron's rules, bucket by bucket —
# cannot hide. The search assumes Megatron's switches for speed: `overlap_grad_reduce`
# (buckets), `overlap_param_gather` with the distributed optimizer, `tp_comm_overlap` with
# sequence parallelism and `overlap_p2p_comm` with interleaving. `Hardware` keeps the
# constants under the names the command has always used; `step_time` returns the parts by
# name.
#
# For the running example it estimates 1.86 s per step — 1.65 s of compute, a 0.17 s
# bubble, 0.04 s of DP and PP transfers their windows cannot hide — the same model and
# assumptions as 07.13 quotes, except `tp_comm_overlap`, which the search turns on and the
# example's config file leaves off (07.13: 1.94 s with TP's traffic on the compute stream). These are
# estimates from stated constants, not measurements; 07.14 holds the same model against
# Megatron's published H100 throughput. `search_layouts` ranks the layouts that fit by the
# total, and between two equal totals prefers the one with the smaller peak: the one with
# more memory to spare. Change a constant of `Hardware` (a slower network, the A100's law)
# and the ranking moves; the memory side of the answer does not.

# %%
@dataclass
class Hardware:
    """The constants of the step-time model (defaults: H100 SXM nodes of 8 with 400 Gb/s NICs)."""

    device: str = "H100"
    """Appendix C's kernel law of this device (tinytron.kernels.roofline.LAWS)."""
    nvlink_bandwidth: float = 450e9
    network_bandwidth: float = 50e9
    gpus_per_node: int = 8

    def links(self):
        """The same constants as the step-time model's Links (07.10)."""
        from tinytron.kernels.roofline import LAWS
        from tinytron.memory.step_time import Links

        if self.device not in LAWS:
            raise ValueError(f"device must be one of {sorted(LAWS)}, got {self.device!r}")
        law = LAWS[self.device]
        return Links(peak_flops=law.gpu.bf16_flops, law=law, nvlink=self.nvlink_bandwidth,
                     network=self.network_bandwidth, memory=law.gpu.hbm_bytes_per_s,
                     gpus_per_node=self.gpus_per_node)


# %% [markdown]
# `step_time` runs 07.13's model with the search's switches and sums its items into the parts
# the search prints; what the parts leave over is the compute time NCCL takes from the SMs.

# %%
def step_time(cfg: MemoryConfig, hw: Hardware = Hardware(),
              buffer_elements: int | None = None) -> dict[str, float]:
    """Seconds per iteration by part: compute, bubble, and the exposed tp, cp, dp, pp, optimizer."""
    del buffer_elements  # the model reads chapter 05's buckets itself (kept for callers)
    step = estimate_step(cfg.replace(overlap_grad_reduce=True), hw.links(), search_options(cfg))
    exposed = {name: sum(i.exposed for i in step.items if i.item.startswith(prefix))
               for name, prefix in (("tp", "TP"), ("cp", "CP"), ("dp", "DP"), ("pp", "PP"))}
    parts = dict(compute=step.compute, bubble=step.bubble, **exposed, optimizer=step.optimizer)
    parts["interference"] = step.total - sum(parts.values())  # SMs NCCL takes from compute
    parts["total"] = step.total
    return parts


def search_options(cfg: MemoryConfig):
    """Megatron's switches for speed, as far as the layout allows them."""
    from tinytron.memory.step_time import StepOptions

    return StepOptions(overlap_grad_reduce=True, overlap_param_gather=cfg.use_distributed_optimizer,
                       overlap_p2p_comm=cfg.num_chunks > 1, checkpoint="none",
                       tp_comm_overlap=cfg.model.sequence_parallel
                       and cfg.tensor_model_parallel_size > 1)


# %% [markdown]
# ## The search
#
# Candidates, for a model, a GPU count and a global batch: TP in $\{1, 2, 4, 8\}$ (within a
# node, dividing the heads, groups, FFN and vocabulary; SP on whenever $t > 1$), PP over the
# divisors of $L$ up to 16, interleaving with $v = 2$ where the layers and micro-batches allow
# it, CP in $\{1, 2, 4\}$, DP what is left, micro-batch sizes in $\{1, 2, 4, 8\}$ that divide
# the global batch, recompute none / selective / full (uniform, 1 layer), and the distributed
# optimizer off and on. A layout fits when both its first and its last stage fit the budget;
# the resident part is computed first and the layout dropped before its activations when it
# alone does not fit. Ledgers of layouts that differ only in batch or recompute share their
# resident part through a cache.
#
# Why each filter of `candidate_layouts`:
#
# - **TP within a node** (`tp <= gpus_per_node`): TP's all-gathers and reduce-scatters run on
#   the compute stream, several per layer; over the network they would dominate the step.
# - **TP divides heads, groups, FFN and vocabulary**: each TP rank holds whole heads and an
#   equal slice of the MLP and the embedding (appendix A), else the model cannot be cut.
# - **PP divides the layers**: every stage gets the same number of layers, so the first
#   and the last stage bound the rest (below).
# - **$s$ divisible by $2\,c$**: CP cuts the sequence into $2c$ chunks and gives each rank one
#   from each end, so the causal work is balanced.
# - **Interleaving only when $m$ is a multiple of $p$ and $L$ of $2p$**: the interleaved
#   schedule runs micro-batches in groups of $p$, and each of the $v = 2$ chunks needs whole
#   layers.
# - **The micro-batch divides the global batch per DP rank**: $m$ must be an integer.
#
# For the 7B model on 256 GPUs with a global batch of 1,024 that space holds 2,514 candidate
# layouts, and 2,124 of them fit 80 GiB: a 7B model at this scale is not memory-bound, and the
# question the search answers is which layout is fastest. At 40 GiB, 1,651 still fit. Every
# candidate keeps SP on with TP, since SP only removes bytes.

# %%
def layout_name(cfg: MemoryConfig) -> str:
    """TP2(SP)·PP2·CP1·DP64 mbs2 m8 selective DistOpt."""
    sp = "(SP)" if cfg.model.sequence_parallel else ""
    vpp = f"x{cfg.num_chunks}" if cfg.num_chunks > 1 else ""
    rc = {None: "no-recompute", "selective": "selective", "full": "full"}[cfg.recompute_granularity]
    return (f"TP{cfg.tensor_model_parallel_size}{sp}·PP{cfg.pipeline_model_parallel_size}{vpp}"
            f"·CP{cfg.context_parallel_size}·DP{cfg.data_parallel_size} "
            f"mbs{cfg.micro_batch_size} m{cfg.num_microbatches} {rc}"
            + (" DistOpt" if cfg.use_distributed_optimizer else ""))


def _divides_model(model, tp: int) -> bool:
    return all(x % tp == 0 for x in (model.num_attention_heads, model.num_query_groups,
                                     model.ffn_hidden_size, model.vocab_size))


# %% [markdown]
# `candidate_layouts` applies those filters and yields each layout that passes, once per
# micro-batch size, interleaving, optimizer and recompute choice.

# %%
def candidate_layouts(base: MemoryConfig, gpus: int, global_batch_size: int,
                      hw: Hardware = Hardware()) -> Iterator[MemoryConfig]:
    """Every layout of the search space that can be cut and fills `gpus` ranks exactly."""
    model = base.model
    for tp, pp, cp in ((t, p, c) for t in (1, 2, 4, 8) for p in range(1, 17)
                       for c in (1, 2, 4)):
        if (gpus % (tp * pp * cp) or tp > hw.gpus_per_node or not _divides_model(model, tp)
                or model.num_layers % pp or (cp > 1 and model.seq_length % (2 * cp))):
            continue
        dp = gpus // (tp * pp * cp)
        sized = {rc: model.replace(sequence_parallel=tp > 1, recompute_granularity=rc,
                                   recompute_method="uniform" if rc == "full" else None,
                                   recompute_num_layers=1 if rc == "full" else None)
                 for rc in (None, "selective", "full")}
        for mbs in (1, 2, 4, 8):
            if global_batch_size % (mbs * dp):
                continue
            m = global_batch_size // (mbs * dp)
            vpps = [None] + ([2] if pp > 1 and m % pp == 0
                             and model.num_layers % (2 * pp) == 0 else [])
            for vpp, distopt, rc in ((v, o, r) for v in vpps for o in (False, True)
                                     for r in (None, "selective", "full")):
                yield base.replace(
                    model=sized[rc], tensor_model_parallel_size=tp,
                    pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                    context_parallel_size=cp, data_parallel_size=dp, micro_batch_size=mbs,
                    num_microbatches=m, use_distributed_optimizer=distopt)

# %% [markdown]
# The search itself checks the first and the last pipeline stage of every candidate, the two
# that bound the peak. Many candidates share their resident or their flowing bytes (these do not
# depend on every field of the layout), so both are cached under the fields they depend on.
#
# Why those two stages: under 1F1B stage $r$ holds $\min(p - r, m)$ micro-batches, so the
# first stage holds the most layers' activations, and the last stage holds the head, whose
# fp32 logits chain is the largest transient of the step (07.4). A middle stage has fewer
# micro-batches than the first and no head, so it can exceed neither (with equal layers per
# stage, as here). The caches follow the ledger's dependencies: the resident bytes depend on
# TP, PP, the chunks, DP · CP and the distributed optimizer, not on the micro-batch or the
# recompute; the activations depend on the micro-batch, the schedule and the recompute, not
# on DP or the optimizer. The 2,514 candidates need far fewer ledgers than that, and the
# search over them takes a few seconds on one CPU core.

# %%
def _resident(cfg: MemoryConfig, pp_rank: int, cache: dict) -> tuple[int, int]:
    """(device bytes of weights, grads and optimizer state; grad-buffer elements), cached."""
    key = ("states", cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
           cfg.num_chunks, cfg.data_parallel_size * cfg.context_parallel_size,
           cfg.use_distributed_optimizer, pp_rank)
    if key not in cache:
        states = state_ledger(cfg, pp_rank)
        cache[key] = (sum(v for k, v in states.items() if k != "host_optimizer"),
                      states["grad_buffer"] // cfg.grad_bytes)
    return cache[key]


def _flowing(cfg: MemoryConfig, pp_rank: int, cache: dict) -> int:
    """Peak activation + p2p bytes, cached (they do not depend on DP or the optimizer)."""
    key = ("acts", cfg.tensor_model_parallel_size, cfg.context_parallel_size,
           cfg.pipeline_model_parallel_size, cfg.num_chunks, cfg.micro_batch_size,
           cfg.num_microbatches, cfg.recompute_granularity, pp_rank)
    if key not in cache:
        cache[key] = activation_peak(cfg, pp_rank)["peak"]
    return cache[key]


def search_layouts(base: MemoryConfig, gpus: int, gpu_memory: int, global_batch_size: int,
                   hw: Hardware = Hardware(), top: int = 10) -> list[dict]:
    """Layouts whose first and last stage fit gpu_memory, fastest (estimated) first."""
    fits, cache = [], {}
    for cfg in candidate_layouts(base, gpus, global_batch_size, hw):
        stages = sorted({0, cfg.pipeline_model_parallel_size - 1})
        resident = {r: _resident(cfg, r, cache) for r in stages}
        if max(res for res, _ in resident.values()) > gpu_memory:
            continue
        peak = max(resident[r][0] + _flowing(cfg, r, cache) for r in stages)
        if peak <= gpu_memory:
            fits.append({"config": cfg, "layout": layout_name(cfg), "peak_bytes": peak,
                         "time": step_time(cfg, hw, buffer_elements=resident[0][1])})
    fits.sort(key=lambda f: (f["time"]["total"], f["peak_bytes"]))
    return fits[:top]


# %% [markdown]
# ## Printing a ledger
#
# Each stage gets a table of terms in MiB, a total, a stacked text bar (one letter per term:
# **W**eights, **G**rads, **M**asters, **O**ptimizer moments, fp32 grad **C**opies,
# **A**ctivations, **P**2p), and the moment of its peak; Megatron's two numbers follow. The
# assumption lines come first, right under the layout, and the gap table last, so a reader
# who stops after the first screen has seen what the numbers rest on.
# The bar of the running example's stage 0 reads `WWWWWWGGGGGGGGGGGAAAA…`: the fp32 grad
# buffer is twice the weights, and the activations are more than both together. The moments
# and masters, split 64 ways, are too small to earn a letter.

# %%
_LETTERS = dict(zip(DEVICE_TERMS, "WGMOCAP"))


def _bar(led: RankLedger, scale: float, width: int = 60) -> str:
    """A stacked text bar of the device terms, `scale` bytes per character."""
    return "".join(_LETTERS[k] * round(v / scale) for k, v in led.device.items())[:width + 5]


# %% [markdown]
# `format_ledgers` writes the printed page: the layout, the assumptions, each stage's terms
# and bar, Megatron's two numbers, and the gap table.

# %%
def format_ledgers(cfg: MemoryConfig, dp_rank: int = 0, why: dict | None = None) -> str:
    """The assumptions, the first and last stage's ledgers, Megatron's estimate and the gap."""
    ledgers = stage_ledgers(cfg, dp_rank)
    mib = 2**20
    scale = max(led.total for led in ledgers) / 60
    lines = [f"layout {layout_name(cfg)}, {cfg.world_size} ranks, "
             f"{'bf16' if cfg.bf16 else 'fp32'}, device {cfg.device}"]
    lines += assumption_lines(cfg, why or _DEFAULT_WHY)
    for led in ledgers:
        name = {0: "first"}.get(led.pp_rank, "last")
        lines.append(f"stage {led.pp_rank} ({name}), DP rank {dp_rank}:")
        lines += [f"  {k:<18}{v / mib:>14,.1f} MiB" for k, v in led.device.items() if v]
        lines += [f"  {k:<18}{v / mib:>14,.1f} MiB (host)" for k, v in led.host.items() if v]
        lines.append(f"  {'total (device)':<18}{led.total / mib:>14,.1f} MiB   peak at "
                     f"{led.peak['at']}, {led.peak['max_in_flight']} in flight")
        lines.append(f"  [{_bar(led, scale)}]")
    meg = megatron_theoretical_memory(megatron_args_from(cfg), cfg.num_microbatches)
    lines.append(f"Megatron's estimate: weight and optimizer {meg['weight_and_optimizer_mib']:,.2f}"
                 f" MiB, activation {meg['activation_mib']:,.2f} MiB ({meg['branch']})")
    lines.append("legend: " + " ".join(f"{c}={k}" for k, c in _LETTERS.items()))
    return "\n".join(lines + format_gap(cfg, dp_rank))


# %% [markdown]
# `_ledger_json` carries the same content for programs, every term in bytes.

# %%
def _ledger_json(cfg: MemoryConfig, dp_rank: int, why: dict | None = None) -> dict:
    """Machine-readable: every stage's terms in bytes, Megatron's estimate, the gap by term."""
    meg = megatron_theoretical_memory(megatron_args_from(cfg), cfg.num_microbatches)
    why = why or _DEFAULT_WHY
    gaps = {r: megatron_gap(cfg, r, dp_rank)
            for r in sorted({0, cfg.pipeline_model_parallel_size - 1})}
    return {"layout": layout_name(cfg),
            "assumed": {"world_size": cfg.world_size, "device": cfg.device,
                        "num_microbatches": cfg.num_microbatches,
                        **{f"{k}_from": v for k, v in why.items()},
                        "lines": assumption_lines(cfg, why)},
            "stages": [{"pp_rank": led.pp_rank, "device": led.device, "host": led.host,
                        "total": led.total,
                        "megatron_gap": {"difference": gaps[led.pp_rank]["difference"],
                                         "terms": gaps[led.pp_rank]["terms"]}}
                       for led in stage_ledgers(cfg, dp_rank)],
            "megatron": {k: meg[k] for k in ("weight_and_optimizer", "activation", "branch")},
            "step_time": step_time_json(cfg)}

# %% [markdown]
# The step time in the JSON is 07.13's model under the search's switches, item by item, so
# the ledger and the time of a layout travel together.

# %%
def step_time_json(cfg: MemoryConfig, hw: Hardware = Hardware()) -> dict:
    """07.13's step time of a layout under the search's switches: seconds and exposed items."""
    try:
        step = estimate_step(cfg.replace(overlap_grad_reduce=True), hw.links(),
                             search_options(cfg))
    except ValueError as e:  # a layout the memory model takes and the time model cannot
        return {"error": str(e)}
    return {"total_s": step.total, "compute_s": step.compute, "bubble_s": step.bubble,
            "optimizer_s": step.optimizer, "exposed_s": step.exposed, "device": hw.device,
            "items": [{"item": i.item, "seconds": i.seconds, "exposed": i.exposed}
                      for i in step.items]}


# %% [markdown]
# ## The command
#
# ```
# tinytron-memory --config configs/x.toml --world-size 256 [--section.key value ...]
#                 [--device cuda|cpu] [--dp-rank R] [--json] [--plot ledger.png]
# tinytron-memory --example [--search --gpu-memory 80GiB --gpus 256 [--top 10]]
# ```
#
# `--json` prints the same ledger for programs: the layout's name, `assumed` (the world size,
# device and micro-batches per step, where each came from, and the printed assumption lines),
# per stage its `pp_rank`, the `device` and `host` terms in bytes, the `total` and
# `megatron_gap` (the `difference` and every named term in bytes, zeros included), and
# Megatron's `weight_and_optimizer`, `activation` and the formula `branch` it took.
# It also carries `step_time`: 07.13's model of the layout under the search's switches, in
# seconds — the total, compute, bubble, optimizer and exposed parts, and every item with
# its seconds alone and what of it stays exposed — so a program reading the ledger reads
# the time with it. `--search --json` prints the ranked layouts the same way: each one's
# name, its peak in bytes and that `step_time`, fastest first. A layout the memory model
# accepts and the time model cannot place (say, a shape the kernel law was never told
# about) gets an `error` line instead of numbers, and the ledger is printed all the same.
# `--dp-rank` picks the DP rank whose optimizer shard is counted (the ranks differ where
# padding falls, 07.2).
# Exit status 0 on success; 2, with one line on stderr naming the flag or the config field,
# on any bad input — the demo below ends with one, `--gpu-memory eighty`.

# %%
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinytron-memory",
                                description="Per-rank memory ledger of a tinytron layout.")
    p.add_argument("--config", help="the trainer's TOML file")
    p.add_argument("--example", action="store_true", help="the book's 7B running example")
    p.add_argument("--world-size", type=int, help="ranks of the run (default tp·pp·cp)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="default: the config's; auto as the trainer resolves it")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", help="write the stacked-bar picture to this PNG file")
    p.add_argument("--search", action="store_true", help="list layouts that fit, fastest first")
    p.add_argument("--gpu-memory", help="device budget for --search (default 80GiB)")
    p.add_argument("--gpus", type=int, help="GPUs for --search (default: the world size)")
    p.add_argument("--global-batch-size", type=int, help="for --search (default: the config's)")
    p.add_argument("--top", type=int, help="layouts --search lists (default 10)")
    return p


# %% [markdown]
# `_config_from_args` builds the `MemoryConfig` the flags name, the example or a TOML file
# with overrides, and records where the world size, the device and the batch came from.

# %%
def _config_from_args(args, overrides: list[str]) -> tuple[MemoryConfig, dict]:
    """The MemoryConfig the command works on (the example, or the TOML file plus overrides),
    and where its world size, device and batch came from."""
    if args.example:
        if args.config or overrides:
            raise ValueError("--example takes no --config and no --section.key overrides")
        if args.world_size not in (None, 256):
            raise ValueError(f"--world-size: the example runs on 256 ranks, got {args.world_size}")
        cfg = running_example()
        why = {"world": "the running example's", "batch": "the running example's global "
               "batch 1024", "device": "--device" if args.device else "the running example's"}
        return (cfg.replace(device=args.device) if args.device else cfg), why
    if args.config is None and not overrides:
        raise ValueError("give --config FILE, --section.key overrides, or --example")
    from tinytron.config import load_config

    train = load_config(args.config, overrides)
    tp, pp, _, cp = train.parallel.sizes()
    device, device_why = resolve_device(train.training.device, args.device)
    cfg = memory_config_from(train, args.world_size or tp * pp * cp, device)
    t, dp = train.training, cfg.data_parallel_size
    why = {"world": "--world-size" if args.world_size else f"not given: --world-size defaults "
           f"to TP · PP · CP = {tp * pp * cp}", "device": device_why,
           "batch": (f"global batch {t.global_batch_size} / (micro-batch {t.micro_batch_size}"
                     f" · DP {dp})" if t.global_batch_size else
                     "no global batch in the config: one micro-batch per DP rank")}
    return cfg, why

# %% [markdown]
# `_run` does what the flags ask: the search, or the ledger of every stage as a table or JSON,
# and the picture when `--plot` names a file. `main` turns any bad input into one line on
# stderr and exit status 2.
#
# The errors it turns into that line are `ValueError`s — this chapter's checks and
# `tinytron.config`'s `ConfigError`, each naming a field or a flag — and `OSError`, a config
# file that cannot be read; anything else is a bug and keeps its traceback. The console script `tinytron-memory` is `main` itself, so a test
# can call `main([...])` and read the same stdout, stderr and exit status a user sees.

# %%
def _print_search(cfg: MemoryConfig, why: dict, args) -> None:
    """`--search`: the fastest layouts that fit, as a table or (with --json) for programs."""
    budget = args.gpu_memory or "80GiB"
    gpus = args.gpus or cfg.world_size
    gbs = args.global_batch_size or cfg.micro_batch_size * cfg.data_parallel_size \
        * cfg.num_microbatches
    t0 = time.perf_counter()
    found = search_layouts(cfg, gpus, parse_bytes(budget), gbs, top=args.top or 10)
    if args.json:  # the ranked layouts alone, for programs
        print(json.dumps([{"layout": f["layout"], "peak_bytes": f["peak_bytes"],
                           "step_time": step_time_json(f["config"])} for f in found]))
        return
    print(assumption_lines(cfg, why)[1].split(";")[0] + f"; {gpus} GPUs ("
          + ("--gpus" if args.gpus else "the world size") + ")")
    print(f"{len(found)} fastest layouts of {gpus} GPUs that fit {budget} "
          f"(global batch {gbs}); searched in {time.perf_counter() - t0:.2f} s")
    for i, f in enumerate(found, 1):
        print(f"{i:>3}. {f['layout']:<55} peak {f['peak_bytes'] / 2**30:6.1f} GiB   "
              f"step ~{f['time']['total']:.2f} s")

# %% [markdown]
# `_run` checks that the search-only flags come with `--search`, then either searches or
# prints the ledger (and draws it with `--plot`).

# %%
def _run(argv: Sequence[str] | None) -> None:
    """Parse, build, print (or search); raises ValueError with a one-line message."""
    args, overrides = _parser().parse_known_args(argv)
    cfg, why = _config_from_args(args, overrides)
    search_only = [flag for flag, value in (("--gpus", args.gpus), ("--gpu-memory", args.gpu_memory),
                   ("--global-batch-size", args.global_batch_size), ("--top", args.top))
                   if value is not None]
    if search_only and not args.search:
        raise ValueError(f"{', '.join(search_only)} only apply with --search")
    if args.search:
        _print_search(cfg, why, args)
        return
    if not 0 <= args.dp_rank < cfg.data_parallel_size * cfg.context_parallel_size:
        raise ValueError(f"--dp-rank must be in [0, "
                         f"{cfg.data_parallel_size * cfg.context_parallel_size})")
    print(json.dumps(_ledger_json(cfg, args.dp_rank, why)) if args.json
          else format_ledgers(cfg, args.dp_rank, why))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        ledgers = {f"stage {led.pp_rank}": led for led in stage_ledgers(cfg, args.dp_rank)}
        ax = plot_ledgers(ledgers)
        ax.set_title(layout_name(cfg), fontsize=8)
        ax.figure.tight_layout()
        ax.figure.savefig(args.plot, dpi=120)

# %% [markdown]
# `main` is the console script: any `ValueError` or `OSError` becomes one line on stderr and
# exit status 2.

# %%
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `tinytron-memory`: 0, or 2 with a one-line error naming the field."""
    try:
        _run(argv)
    except (ValueError, OSError) as err:  # ConfigError is a ValueError
        print(f"tinytron-memory: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


# %% [markdown]
# ## Demo: the running example, printed and searched
#
# The same function the console script calls, on the running example, then the search over
# 256 GPUs with 80 GiB each for the same global batch of 1024 sequences.

# %%
if __name__ == "__main__":
    assert main(["--example"]) == 0
    t0 = time.perf_counter()
    found = search_layouts(running_example(), 256, parse_bytes("80GiB"), 1024, top=8)
    elapsed = time.perf_counter() - t0
    for f in found:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in f["time"].items() if v and k != "total")
        print(f"{f['layout']:<55} {f['peak_bytes'] / 2**30:5.1f} GiB  ~{f['time']['total']:.2f} s"
              f" ({parts})")
    print(f"search: {elapsed:.2f} s")
    assert found and all(f["peak_bytes"] <= parse_bytes("80GiB") for f in found)
    assert main(["--example", "--search", "--gpu-memory", "eighty"]) == 2

# %% [markdown]
# The search's answer, as the cell prints it (peak of the larger stage; estimated step time
# and its parts):
#
# | layout | peak | step | compute | CP | DP | interference |
# |---|---|---|---|---|---|---|
# | TP2(SP)·PP1·CP1·DP128 mbs4 m2 no-recompute DistOpt | 78.8 GiB | 1.50 s | 1.47 | | 0.01 | 0.01 |
# | TP1·PP1·CP1·DP256 mbs1 m4 no-recompute DistOpt | 69.0 GiB | 1.50 s | 1.48 | | 0.01 | 0.01 |
# | TP4(SP)·PP1·CP1·DP64 mbs8 m2 no-recompute DistOpt | 68.4 GiB | 1.51 s | 1.48 | | 0.01 | 0.01 |
# | TP2(SP)·PP1·CP1·DP128 mbs2 m4 no-recompute DistOpt | 50.0 GiB | 1.51 s | 1.48 | | 0.01 | 0.01 |
# | TP4(SP)·PP1·CP1·DP64 mbs4 m4 no-recompute DistOpt | 39.6 GiB | 1.51 s | 1.49 | | 0.01 | 0.01 |
# | TP2(SP)·PP1·CP1·DP128 mbs1 m8 no-recompute DistOpt | 35.7 GiB | 1.52 s | 1.49 | | 0.01 | 0.01 |
# | TP2(SP)·PP1·CP2·DP64 mbs2 m8 no-recompute DistOpt | 71.3 GiB | 1.53 s | 1.49 | 0.01 | 0.01 | 0.01 |
# | TP4(SP)·PP1·CP1·DP64 mbs4 m4 no-recompute | 60.3 GiB | 1.54 s | 1.49 | | 0.02 | 0.02 |
#
# Against the running example's 1.86 s, the best of them saves the 0.17 s bubble and the
# recompute. Seven of the eight use the distributed optimizer: without it each rank holds all
# 18 bytes per parameter (07.2), which only TP 4 makes small enough here (the last row). The
# TP2 layout without it would need 62.9 GiB of resident state (3.75e9 parameters per TP-2
# rank without a pipeline) plus a 28.7 GiB activation peak (all 32 layers of one micro-batch
# of 2): 91.6 GiB, not 80.
#
# The same eight layouts drawn: each one's peak against the budget, with its estimated step
# time. All eight fit. With the DP traffic hidden by Megatron's overlap rules and TP's by
# `tp_comm_overlap`, the layouts without a pipeline win (no bubble, and no single-bucket
# all-gather on a later stage), and the eight lie within 3% of each other: compute is
# almost all of each step, and what separates them is how well each layout's GEMMs fill
# the H100's waves. The search chooses among near-equals, and the estimate's own error
# (07.14 holds it against Megatron's published runs, within about 10%) is larger than the
# gaps. That is why production tools confirm the top few candidates with
# short profiling runs instead of trusting the model's ranking.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    rows = found[::-1]  # fastest at the top
    peaks = [f["peak_bytes"] / 2**30 for f in rows]
    ax.barh(range(len(rows)), peaks, color="tab:blue")
    ax.axvline(80, color="tab:red", ls="--", label="80 GiB budget")
    for i, (f, peak) in enumerate(zip(rows, peaks)):
        ax.text(peak + 1, i, f"~{f['time']['total']:.2f} s/step", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [f["layout"] for f in rows], fontsize=8)
    ax.set_xlim(0, 100)
    ax.set_xlabel("peak GiB per GPU (the larger of the first and last stage)")
    ax.set_title("The 7B example on 256 GPUs: the fastest layouts that fit", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    plt.show()
    times = [f["time"]["total"] for f in found]
    assert all(peak <= 80 for peak in peaks) and max(times) / min(times) < 1.10
    assert all(f["config"].pipeline_model_parallel_size == 1 for f in found[:3])

# %% [markdown]
# *Figure:* every layout that fits is within 3% of the fastest — the search picks among
# near-equals, closer to each other than the model is to a clock.

# %% [markdown]
# ## What the calculator cannot see
#
# The ledger counts tensor bytes: what PyTorch's caching allocator is asked for. A real
# device also holds what no tensor owns — the CUDA context, the communication library's
# buffers, the math libraries' workspaces — and the allocator itself rounds every request up
# to its block sizes and keeps freed blocks cached, so fragmentation can make a request fail
# below the budget. 07.6 checks the ledger against two instruments that both count tensor
# bytes on a CPU; no number on this page is a GPU measurement. Leave a margin: the search's
# `--gpu-memory` is the budget for tensors, not the card's capacity.
#
# ## How production does it
#
# - Megatron's `report_memory` (`megatron/training/utils/common_utils.py:282`) prints the
#   allocator's allocated, max-allocated, reserved and max-reserved MiB: reserved minus
#   allocated is the cache and fragmentation the ledger cannot see.
# - Megatron prints its estimate at the first iteration (`megatron/training/training.py:2698`)
#   and the allocator's numbers with `--log-memory-to-tensorboard` / `report_memory`.
# - NVIDIA NeMo's auto-configurator and Megatron-LM's `tools/` scripts search layouts with a
#   memory model plus short profiling runs; torchtitan leaves the layout to the user and
#   reports `torch.cuda.max_memory_allocated` per step.
#
# ## Exercises
#
# 1. Give the search 40 GiB instead of 80 GiB: which mechanism appears in every layout that
#    still fits?
#
#    <details><summary>Answer</summary>
#
#    Model parallelism: all 1,651 layouts that fit 40 GiB
#    cut the weights with TP or PP (at 80 GiB, 19 of the 2,124 are pure DP). Plain DP 256,
#    even with the distributed optimizer, peaks at 69.0 GiB. The fastest left is
#    TP4(SP)·PP1·CP1·DP64 mbs4 m4 without recompute and with the distributed optimizer:
#    39.6 GiB, about 1.51 s.
#
#    </details>
#
# 2. Set `Hardware.network_bandwidth` to 25 GB/s. Does the best layout change, and why?
#    (07.11's rules: which window does the reduce-scatter no longer fit?)
#
#    <details><summary>Answer</summary>
#
#    No: the first five keep their order, each about
#    0.02 s slower (exposed DP 0.012 → 0.023 s, interference 0.012 → 0.024 s); the best is
#    still TP2(SP)·PP1·CP1·DP128 mbs4 m2, 1.52 s. Without a pipeline the reduce-scatter runs
#    bucket by bucket behind the backward, and only the last bucket's, which has no backward
#    left to hide behind, is exposed; halving the bandwidth doubles it. A layout with one
#    sequence per micro-batch has a shorter backward to hide behind: TP2 mbs1 m8 exposes
#    0.047 s and drops from sixth to seventh.
#
#    </details>

# %% [markdown]
# # 07.7 · Memory: `tinytron-memory`, the calculator and the layout search
#
# The ledger as a command. `tinytron-memory --config run.toml --world-size 256` reads the
# trainer's config and prints the first and the last stage's ledger next to Megatron's
# estimate; `tinytron-memory --example --search --gpu-memory 80GiB --gpus 256` lists the
# layouts that fit a device, ranked by an estimated step time.
#
# You will build: `parse_bytes`, `memory_config_from`, `running_example`, `Hardware`,
# `step_time`, `candidate_layouts`, `search_layouts`, `format_ledgers` and `main`. The step
# time it ranks by is the next page's overlap-aware model.
#
# **What it answers, on the running example.** `tinytron-memory --example` prints, for DP
# rank 0 of the first and the last pipeline stage (flash attention, no dropout, selective
# recompute, as on the front page):
#
# | term | stage 0 | stage 1 |
# |---|---|---|
# | weights (bf16 param buffer) | 3,829.2 MiB | 3,829.3 MiB |
# | grad buffer (fp32) | 7,658.5 MiB | 7,658.5 MiB |
# | fp32 masters, $1/64$ | 119.7 MiB | 119.7 MiB |
# | Adam moments, $1/64$ | 239.3 MiB | 239.3 MiB |
# | activations at the peak | 28,673.6 MiB | 21,446.6 MiB |
# | **total on the device** | **40,520.4 MiB** | **33,293.4 MiB** |
# | where the peak is | backward of micro-batch 0, 2 in flight | forward of micro-batch 0, 1 in flight |
#
# Megatron's estimate for the same layout is 11,846.75 MiB of weights and optimizer state and
# 16,416.06 MiB of activations. The resident parts agree to 12,672 B (07.2 explains the
# difference: where the final norm is counted). The activations do not: Megatron charges
# 512 MiB per layer and micro-batch, this ledger 888 MiB (07.3: the fp32 norm inputs, the
# all-gathered linear inputs that SP does not shrink, the whole SwiGLU chain), for the same
# 32 layer-micro-batches on stage 0 — 16 layers, 2 micro-batches in flight. Both fit an
# 80 GiB device; only the ledger says by how much.

# %%
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from tinytron.memory.peak import activation_peak
from tinytron.memory.ledger import (DEVICE_TERMS, RankLedger, megatron_args_from, plot_ledgers,
                                    stage_ledgers)
from tinytron.memory.megatron_model import megatron_theoretical_memory
from tinytron.memory.states import MemoryConfig, state_ledger

__all__ = ["parse_bytes", "memory_config_from", "running_example", "Hardware", "step_time",
           "candidate_layouts", "search_layouts", "format_ledgers", "layout_name", "main"]

# %% [markdown]
# ## From the trainer's config to a `MemoryConfig`
#
# The command reads the same TOML file as the trainer (`tinytron.config.load_config`: sections
# `[model]`, `[parallel]`, `[training]`, `[optimizer]`, `[ddp]`, dotted `--section.key value`
# overrides) and the world size, which the file does not hold. It checks what the trainer
# checks before any process group exists — the layout against the model, the global batch
# against micro-batch × DP — and every error names the field:
# `tinytron-memory: error: training.global_batch_size (1000) must be divisible by ...`, exit
# status 2, no traceback. With bf16 the grad buffer is fp32 (Megatron forces it); the device
# `auto` means CUDA, where the ledger is meant to be used.
#
# Where each field comes from:
#
# | `MemoryConfig` field | from |
# |---|---|
# | `tensor_model_parallel_size`, `pipeline_model_parallel_size`, `virtual_pipeline_model_parallel_size`, `context_parallel_size` | `[parallel]` |
# | `data_parallel_size` | `--world-size` divided by TP · PP · CP |
# | `micro_batch_size`, `num_microbatches` | `[training]`: global batch / (micro-batch · DP); without a global batch, one micro-batch per DP rank |
# | `bf16`, `grad_reduce_in_fp32` | `[training] bf16` (or the optimizer's); bf16 forces the fp32 grad buffer |
# | `use_distributed_optimizer`, offload switches, `optimizer` | `[optimizer]` (`[ddp]` follows the distributed optimizer) |
# | `overlap_grad_reduce`, `bucket_size`, `pad_buckets_for_high_nccl_busbw` | `[ddp]` |
# | the model, recompute and activation offload | `[model]` |
#
# Sizes on the command line read both ways: `parse_bytes("80GiB")` is 85,899,345,920 bytes
# (binary units), `parse_bytes("80GB")` 80,000,000,000 (decimal). A device sold as "80 GB"
# reports its capacity in binary units, so `80GiB` is the budget to pass.

# %%
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80000000000, '1024' -> 1024."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--gpu-memory: cannot read {text!r} as a size (e.g. 80GiB, 80GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _layout_sizes(train, world_size: int) -> tuple[int, int, int, int, int]:
    """(tp, pp, vpp, cp, dp) from [parallel] and the world size, checked."""
    from tinytron.config import ConfigError

    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    tp, pp, vpp, cp = train.parallel.sizes()
    dp = train.data_parallel_size(world_size)
    try:
        train.model.check_layout(tp=tp, cp=cp, pp=pp, num_virtual_stages=vpp)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e
    return tp, pp, vpp, cp, dp


def memory_config_from(train, world_size: int, device: str | None = None) -> MemoryConfig:
    """A MemoryConfig from the trainer's TrainConfig (tinytron.config) and a world size."""
    from tinytron.config import ConfigError

    tp, pp, vpp, cp, dp = _layout_sizes(train, world_size)
    t, opt, ddp, model = train.training, train.optimizer, train.ddp, train.model
    gbs = t.global_batch_size or t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        raise ConfigError(f"training.global_batch_size ({gbs}) must be divisible by "
                          f"micro_batch_size·dp = {t.micro_batch_size}·{dp}")
    bf16 = t.bf16 or getattr(opt, "bf16", False)
    device = device or ("cuda" if t.device == "auto" else t.device)
    return MemoryConfig(
        model, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, context_parallel_size=cp,
        data_parallel_size=dp, micro_batch_size=t.micro_batch_size,
        num_microbatches=gbs // (t.micro_batch_size * dp), bf16=bf16,
        grad_reduce_in_fp32=bf16 or ddp.grad_reduce_in_fp32,
        use_distributed_optimizer=opt.use_distributed_optimizer,  # [ddp] follows it (tinytron.config)
        overlap_grad_reduce=ddp.overlap_grad_reduce, bucket_size=ddp.bucket_size,
        pad_buckets_for_high_nccl_busbw=ddp.pad_buckets_for_high_nccl_busbw,
        optimizer=opt.optimizer, optimizer_cpu_offload=opt.optimizer_cpu_offload,
        optimizer_offload_fraction=opt.optimizer_offload_fraction, device=device)


def running_example() -> MemoryConfig:
    """The book's 7B example: TP2 (SP) · PP2 · DP64, mbs 2, m 8, bf16, DistOpt, selective."""
    from tinytron.model.config import llama_7b_config

    return MemoryConfig(llama_7b_config(sequence_parallel=True, recompute_granularity="selective"),
                        tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        data_parallel_size=64, micro_batch_size=2, num_microbatches=8,
                        use_distributed_optimizer=True)


# %% [markdown]
# ## An estimated step time
#
# To rank the layouts that fit, the search needs a time per iteration: the overlap-aware
# model of the next page (07.8, `tinytron.memory.step_time.estimate_step`). Compute is
# chapter 01's FLOP count at `efficiency` × the dense bf16 peak (H100 SXM: 989 TFLOP/s; 0.5
# is a typical achieved fraction for a 7B model); the pipeline bubble follows from the
# stages' compute; TP's and CP's traffic runs on the compute stream; each DP and PP transfer
# is charged only for what its window — by Megatron's rules, bucket by bucket — cannot hide.
# The search assumes Megatron's switches for speed: `overlap_grad_reduce` (buckets), and
# `overlap_param_gather` with the distributed optimizer. `Hardware` keeps the constants
# under the names the command has always used; `step_time` returns the parts by name.
#
# For the running example it estimates 2.14 s per step: 1.74 s of compute, a 0.19 s
# pipeline bubble ($p = 2$, $m = 8$), 0.08 s of TP traffic on the compute stream, and 0.13 s
# of DP and 0.01 s of PP transfers that their windows cannot hide. These are estimates from
# the constants above, not measurements; 07.8 says how far such estimates are off.
# `search_layouts` ranks the layouts that fit by the total, and between two equal totals
# prefers the one with the smaller peak: the one with more memory to spare. Change a
# constant of `Hardware` (a slower network, a lower `efficiency`) and the ranking moves; the
# memory side of the answer does not.

# %%
@dataclass
class Hardware:
    """The constants of the step-time model (defaults: H100 SXM nodes of 8 with 400 Gb/s NICs)."""

    peak_flops: float = 989e12
    efficiency: float = 0.5
    nvlink_bandwidth: float = 450e9
    network_bandwidth: float = 50e9
    gpus_per_node: int = 8

    def links(self):
        """The same constants as the step-time model's Links (07.8)."""
        from tinytron.memory.step_time import Links

        return Links(peak_flops=self.peak_flops, mfu=self.efficiency, nvlink=self.nvlink_bandwidth,
                     network=self.network_bandwidth, gpus_per_node=self.gpus_per_node)


def step_time(cfg: MemoryConfig, hw: Hardware = Hardware(),
              buffer_elements: int | None = None) -> dict[str, float]:
    """Seconds per iteration by part: compute, bubble, and the exposed tp, cp, dp, pp, optimizer."""
    from tinytron.memory.step_time import StepOptions, estimate_step

    del buffer_elements  # the model reads chapter 05's buckets itself (kept for callers)
    options = StepOptions(overlap_grad_reduce=True,
                          overlap_param_gather=cfg.use_distributed_optimizer, checkpoint="none")
    step = estimate_step(cfg.replace(overlap_grad_reduce=True), hw.links(), options)
    exposed = {name: sum(i.exposed for i in step.items if i.item.startswith(prefix))
               for name, prefix in (("tp", "TP"), ("cp", "CP"), ("dp", "DP"), ("pp", "PP"))}
    parts = dict(compute=step.compute, bubble=step.bubble, **exposed, optimizer=step.optimizer)
    parts["total"] = sum(parts.values())
    return parts


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
# layouts, and 2,182 of them fit 80 GiB: a 7B model at this scale is not memory-bound, and the
# question the search answers is which layout is fastest. At 40 GiB, 1,722 still fit. Every
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
# **A**ctivations, **P**2p), and the moment of its peak; Megatron's two numbers follow.
# The bar of the running example's stage 0 reads `WWWWWWGGGGGGGGGGGAAAA…`: the fp32 grad
# buffer is twice the weights, and the activations are more than both together. The moments
# and masters, split 64 ways, are too small to earn a letter.

# %%
_LETTERS = dict(zip(DEVICE_TERMS, "WGMOCAP"))


def _bar(led: RankLedger, scale: float, width: int = 60) -> str:
    """A stacked text bar of the device terms, `scale` bytes per character."""
    return "".join(_LETTERS[k] * round(v / scale) for k, v in led.device.items())[:width + 5]


def format_ledgers(cfg: MemoryConfig, dp_rank: int = 0) -> str:
    """The first and last stage's ledgers, and Megatron's estimate, as text."""
    ledgers = stage_ledgers(cfg, dp_rank)
    mib = 2**20
    scale = max(led.total for led in ledgers) / 60
    lines = [f"layout {layout_name(cfg)}, {cfg.world_size} ranks, "
             f"{'bf16' if cfg.bf16 else 'fp32'}, device {cfg.device}"]
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
    return "\n".join(lines)


def _ledger_json(cfg: MemoryConfig, dp_rank: int) -> dict:
    """Machine-readable: every stage's terms in bytes and Megatron's estimate."""
    meg = megatron_theoretical_memory(megatron_args_from(cfg), cfg.num_microbatches)
    return {"layout": layout_name(cfg),
            "stages": [{"pp_rank": led.pp_rank, "device": led.device, "host": led.host,
                        "total": led.total} for led in stage_ledgers(cfg, dp_rank)],
            "megatron": {k: meg[k] for k in ("weight_and_optimizer", "activation", "branch")}}


# %% [markdown]
# ## The command
#
# ```
# tinytron-memory --config configs/x.toml --world-size 256 [--section.key value ...]
#                 [--device cuda|cpu] [--dp-rank R] [--json] [--plot ledger.png]
# tinytron-memory --example [--search --gpu-memory 80GiB --gpus 256 [--top 10]]
# ```
#
# `--json` prints the same ledger for programs: the layout's name, per stage its `pp_rank`,
# the `device` and `host` terms in bytes and the `total`, and Megatron's
# `weight_and_optimizer`, `activation` and the formula `branch` it took. `--dp-rank` picks
# the DP rank whose optimizer shard is counted (the ranks differ where padding falls, 07.2).
# Exit status 0 on success; 2, with one line on stderr naming the flag or the config field,
# on any bad input — the demo below ends with one, `--gpu-memory eighty`.

# %%
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tinytron-memory",
                                description="Per-rank memory ledger of a tinytron layout.")
    p.add_argument("--config", help="the trainer's TOML file")
    p.add_argument("--example", action="store_true", help="the book's 7B running example")
    p.add_argument("--world-size", type=int, help="ranks of the run (default tp·pp·cp)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: the config's, cuda for auto")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", help="write the stacked-bar picture to this PNG file")
    p.add_argument("--search", action="store_true", help="list layouts that fit, fastest first")
    p.add_argument("--gpu-memory", help="device budget for --search (default 80GiB)")
    p.add_argument("--gpus", type=int, help="GPUs for --search (default: the world size)")
    p.add_argument("--global-batch-size", type=int, help="for --search (default: the config's)")
    p.add_argument("--top", type=int, help="layouts --search lists (default 10)")
    return p


def _config_from_args(args, overrides: list[str]) -> MemoryConfig:
    """The MemoryConfig the command works on: the example, or the TOML file plus overrides."""
    if args.example:
        if args.config or overrides:
            raise ValueError("--example takes no --config and no --section.key overrides")
        if args.world_size not in (None, 256):
            raise ValueError(f"--world-size: the example runs on 256 ranks, got {args.world_size}")
        cfg = running_example()
        return cfg.replace(device=args.device) if args.device else cfg
    if args.config is None and not overrides:
        raise ValueError("give --config FILE, --section.key overrides, or --example")
    from tinytron.config import load_config

    train = load_config(args.config, overrides)
    tp, pp, _, cp = train.parallel.sizes()
    return memory_config_from(train, args.world_size or tp * pp * cp, args.device)

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
def _run(argv: Sequence[str] | None) -> None:
    """Parse, build, print (or search); raises ValueError with a one-line message."""
    args, overrides = _parser().parse_known_args(argv)
    cfg = _config_from_args(args, overrides)
    search_only = [flag for flag, value in (("--gpus", args.gpus), ("--gpu-memory", args.gpu_memory),
                   ("--global-batch-size", args.global_batch_size), ("--top", args.top))
                   if value is not None]
    if search_only and not args.search:
        raise ValueError(f"{', '.join(search_only)} only apply with --search")
    if args.search:
        budget = args.gpu_memory or "80GiB"
        gpus = args.gpus or cfg.world_size
        gbs = args.global_batch_size or cfg.micro_batch_size * cfg.data_parallel_size \
            * cfg.num_microbatches
        t0 = time.perf_counter()
        found = search_layouts(cfg, gpus, parse_bytes(budget), gbs, top=args.top or 10)
        print(f"{len(found)} fastest layouts of {gpus} GPUs that fit {budget} "
              f"(global batch {gbs}); searched in {time.perf_counter() - t0:.2f} s")
        for i, f in enumerate(found, 1):
            print(f"{i:>3}. {f['layout']:<55} peak {f['peak_bytes'] / 2**30:6.1f} GiB   "
                  f"step ~{f['time']['total']:.2f} s")
        return
    if not 0 <= args.dp_rank < cfg.data_parallel_size * cfg.context_parallel_size:
        raise ValueError(f"--dp-rank must be in [0, "
                         f"{cfg.data_parallel_size * cfg.context_parallel_size})")
    print(json.dumps(_ledger_json(cfg, args.dp_rank)) if args.json
          else format_ledgers(cfg, args.dp_rank))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        ledgers = {f"stage {led.pp_rank}": led for led in stage_ledgers(cfg, args.dp_rank)}
        ax = plot_ledgers(ledgers)
        ax.set_title(layout_name(cfg), fontsize=8)
        ax.figure.tight_layout()
        ax.figure.savefig(args.plot, dpi=120)


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
# | layout | peak | step | compute | TP | CP | DP |
# |---|---|---|---|---|---|---|
# | TP2(SP)·PP1·CP1·DP128 mbs2 m4 no-recompute DistOpt | 56.1 GiB | 1.75 s | 1.60 | 0.08 | | 0.07 |
# | TP2(SP)·PP1·CP2·DP64 mbs4 m4 no-recompute DistOpt | 55.9 GiB | 1.76 s | 1.60 | 0.08 | 0.01 | 0.07 |
# | TP2(SP)·PP1·CP1·DP128 mbs2 m4 selective DistOpt | 56.1 GiB | 1.78 s | 1.63 | 0.08 | | 0.06 |
# | TP2(SP)·PP1·CP4·DP32 mbs8 m4 no-recompute DistOpt | 56.6 GiB | 1.78 s | 1.60 | 0.08 | 0.03 | 0.07 |
# | TP2(SP)·PP1·CP2·DP64 mbs4 m4 selective DistOpt | 56.1 GiB | 1.79 s | 1.63 | 0.08 | 0.01 | 0.06 |
# | TP2(SP)·PP1·CP4·DP32 mbs8 m4 selective DistOpt | 56.1 GiB | 1.80 s | 1.63 | 0.08 | 0.03 | 0.06 |
# | TP4(SP)·PP1·CP1·DP64 mbs4 m4 no-recompute DistOpt | 49.7 GiB | 1.85 s | 1.60 | 0.23 | | 0.02 |
# | TP4(SP)·PP1·CP2·DP32 mbs8 m4 no-recompute DistOpt | 49.4 GiB | 1.86 s | 1.60 | 0.23 | 0.01 | 0.02 |
#
# Against the running example's 2.14 s, the best of them saves the 0.19 s bubble and the
# recompute. Every one uses the distributed optimizer: without it each rank holds all
# 18 bytes per parameter (07.2). The winner without it would need 62.9 GiB of resident
# state (3.75e9 parameters per TP-2 rank without a pipeline) plus a 34.8 GiB activation
# peak (all 32 layers of one micro-batch): 97.7 GiB, not 80.
#
# The same eight layouts drawn: each one's peak against the budget, with its estimated step
# time. All eight fit with most of the 80 GiB to spare. With the DP traffic hidden by
# Megatron's overlap rules, the layouts without a pipeline win (no bubble, and no
# single-bucket all-gather on a later stage), TP2 before TP4 (half the TP traffic on the
# compute stream), and the eight lie within about 7% of each other: the search chooses
# among near-equals, and the estimate's own error (07.8 measures it on a CPU) is of the
# same order as the gaps. That is why production tools confirm the top few candidates with
# short profiling runs instead of trusting the model's ranking.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    rows = found[::-1]  # fastest at the top
    peaks = [f["peak_bytes"] / 2**30 for f in rows]
    ax.barh(range(len(rows)), peaks, color="tab:blue")
    ax.axvline(80, color="tab:red", ls="--", label="80 GiB budget")
    for i, (f, peak) in enumerate(zip(rows, peaks)):
        ax.text(peak + 1, i, f"~{f['time']['total']:.2f} s/step", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [f["layout"] for f in rows], fontsize=6)
    ax.set_xlim(0, 100)
    ax.set_xlabel("peak GiB per GPU (the larger of the first and last stage)")
    ax.set_title("The 7B example on 256 GPUs: the fastest layouts that fit", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    plt.show()
    times = [f["time"]["total"] for f in found]
    assert all(peak <= 80 for peak in peaks) and max(times) / min(times) < 1.10
    assert all(f["config"].pipeline_model_parallel_size == 1 for f in found[:3])

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
# 2. Set `Hardware.network_bandwidth` to 25 GB/s. Does the best layout change, and why?
#    (07.8's rules: which window does the reduce-scatter no longer fit?)

# %% [markdown]
# # 07.7 · Memory: `tinytron-memory`, the calculator and the layout search
#
# The ledger as a command. `tinytron-memory --config run.toml --world-size 256` reads the
# trainer's config and prints the first and the last stage's ledger next to Megatron's
# estimate; `tinytron-memory --example --search --gpu-memory 80GiB --gpus 256` lists the
# layouts that fit a device, ranked by an estimated step time.
#
# You will build: `parse_bytes`, `resolve_device`, `memory_config_from`, `running_example`,
# `Hardware`, `step_time`, `candidate_layouts`, `search_layouts`, `peak_parts`,
# `megatron_gap`, `format_gap`, `assumption_lines`, `format_ledgers` and `main`. The step
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
# | activations at the peak | 22,537.6 MiB | 18,278.6 MiB |
# | **total on the device** | **34,384.4 MiB** | **30,125.4 MiB** |
# | where the peak is | backward of micro-batch 0, 2 in flight | forward of micro-batch 0, 1 in flight |
#
# Megatron's estimate for the same layout is 11,846.75 MiB of weights and optimizer state and
# 16,416.06 MiB of activations, 28,262.81 MiB for every stage: 6,121.57 MiB less than the
# ledger on stage 0 and 1,862.57 MiB less on stage 1. The command prints that difference
# taken apart (the section "Where the ledger and Megatron's estimate part ways" below). The
# resident parts agree to 12,672 B (07.2 explains the difference: where the final norm is
# counted). The activations do not: Megatron charges 512 MiB per layer and micro-batch, this
# ledger 696 MiB (07.3, term by term: the norms and the SP linears keep what Megatron's keep;
# GQA and no dropout masks take 40 MiB off, the SwiGLU chain adds 224 MiB), for the same 32
# layer-micro-batches on stage 0 — 16 layers, 2 micro-batches in flight. Both fit an 80 GiB device; only the ledger says by how
# much. Before any number the command also says what it assumed — the world size and where
# it came from, the device, the dtypes, the micro-batches per step and in flight — because a
# ledger computed for the wrong world size or device looks just as precise as a right one.

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

from tinytron.memory.activations import attention_kernel_why, chunk_saved, saved_bytes
from tinytron.memory.peak import activation_peak
from tinytron.memory.ledger import (DEVICE_TERMS, RankLedger, megatron_args_from, plot_ledgers,
                                    rank_ledger, stage_ledgers)
from tinytron.memory.megatron_model import (_embedding_terms, _pipeline_factor, megatron_args,
                                            megatron_theoretical_memory)
from tinytron.memory.states import MemoryConfig, buffer_layouts, state_ledger
from tinytron.memory.step_time import estimate_step
from tinytron.model.config import stage_layer_ranges

__all__ = ["parse_bytes", "resolve_device", "memory_config_from", "running_example", "Hardware",
           "step_time", "candidate_layouts", "search_layouts", "peak_parts", "megatron_gap",
           "format_gap", "assumption_lines", "format_ledgers", "layout_name", "main"]

# %% [markdown]
# ## From the trainer's config to a `MemoryConfig`
#
# The command reads the same TOML file as the trainer (`tinytron.config.load_config`: sections
# `[model]`, `[parallel]`, `[training]`, `[optimizer]`, `[ddp]`, dotted `--section.key value`
# overrides) and the world size, which the file does not hold. It checks what the trainer
# checks before any process group exists — the layout against the model, the global batch
# against micro-batch × DP — and every error names the field:
# `tinytron-memory: error: training.global_batch_size (1000) must be divisible by ...`, exit
# status 2, no traceback. With bf16 the grad buffer is fp32 (Megatron forces it). The device
# `auto` is resolved as the trainer resolves it (`tinytron.train`: a CUDA device when one is
# visible, else the CPU), so the ledger is for the run the config would start on this
# machine; `--device` asks for another. `resolve_device` also returns the reason, which the
# command prints.
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


# %% [markdown]
# The device comes first, with its reason: `--device` wins, then an explicit
# `training.device`, then `"auto"` as the trainer resolves it.

# %%
def resolve_device(configured: str, flag: str | None = None) -> tuple[str, str]:
    """The device the ledger is for, and why: --device, the config's, or "auto" resolved as the
    trainer resolves it (a CUDA device if one is visible, else the CPU)."""
    if flag:
        return flag, "--device"
    if configured != "auto":
        return configured, "training.device in the config"
    import torch

    if torch.cuda.is_available():
        return "cuda", 'training.device is "auto" and a CUDA device is visible here'
    return "cpu", ('training.device is "auto" and no GPU is visible here, so the trainer '
                   "would run on the CPU; --device picks another")


# %% [markdown]
# Then the translation itself: the layout sizes, the micro-batches per step from the global
# batch, and the precision and optimizer switches under the ledger's names. The running
# example is the same translation written out once.

# %%
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
    device = device or resolve_device(t.device)[0]
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
# model of pages 07.8 to 07.10 (`tinytron.memory.step_time.estimate_step`). Compute is
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
# assumptions as 07.10 quotes, except `tp_comm_overlap`, which the search turns on and the
# example's config file leaves off (07.10: 1.94 s with TP's traffic on the compute stream). These are
# estimates from stated constants, not measurements; 07.11 holds the same model against
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
        """The same constants as the step-time model's Links (07.8)."""
        from tinytron.kernels.roofline import LAWS
        from tinytron.memory.step_time import Links

        if self.device not in LAWS:
            raise ValueError(f"device must be one of {sorted(LAWS)}, got {self.device!r}")
        law = LAWS[self.device]
        return Links(peak_flops=law.gpu.bf16_flops, law=law, nvlink=self.nvlink_bandwidth,
                     network=self.network_bandwidth, memory=law.gpu.hbm_bytes_per_s,
                     gpus_per_node=self.gpus_per_node)


# %% [markdown]
# `step_time` runs 07.10's model with the search's switches and sums its items into the parts
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
# ## Where the ledger and Megatron's estimate part ways, term by term
#
# On the running example the ledger says 34,384.4 MiB on stage 0 and 30,125.4 MiB on stage
# 1; Megatron's `report_theoretical_memory` (`megatron/training/theoretical_memory_usage.py:428`
# at e03878b5f) says 11,846.75 + 16,416.06 = 28,262.81 MiB for every stage. A number without
# its reason is no use to someone sizing a job, so the command prints the difference taken
# apart into named terms that add up to it. Each term is one place where Megatron's formula
# leaves something out or counts it another way:
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
# The README's CPU job shows the other kind of term. `tinytron-memory --config
# configs/tiny.toml` (no `--world-size`: one rank, and it says so; `device = "auto"` on a
# machine without a GPU: cpu, and it says why) finds nearly twice the 33.10 MiB of
# Megatron's formula. The model trains in fp32, which the formula does not model: weights and
# grads cost $4 + 4$ bytes per parameter against its $2 + 4$ (+1.53 MiB for 0.80 M
# parameters), and the optimizer $8$ against $12$, because fp32 parameters are their own
# masters (−3.07 MiB). The run has no SP, so the formula takes its second branch
# ($s b h (10 + 24/t) \cdot 1.05$, 2-byte activations) while every saved tensor here is 4
# bytes wide: each layer group roughly doubles, the MLP most (+14.55 MiB). With $p = 1$ the
# formula does count the head, at $2 \cdot 1.05$ bytes per logit against the fp32 softmax's
# 4 (+0.95 MiB), and the transient at its peak (+2.00 MiB) is the forward's cross-entropy
# again, here one `log_softmax` pass, since A.3 takes it on one rank. In all: 60.89 MiB,
# +27.78 MiB.
# `tests/test_memory_cli.py` holds every config in `configs/` to the same rule: the printed
# terms add up to the printed difference.


# %% [markdown]
# ## What the command assumed
#
# A ledger is only as right as its inputs, and three of them are easy to get wrong without
# noticing: the world size (the TOML file does not hold it, and without `--world-size` the
# command takes $t \cdot p \cdot c$ ranks, DP 1), the device (with the dtype and the head
# layout it decides the attention kernel, and it sets the width of the dropout masks, 07.3;
# the kernel's line says why: torch's own choice where that device is present, else 07.3's
# table of torch's dispatch rules) and the batch (a missing global batch means one
# micro-batch per DP rank). So the command prints, before any number, each of them and where
# it came from: a flag, the config, or a default. `training.device = "auto"` is resolved as
# the trainer resolves it, a CUDA device when one is visible and the CPU otherwise, and the
# line says which happened, so a ledger computed on a laptop for a CPU run says cpu.
# Then the dtypes, and the micro-batches in flight at each stage's peak next to the count
# Megatron's formula assumes for every stage. `--search` prints the device line and the GPU
# count it searched: its candidates inherit the device, the dtypes and the model from the
# config or the example, and only the layout, the micro-batch and the recompute change. None
# of these lines names a device the run would not use: a CPU config's output says cpu only.

# %%
def _op(at: tuple, chunks: int) -> str:
    kind, chunk, mb = at
    name = {"F": "forward", "B": "backward"}[kind]
    return f"{name} of {'chunk %d, ' % chunk if chunks > 1 else ''}micro-batch {mb}"


_DEFAULT_WHY = {"world": "the MemoryConfig's", "device": "the MemoryConfig's",
                "batch": "the MemoryConfig's"}


def assumption_lines(cfg: MemoryConfig, why: dict) -> list[str]:
    """What the ledger assumed (world size, device, dtypes, batch, in flight) and why."""
    t, p, c = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
               cfg.context_parallel_size)
    opt = f"{cfg.optimizer} moments"
    precision = (f"bf16 params and activations, an fp{8 * cfg.grad_bytes} grad buffer, fp32 "
                 f"masters and {opt}" if cfg.bf16 else f"fp32 params, grads, activations and "
                 f"{opt} (the fp32 params are their own masters)")
    unit = "chunk-micro-batches" if cfg.num_chunks > 1 else "micro-batches"
    stages = [(r, peak_parts(cfg, r)) for r in sorted({0, p - 1})]
    held = ", ".join(f"{len(pp['in_flight'])} on stage {r} ({_op(pp['at'], cfg.num_chunks)})"
                     for r, pp in stages)
    meg = _megatron_pieces(cfg)["layers"] / cfg.model.num_layers * p
    return [f"assumed: world size {cfg.world_size} ({why['world']}), so DP {cfg.data_parallel_size}"
            f" = {cfg.world_size} / (TP {t} · PP {p} · CP {c})",
            f"assumed: device {cfg.device} ({why['device']}); attention kernel "
            "%s (%s)" % attention_kernel_why(cfg),
            f"assumed: {precision}" + (f"; the distributed optimizer over DP · CP = "
                                       f"{cfg.data_parallel_size * c}"
                                       if cfg.use_distributed_optimizer else ""),
            f"assumed: {cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} per step "
            f"and DP rank ({why['batch']})",
            f"assumed: {unit} in flight at the peak: {held}; Megatron's formula takes {meg:g} "
            f"micro-batch{'es' if meg != 1 else ''} of a whole stage"
            + (" for every stage" if p > 1 else "")]


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
# The step time in the JSON is 07.10's model under the search's switches, item by item, so
# the ledger and the time of a layout travel together.

# %%
def step_time_json(cfg: MemoryConfig, hw: Hardware = Hardware()) -> dict:
    """07.10's step time of a layout under the search's switches: seconds and exposed items."""
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
# It also carries `step_time`: 07.10's model of the layout under the search's switches, in
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
# (07.11 holds it against Megatron's published runs, within about 10%) is larger than the
# gaps. That is why production tools confirm the top few candidates with
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
#    (07.9's rules: which window does the reduce-scatter no longer fit?)
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

# %% [markdown]
# # 07.8 · Memory: from the trainer's config — what the ledger assumed
#
# [07.7](megatron_gap.py) took the running example's ledger apart against Megatron's
# estimate. A user does not start from a `MemoryConfig`, though, but from the TOML file the
# trainer reads, and that file does not hold everything a ledger needs. This page reads the
# trainer's own config into a `MemoryConfig`, checks it as the trainer would, and states,
# before any number, what it assumed; [07.9](calculator.py) makes it the console script
# `tinytron-memory` and searches the layouts that fit a device.
#
# You will build: `parse_bytes`, `resolve_device`, `memory_config_from` and
# `assumption_lines`.
#
# ```mermaid
# flowchart LR
#   T["run.toml<br/>--section.key overrides"] --> C["TrainConfig<br/>load_config"]
#   W["--world-size"] --> M["memory_config_from<br/>checks layout and batch"]
#   D["--device, or auto"] --> M
#   C --> M
#   M --> L["MemoryConfig"]
#   L --> A["assumption lines"]
#   L --> G["the ledger (07.5)<br/>and its gap (07.7)"]
# ```
#
# Each input changes the answer. The README's CPU job, worked in small numbers: 4 layers of
# width 128, micro-batch 8, global batch 32, and no world size in the file. One rank
# means DP 1 and $32 / (8 \cdot 1) = 4$ micro-batches per step; at `--world-size 2` the
# same file gives DP 2 and 2 micro-batches, at 4 ranks one, and at 3 ranks it is refused,
# since $32$ is not a multiple of $8 \cdot 3$. Its ledger is 56.39 MiB on a CPU, where
# the attention kernel is flash; the same file ledgered for a GPU runs fp32 attention with
# grouped queries through the math kernel, and the ledger says 63.32 MiB.

# %%
from __future__ import annotations

import re

from tinytron.memory.activations import attention_kernel_why
from tinytron.memory.megatron_gap import (_megatron_pieces, format_gap, megatron_gap,
                                          peak_parts, running_example)
from tinytron.memory.states import MemoryConfig

__all__ = ["parse_bytes", "resolve_device", "memory_config_from", "assumption_lines"]

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
# batch, and the precision and optimizer switches under the ledger's names.

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

# %% [markdown]
# The running example's own file, `configs/llama7b_tp2_pp2_dp64.toml`, read for 256 ranks on
# CUDA, gives 07.7's `running_example` but for two fields the file sets and the example
# leaves at their defaults: `overlap_grad_reduce` (the step-time pages, 07.13, turn it on as
# the file does) and the model's `kernels = "auto"` (appendix C's kernels where they serve).
# Neither changes a byte of the ledger; `tests/test_train_configs.py` checks that the
# command prints the running example's numbers for this file. A world size that does not
# divide by TP · PP · CP is refused with a message that says why, as the trainer refuses it.

# %%
if __name__ == "__main__":
    from tinytron.config import ConfigError, load_config
    from tinytron.main_loop.assembled import repo_file  # the repository's configs/, from 01.10

    example_file = load_config(repo_file("configs/llama7b_tp2_pp2_dp64.toml"), [])
    read = memory_config_from(example_file, 256, "cuda")
    print(f"read: TP {read.tensor_model_parallel_size} PP {read.pipeline_model_parallel_size} "
          f"DP {read.data_parallel_size}, {read.num_microbatches} micro-batches of "
          f"{read.micro_batch_size}, bf16 {read.bf16}, fp32 grads {read.grad_reduce_in_fp32}")
    ex = running_example()
    assert read == ex.replace(overlap_grad_reduce=True, model=ex.model.replace(kernels="auto"))
    try:
        memory_config_from(example_file, 250, "cuda")
    except ConfigError as e:
        print("250 ranks:", e)
    else:
        raise AssertionError("250 ranks is not a multiple of TP · PP · CP = 4")
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80GB") == 80 * 10**9

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
# ## Demo: the README's CPU job, as the command reads it
#
# `tinytron-memory --config configs/tiny.toml` gives no world size, so the command takes
# $t \cdot p \cdot c = 1$ rank and says so; `device = "auto"` resolves as the trainer would
# on this machine. The cell builds the same `why` the command builds, prints the assumption
# lines and then 07.7's gap for this config.

# %%
if __name__ == "__main__":
    import torch

    tiny = load_config(repo_file("configs/tiny.toml"), [])
    device, device_why = resolve_device(tiny.training.device)
    cfg = memory_config_from(tiny, 1, device)
    why = {"world": "not given: --world-size defaults to TP · PP · CP = 1",
           "device": device_why, "batch": "global batch 32 / (micro-batch 8 · DP 1)"}
    print("\n".join(assumption_lines(cfg, why) + format_gap(cfg)))
    gap = megatron_gap(cfg, 0)
    assert device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cfg.data_parallel_size == 1 and cfg.num_microbatches == 4 and not cfg.bf16
    assert abs(sum(gap["terms"].values()) - gap["difference"]) < 1
    if device == "cpu":  # the numbers of the box below
        assert round(gap["ledger"]["total"] / 2**20, 2) == 56.39
        assert round(gap["difference"] / 2**20, 2) == 23.28

# %% [markdown]
# The other kind of term: a config the formula was not written for.
#
# <details><summary>Megatron detail: the README's CPU job, in fp32 and without SP</summary>
#
# The README's CPU job shows the other kind of term. `tinytron-memory --config
# configs/tiny.toml` (no `--world-size`: one rank, and it says so; `device = "auto"` on a
# machine without a GPU: cpu, and it says why) finds 1.7 times the 33.10 MiB of
# Megatron's formula. The model trains in fp32, which the formula does not model: weights and
# grads cost $4 + 4$ bytes per parameter against its $2 + 4$ (+1.53 MiB for 0.80 M
# parameters), and the optimizer $8$ against $12$, because fp32 parameters are their own
# masters (−3.07 MiB). The run has no SP, so the formula takes its second branch
# ($s b h (10 + 24/t) \cdot 1.05$, 2-byte activations) while every saved tensor here is 4
# bytes wide: each layer group roughly doubles, the MLP most (+14.55 MiB). With $p = 1$ the
# formula does count the head, at $2 \cdot 1.05$ bytes per logit against the fp32 softmax's
# 4 (+0.95 MiB), and the transient at its peak (+2.00 MiB) is the forward's cross-entropy
# again, here one `log_softmax` pass, since A.3 takes it on one rank. In all: 56.39 MiB,
# +23.28 MiB.
# `tests/test_memory_cli.py` holds every config in `configs/` to the same rule: the printed
# terms add up to the printed difference.
#
# </details>


# %% [markdown]
# ## Summary
#
# - `memory_config_from` reads the trainer's own TOML and a world size, checks what the
#   trainer checks (the layout against the model, the global batch against micro-batch ×
#   DP) and resolves the device as the trainer would; every error names the field.
# - Before any number the ledger states what it assumed — world size, device and kernel,
#   dtypes, batch, micro-batches in flight — and where each came from: a flag, the config,
#   or a default.
# - The same file can give different ledgers on different machines (the README's job: 56.39
#   MiB ledgered for a CPU, 63.32 MiB for a GPU); the assumption lines are how a reader
#   tells which one they are looking at.
#
# ## How production does it
#
# Megatron's estimate (`megatron/training/theoretical_memory_usage.py:428`) is computed
# from the arguments of a run already launched, on the devices it runs on, and states no
# assumptions. torchtitan reads a TOML job config as tinytron does and reports the memory
# it measures while it trains. [07.9](calculator.py) puts this page behind `tinytron-memory`.
#
# ## Exercises
#
# 1. A device is sold as "80 GB". Which of `--gpu-memory 80GB` and `80GiB` is its budget,
#    and how many GiB does the other one give?
#
#    <details><summary>Answer</summary>
#
#    `80GiB`: a device reports its capacity in binary units, 85,899,345,920 bytes.
#    `parse_bytes("80GB")` is 80,000,000,000 bytes, 74.5 GiB — 5.5 GiB of real memory the
#    search would refuse to use.
#
#    </details>
#
# 2. Read `configs/tiny.toml` for 2, 3 and 4 ranks. What DP and micro-batches per step
#    does each give, and what does the refusal say?
#
#    <details><summary>Answer</summary>
#
#    2 ranks: DP 2, 2 micro-batches of 8 per step; 4 ranks: DP 4, one. At 3 ranks
#    `memory_config_from` raises `ConfigError: training.global_batch_size (32) must be
#    divisible by micro_batch_size·dp = 8·3`, which the command prints as
#    `tinytron-memory: error: ...` with exit status 2.
#
#    </details>
#
# 3. Ledger the same tiny config for a GPU (`--device cuda`) on this CPU machine. Which
#    assumption line changes, and what does it cost?
#
#    <details><summary>Answer</summary>
#
#    The kernel line: the run is fp32 with grouped queries (2 groups for 4 heads), so on
#    CUDA torch's rules pick the math kernel (flash takes only fp16/bf16, mem-efficient
#    refuses grouped queries), and the line says so from the table of dispatch rules, no GPU
#    being here to ask. The math kernel keeps the fp32 scores: the attention line of the gap
#    grows from +4.86 to +11.80 MiB and the ledger from 56.39 to 63.32 MiB.
#
#    </details>

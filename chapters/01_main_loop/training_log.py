# %% [markdown]
# # 01 · The log line: losses, throughput, and a FLOP count you can trust
#
# Every `log_interval` iterations Megatron prints one line: the loss averaged over the
# iterations that advanced, the learning rate, the gradient norm, the loss scale, how many
# iterations were skipped or hit NaN, milliseconds per iteration and TFLOP/s per GPU. The last
# number is only as good as the FLOP count behind it. This page builds `training_log`, derives
# the FLOPs of one iteration of the book's model matmul by matmul (SwiGLU, GQA, tied or untied
# output, causal attention, recomputation), checks the formula against a FLOP counter on a real
# forward and backward, compares it term by term with Megatron's `num_floating_point_operations`,
# and turns it into MFU with a per-device peak.

# %%
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

__all__ = ["LogState", "training_log", "format_log_line", "flops_terms",
           "num_floating_point_operations", "megatron_flops_terms",
           "megatron_num_floating_point_operations", "GPU_PEAK_BF16_TFLOPS", "gpu_peak_flops",
           "measured_matmul_peak", "peak_flops_per_device"]

# %% [markdown]
# ## What the log line averages, and over what
#
# `training_log` (`megatron/training/training.py:2361`) is called after *every* iteration and
# prints only every `log_interval`. In between it accumulates:
#
# - each loss key, **only for iterations that advanced** (a skipped fp16 step has a meaningless
#   loss); the printed value is the sum divided by the number of advanced iterations;
# - counts of advanced, skipped and **NaN** iterations (a skipped iteration whose loss is
#   $\pm\infty$ or NaN);
# - the time since the last print, divided by the iterations since then: ms/iter. An
#   evaluation or a checkpoint save in the interval is **left out** of that time (`paused`):
#   Megatron stops its `interval-time` timer around both (`training.py:3683` and `:3739` around
#   evaluation, `:2792` and `:2857` around a save). Otherwise the line after an evaluation of
#   a minute reports a minute per iteration, and the ETA and tokens/s with it.
#
# Throughput follows: tokens/s $= \sum \text{tokens} / t$, TFLOP/s per device
# $= \sum \text{FLOPs} / (t \cdot 10^{12} \cdot \text{world size})$ (Megatron divides one
# batch's FLOPs by the time per iteration, the same number while the batch is constant), and
# MFU = achieved FLOP/s per device / the device's peak. At the first iteration the line is
# printed without resetting the accumulators (it shows start-up cost; `:2387`), unless that
# first iteration is itself on an interval boundary; there we reset.
#
# <details><summary>Megatron detail: the first line on a boundary</summary>
#
# With
# `log_interval = 1`, or after a resume at a multiple of it, Megatron's rule would count that
# iteration again in the next line (a resumed run's second line would then differ from the
# uninterrupted run's), so there we reset and Megatron does not.
#
# </details>
#
# The accumulated losses stay tensors until the line is printed, so the loop never waits for
# the device in between.
#
# ```mermaid
# flowchart LR
#   I["after every iteration:<br/>training_log(...)"] --> A{"advanced?"}
#   A -->|yes| L["add each loss key,<br/>advanced += 1"]
#   A -->|no| K["skipped += 1<br/>(nan += 1 if inf/NaN)"]
#   L --> T{"on a log_interval<br/>boundary?"}
#   K --> T
#   T -->|no| I
#   T -->|yes| P["print the line: mean losses, lr,<br/>grad norm, ms/iter, TFLOP/s, MFU;<br/>reset the accumulators"]
# ```

# %%
@dataclass
class LogState:
    """Megatron's total_loss_dict and interval timer: what accumulates between two log lines."""

    losses: dict = field(default_factory=dict)
    advanced_iterations: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0
    iterations: int = 0
    flops: int = 0
    tokens: int = 0
    last_time: float = field(default_factory=time.perf_counter)
    first: bool = True

    def reset(self, now: float) -> None:
        """Start a new interval."""
        self.losses, self.iterations, self.flops, self.tokens = {}, 0, 0, 0
        self.advanced_iterations = self.skipped_iterations = self.nan_iterations = 0
        self.last_time = now

    def paused(self, fn):
        """`fn`, with the time it takes left out of the interval (an evaluation, a save)."""
        def timed_out_of_interval(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.last_time += time.perf_counter() - t0
        return timed_out_of_interval


# %% [markdown]
# Accumulating is the first box of the diagram: an advanced iteration adds its losses, still as
# tensors; a skipped one only counts, and counts once more if its loss was not finite.

# %%
def _accumulate(loss_dict: dict, state: LogState, skipped_iter: int) -> None:
    """Add an advanced iteration's losses; count a skipped one, and whether its loss was NaN."""
    if not skipped_iter:
        state.advanced_iterations += 1
        for k, v in loss_dict.items():
            v = torch.as_tensor(v).detach().float().reshape(())
            state.losses[k] = state.losses.get(k, 0.0) + v
        return
    state.skipped_iterations += 1
    values = [float(torch.as_tensor(v).float().sum()) for v in loss_dict.values()]
    state.nan_iterations += int(any(math.isinf(x) or math.isnan(x) for x in values))

# %%
def training_log(loss_dict: dict, state: LogState, *, iteration: int, train_iters: int,
                 skipped_iter: int, learning_rate: float, loss_scale: float, grad_norm,
                 num_zeros_in_grad, consumed_train_samples: int, skipped_train_samples: int,
                 batch_size: int, seq_length: int, flops: int, world_size: int,
                 peak_flops: float | None, log_interval: int, now: float | None = None):
    """Accumulate one iteration; every log_interval (and at the first) return the log record."""
    _accumulate(loss_dict, state, skipped_iter)
    state.iterations += 1
    state.flops += flops
    state.tokens += batch_size * seq_length
    if not (iteration % log_interval == 0 or state.first):
        return None
    now = time.perf_counter() if now is None else now
    elapsed = max(now - state.last_time, 1e-12)
    flops_per_device = state.flops / elapsed / world_size
    record = dict(
        iteration=iteration, train_iters=train_iters,
        consumed_train_samples=consumed_train_samples,
        skipped_train_samples=skipped_train_samples,
        ms_per_iteration=1000.0 * elapsed / state.iterations,
        tflops_per_device=flops_per_device / 1e12,
        mfu=flops_per_device / peak_flops if peak_flops else None,
        tokens_per_second=state.tokens / elapsed,
        tokens_per_second_per_device=state.tokens / elapsed / world_size,
        learning_rate=learning_rate, global_batch_size=batch_size,
        losses={k: float(v) / max(1, state.advanced_iterations) for k, v in state.losses.items()},
        loss_scale=loss_scale, grad_norm=grad_norm, num_zeros_in_grad=num_zeros_in_grad,
        skipped_iterations=state.skipped_iterations, nan_iterations=state.nan_iterations)
    # Megatron does not reset on the first line (training.py:2387), so that the next interval
    # line still covers all its iterations. When the first line already falls on an interval
    # boundary (log_interval 1, or a resume at a multiple of it) that would count its
    # iteration twice, in this line and the next; we reset there, Megatron does not.
    if not state.first or iteration % log_interval == 0:
        state.reset(now)
    state.first = False
    return record


# %% [markdown]
# The record is a dict, for a JSONL file or a dashboard; `format_log_line` prints it the way
# Megatron's log line reads, field by field.

# %%
def format_log_line(r: dict) -> str:
    """One Megatron-style line from a training_log record."""
    parts = [f"iteration {r['iteration']:8d}/{r['train_iters']:8d}",
             f"consumed samples: {r['consumed_train_samples']:12d}"]
    if r["skipped_train_samples"]:
        parts.append(f"skipped samples: {r['skipped_train_samples']:12d}")
    parts += [f"elapsed time per iteration (ms): {r['ms_per_iteration']:.1f}",
              f"throughput per GPU (TFLOP/s/GPU): {r['tflops_per_device']:.3g}"]
    if r["mfu"] is not None:
        parts.append(f"MFU: {100 * r['mfu']:.1f}%")
    parts += [f"tokens/s: {r['tokens_per_second']:.0f}",
              f"learning rate: {r['learning_rate']:.6E}",
              f"global batch size: {r['global_batch_size']:5d}"]
    parts += [f"{k}: {v:.6E}" for k, v in r["losses"].items()]
    parts.append(f"loss scale: {r['loss_scale']:.1f}")
    if r["grad_norm"] is not None:
        parts.append(f"grad norm: {r['grad_norm']:.3f}")
    if r["num_zeros_in_grad"] is not None:
        parts.append(f"num zeros: {r['num_zeros_in_grad']}")
    parts += [f"number of skipped iterations: {r['skipped_iterations']:3d}",
              f"number of nan iterations: {r['nan_iterations']:3d}"]
    return " " + " | ".join(parts) + " |"

# %% [markdown]
# ## FLOPs of one iteration, matmul by matmul
#
# Only matrix multiplications are counted (norms, RoPE, softmax, SiLU and the loss are a few
# FLOPs per element, under 1% of the total at these widths). A matmul of an $[n, k]$ by a
# $[k, m]$ matrix costs $2nkm$ FLOPs (a multiply and an add per term). Notation: $h$ hidden,
# $L$ layers, $a$ query heads, $g$ key/value groups, $d = h/a$ the head size, $f$ the FFN width,
# $V$ the (padded) vocabulary, $s$ the sequence, $B$ sequences per iteration, $T = Bs$ tokens.
#
# | term (forward, whole batch) | matmul | FLOPs |
# |---|---|---|
# | `qkv` | $x [T, h] \cdot W_{qkv} [h, (a + 2g) d]$ — GQA: $g$ K and V heads, not $a$ | $2 T h (a+2g) d \cdot L$ |
# | `attention_output` | context $[T, a d] \cdot W_o [a d, h]$ | $2 T a d h \cdot L$ |
# | `attention_scores` | $q k^\top$ per head, over the (query, key) pairs that are computed | $2 P a d \cdot L$ |
# | `attention_values` | $\mathrm{softmax}(\cdot)\, v$ per head, same pairs | $2 P a d \cdot L$ |
# | `mlp` | SwiGLU: $W_{gate}, W_{up} [h, f]$ (stacked as $[h, 2f]$) and $W_{down} [f, h]$ | $6 T h f \cdot L$ |
# | `logits` | $x [T, h] \cdot W_{out}^\top [h, V]$ | $2 T h V$ |
#
# - **GQA** shrinks only the K and V projections; the attention matmuls still run for all $a$
#   query heads (each group's K and V are shared by $a/g$ heads, not skipped).
# - **Causal attention**: query $i$ attends to keys $0..i$, so the useful pairs are
#   $P = B \cdot s(s+1)/2$. A dense kernel that masks after computing (PyTorch's math SDPA)
#   computes $P = B s^2$; a FlashAttention kernel skips the masked blocks and does close to
#   the causal count.
# - **Tied or untied output**: the logits matmul is paid once either way; the *input*
#   embedding is a table lookup, 0 FLOPs. So "6 × parameters" over-counts an untied model by
#   $6 T V h$ (it counts the input table as if it were multiplied) and is right for a tied one —
#   the formula here counts the matmuls, not the parameters, and is right for both.
# - **Backward** is exactly twice the forward for every matmul: one product for the input's
#   gradient and one for the weight's (for attention, $dQ$ and $dK$ from the scores, $dP$ and
#   $dV$ from the values). The input embedding needs its gradient, so even the first layer's
#   input gradient is computed. Training $= 3\times$ forward.
# - **Recomputation** re-runs forward work inside backward: `full` recomputes every layer's
#   forward (everything but the logits), `selective` only the core attention (scores and
#   values; Megatron's `--recompute-granularity selective`, chapter 06). These are *hardware*
#   FLOPs: MFU (model FLOPs utilization) leaves them out by definition, HFU includes them.
#   (Megatron's checkpoint re-runs a whole region. PyTorch's non-reentrant
#   `torch.utils.checkpoint` stops as soon as every saved tensor is back, so it skips a
#   region's last matmul — a layer's down projection — whose output nothing saved; the tests
#   count both ways.)

# %%
def flops_terms(config, batch_size: int, *, seq_length: int | None = None,
                attention: str = "causal", recompute: str | None = None) -> dict[str, int]:
    """Training FLOPs (forward + backward) of one iteration, per matmul family, exact ints."""
    if attention not in ("causal", "dense"):
        raise ValueError(f"attention must be 'causal' or 'dense', got {attention!r}")
    if recompute not in (None, "full", "selective"):
        raise ValueError(f"recompute must be None, 'full' or 'selective', got {recompute!r}")
    s = seq_length or config.seq_length
    h, L, V, f = config.hidden_size, config.num_layers, config.vocab_size, config.ffn_hidden_size
    a, g, d = config.num_attention_heads, config.num_query_groups, config.head_dim
    T = batch_size * s
    pairs = batch_size * (s * (s + 1) // 2 if attention == "causal" else s * s)
    forward = {"qkv": 2 * T * h * (a + 2 * g) * d * L,
               "attention_output": 2 * T * a * d * h * L,
               "attention_scores": 2 * pairs * a * d * L,
               "attention_values": 2 * pairs * a * d * L,
               "mlp": 6 * T * h * f * L,
               "logits": 2 * T * h * V}
    terms = {k: 3 * v for k, v in forward.items()}
    core = forward["attention_scores"] + forward["attention_values"]
    layers = sum(v for k, v in forward.items() if k != "logits")
    terms["recompute"] = {None: 0, "selective": core, "full": layers}[recompute]
    return terms


def num_floating_point_operations(config, batch_size: int, **kwargs) -> int:
    """Training FLOPs of one iteration of batch_size sequences (sum of flops_terms)."""
    return sum(flops_terms(config, batch_size, **kwargs).values())

# %% [markdown]
# ## Megatron's formula, term by term
#
# `num_floating_point_operations` (`megatron/training/training.py:411`, the dense-transformer
# branch `transformer_flops`) multiplies every GEMM by $3$ (forward, weight gradient, data
# gradient) and $2$ (FMA), per token:
#
# - attention projections: $6\,[h(q + 2k) + q h]$ with $q = a d$, $k = g d$ — our `qkv` +
#   `attention_output`, identical;
# - core attention: $6 q \cdot \tfrac12 \cdot 2 \cdot s$ per token, i.e. $6 a d s^2$ per sequence —
#   the causal half taken as exactly $s^2/2$ pairs;
# - MLP: $6 h f \cdot 3$ with SwiGLU (`ffn_expansion_factor = 3`) — our `mlp`, identical;
# - logits: $6 h V$ on the padded vocabulary — our `logits`, identical.
#
# So the two differ in one place: causal attention has $s(s+1)/2$ pairs per head, not $s^2/2$;
# the $s/2$ diagonal pairs per sequence are missing from Megatron's count, a difference of
# $6 a d s L B$ FLOPs per iteration — relatively $1/s$ of the attention term. Neither counts
# recomputation (Megatron logs model FLOPs).
#
# <details><summary>Megatron detail: older versions</summary>
#
# Older Megatron versions ignored
# SwiGLU and GQA in this formula (NVIDIA/Megatron-LM#682); at `e03878b5f` both are
# in.
#
# </details>

# %%
def megatron_flops_terms(config, batch_size: int, *, seq_length: int | None = None) -> dict:
    """Megatron's transformer_flops (training.py:411) for a dense GQA SwiGLU model, by term."""
    s = seq_length or config.seq_length
    h, L, V, f = config.hidden_size, config.num_layers, config.vocab_size, config.ffn_hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_query_groups * config.head_dim
    tokens = batch_size * s
    return {"attention_projections": tokens * 6 * (h * (q + 2 * kv) + q * h) * L,
            "attention_core": batch_size * s * s * (6 * q // 2 * 2) * L,
            "mlp": tokens * 6 * h * f * 3 * L,
            "logits": tokens * 6 * h * V}


def megatron_num_floating_point_operations(config, batch_size: int, **kwargs) -> int:
    """Megatron's total for one iteration of batch_size sequences."""
    return sum(megatron_flops_terms(config, batch_size, **kwargs).values())

# %% [markdown]
# ## The running example
#
# Llama-7B-like ($h = 4096$, $L = 32$, $a = 32$, $g = 8$, $d = 128$, $f = 14336$,
# $V = 128256$, $s = 4096$), global batch 1024: $T = 1024 \cdot 4096 = 4\,194\,304$ tokens per
# iteration. Per token, the linear layers of the 32 layers cost
# $3 \cdot 32 \cdot 2 \cdot 4096 \cdot (6144 + 4096 + 3 \cdot 14336) = 41.9$ GFLOP, the logits
# $6 \cdot 4096 \cdot 128256 = 3.15$ GFLOP and causal attention
# $6 \cdot 4096 \cdot 4097 \cdot 32 = 3.22$ GFLOP: 48.25 GFLOP per token,
# $2.02 \cdot 10^{17}$ FLOPs per iteration, $7.9 \cdot 10^{14}$ per GPU on 256 GPUs. Chapter
# 07.13's step-time model, which times every kernel and transfer of the example's layout (TP2
# with SP · PP2 · DP64, micro-batch 2, selective recompute) on an H100, predicts 1.94 s per
# iteration: 41% MFU by this count. Full recomputation would make the hardware do 1.31× that;
# MFU still counts $2.02 \cdot 10^{17}$.
#
# The same formula at $s = 8192$ gives 51.5 GFLOP per token for Llama-3-8B (the demo asserts
# it), which is what NeMo's published 744 TFLOP/s/GPU at 14 451 tokens/s/GPU imply
# ($744 \cdot 10^{12} / 14\,451 = 51.5 \cdot 10^{9}$; Megatron-Bridge's performance summary
# for NeMo 25.11, Llama3-8B on 8 H100s in FP8 at sequence length 8192,
# `NVIDIA-NeMo/Megatron-Bridge:docs/performance-summary.md`); the popular
# $6N + 12 L h s$ gives 61 (it counts the untied input table and dense attention).
#
# ## Peak FLOP/s per device
#
# MFU needs a denominator. For GPUs it is the datasheet's **dense** bf16 tensor-core peak —
# not the 2:4-sparsity figure printed next to it (twice as large), and not TF32. A device
# missing from the table gets no MFU rather than a guessed one (a missing entry is how MFUs
# above 100% get published). For a CPU there is no datasheet number that a PyTorch matmul
# reaches, so `peak_flops_per_device` **measures** the best large matmul in the training dtype
# and calls that the peak. The demo below divides by it to show the arithmetic; the trainer
# (`tinytron.train`) does not: a one-shape matmul rate moves with the shape, the threads and
# the machine's load, and a run was seen to beat it (101%), so on a CPU the trainer logs
# TFLOP/s per device and tokens per second and no MFU.

# %%
GPU_PEAK_BF16_TFLOPS = (  # dense bf16 tensor-core peak from the vendors' datasheets
    ("GB200", 2500.0), ("B200", 2250.0), ("H200 NVL", 835.0), ("H200", 989.0),
    ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H800", 989.0), ("H100", 989.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("MI300X", 1307.0),
)


def gpu_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a device name (first table entry it contains), else None."""
    for key, tflops in GPU_PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


def measured_matmul_peak(device="cpu", dtype=torch.float32, n: int = 1024,
                         repeats: int = 5) -> float:
    """Best FLOP/s of an n x n matmul on this device (2 n^3 FLOPs per product)."""
    dev = torch.device(device)
    x, y = (torch.randn(n, n, device=dev).to(dtype) for _ in range(2))
    best = math.inf
    for _ in range(repeats + 1):  # the first run warms up the kernels
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        torch.mm(x, y)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def peak_flops_per_device(device="cpu", dtype=torch.float32) -> float | None:
    """GPU: the datasheet dense bf16 peak (None if unknown); CPU: the measured matmul peak."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(dev))
    return measured_matmul_peak(dev, dtype)

# %% [markdown]
# ## Demo: the formula against a FLOP counter, Megatron's formula, and a log line
#
# 1. The running example, term by term, ours next to Megatron's.
# 2. The tiny model's real forward and backward under `torch.utils.flop_counter.FlopCounterMode`
#    with PyTorch's math attention (it computes the dense $s^2$ scores, as matmuls the
#    counter sees): the counted FLOPs must equal `flops_terms(..., attention="dense")` exactly.
# 3. A few real iterations of the tiny model fed to `training_log`, with this CPU's measured
#    peak, printed as Megatron prints them.

# %%
if __name__ == "__main__":
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from tinytron.model import GPTModel, llama_7b_config, tiny_config

    big, gbs = llama_7b_config(), 1024
    ours, meg = flops_terms(big, gbs), megatron_flops_terms(big, gbs)
    grouped = {"attention_projections": ours["qkv"] + ours["attention_output"],
               "attention_core": ours["attention_scores"] + ours["attention_values"],
               "mlp": ours["mlp"], "logits": ours["logits"]}
    print(f"{'term':<22}{'ours':>14}{'Megatron':>14}{'ours - Megatron':>18}")
    for k in meg:
        print(f"{k:<22}{grouped[k]:>14.4e}{meg[k]:>14.4e}{grouped[k] - meg[k]:>18.4e}")
    total, total_meg = sum(ours.values()), sum(meg.values())
    print(f"{'total':<22}{total:>14.4e}{total_meg:>14.4e}   relative {total / total_meg - 1:.2e}")
    tokens = gbs * big.seq_length
    print(f"tokens/iteration {tokens:,}; {total / tokens / 1e9:.2f} GFLOP/token; per GPU (256): "
          f"{total / 256:.3e}; in 07.13's 1.94 s/iter: {total / 256 / 1.94 / 989e12:.1%} MFU")
    full = num_floating_point_operations(big, gbs, recompute="full")
    print(f"with full recompute the hardware does {full / total:.3f}x the model FLOPs")
    assert grouped["attention_core"] - meg["attention_core"] == 6 * 4096 * 4096 * 32 * gbs
    assert all(grouped[k] == meg[k] for k in ("attention_projections", "mlp", "logits"))
    llama3 = flops_terms(big, 1, seq_length=8192)
    assert abs(sum(llama3.values()) / 8192 / 1e9 - 51.5) < 0.1
    assert abs(744e12 / 14_451 / 1e9 - 51.5) < 0.05  # NeMo's published pair, same count

# %% [markdown]
# Step 2: the tiny model's forward and backward under PyTorch's FLOP counter, with the math
# attention kernel so that every score is a matmul the counter sees.

# %%
if __name__ == "__main__":
    cfg = tiny_config()
    model = GPTModel(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd_counter:
            loss = model(x, labels=x).mean()
        with FlopCounterMode(display=False) as bwd_counter:
            loss.backward()
    fwd, bwd = fwd_counter.get_total_flops(), bwd_counter.get_total_flops()
    formula = num_floating_point_operations(cfg, 2, attention="dense")
    print(f"tiny model, batch 2: counted forward {fwd:,} + backward {bwd:,} = {fwd + bwd:,}; "
          f"formula {formula:,}")
    assert fwd + bwd == formula and bwd == 2 * fwd

# %% [markdown]
# Step 3: four real iterations of batch 8 fed to `training_log` with `log_interval = 2`, so the
# first line (start-up cost) and two interval lines are printed.

# %%
if __name__ == "__main__":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peak = peak_flops_per_device("cpu")
    state, flops = LogState(), num_floating_point_operations(cfg, 8)
    for it in range(1, 5):
        x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_length))
        opt.zero_grad()
        loss = model(x, labels=x).mean()
        loss.backward()
        opt.step()
        rec = training_log({"lm loss": loss}, state, iteration=it, train_iters=4, skipped_iter=0,
                           learning_rate=1e-3, loss_scale=1.0, grad_norm=None,
                           num_zeros_in_grad=None, consumed_train_samples=8 * it,
                           skipped_train_samples=0, batch_size=8, seq_length=cfg.seq_length,
                           flops=flops, world_size=1, peak_flops=peak, log_interval=2)
        if rec is not None:
            print(format_log_line(rec))
    print(f"measured CPU matmul peak: {peak / 1e9:.1f} GFLOP/s (fp32)")
    # rate / peak, both wall-clock on a shared CPU: no upper bound (the trainer prints no CPU MFU)
    assert rec["mfu"] > 0 and math.isclose(rec["mfu"], rec["tflops_per_device"] * 1e12 / peak)

# %% [markdown]
# The counter and the formula agree to the FLOP, and the backward is exactly twice the forward
# (the counter's numbers before and after `backward()` show it). On the running example our
# count exceeds Megatron's by $6 \cdot 4096 \cdot 4096 \cdot 32 \cdot 1024 \approx 3.3 \cdot
# 10^{12}$ FLOPs, 0.0016% of the iteration: the diagonal of the causal mask. The tiny model's
# MFU on a CPU is low because its matmuls are small next to the per-operator overhead.

# %% [markdown]
# ## Measured on a GPU
#
# The MFU above is a CPU's, against a measured peak. What a GPU reaches is measured by
# `bash scripts/gpu_check.sh 1`: the trainer on `configs/gpt_1b.toml` (1.04B parameters,
# sequence 2048, 16 sequences per iteration) on one GPU for 30 iterations, eager
# (`kernels = torch`) and with `torch.compile`, its rates read from the last logged interval
# of the run's own JSONL, MFU against the datasheet peak the trainer assumes for that GPU.
# `chapters/_gpu_results.py` renders the table from `benchmarks/results/gpu/<device>.json`;
# until a GPU has run the check, it says so.

# %%
if __name__ == "__main__":
    from tinytron._gpu_results import gpu_table

    print(gpu_table("training_log"))

# %% [markdown]
# ## Summary
#
# - The log line averages losses over advanced iterations only and counts skipped and NaN
#   iterations separately; throughput is FLOPs and tokens over the wall time of the interval.
# - Training FLOPs $= 3 \times$ forward matmuls: $T[L(2h(a+2g)d + 2adh + 6hf) + 2hV] +
#   4 P a d L$ forward, with $P$ the causal $(q, k)$ pairs; recompute adds forward work.
# - Megatron's formula equals ours term by term except the causal diagonal ($s^2/2$ vs
#   $s(s+1)/2$ pairs).
# - MFU divides by the dense bf16 datasheet peak (GPU); a measured matmul peak (CPU) serves
#   the demo, and the trainer reports no MFU on a CPU.
#
# ## How production does it
#
# - Megatron: `megatron/training/training.py` — `num_floating_point_operations:411`
#   (`transformer_flops`, MoE/MLA/MTP/hybrid branches, packed sequences via `sum(L_i^2)`),
#   `training_log:2361`; `megatron/training/utils.py` `report_memory`.
# - torchtitan: `torchtitan/models/utils.py` `get_dense_model_nparams_and_flops` counts
#   $6(N - N_{\text{embedding}}) + 12 L h s$ per token — the input table left out, attention
#   counted dense (no causal halving, by convention) — and `torchtitan/tools/utils.py`
#   `get_peak_flops` looks the device name up in a table of dense bf16 peaks (and assumes an
#   A100 for a name it does not know, where `gpu_peak_flops` here returns no peak).
# - PaLM (Chowdhery et al. 2022, appendix B) defines MFU without recomputation; HFU includes it.
#
# ## Exercises
#
# 1. How much does `selective` recompute add to the running example's hardware FLOPs? And
#    `full`?
#
#    <details><summary>Answer</summary>
#
#    `flops_terms(llama_7b_config(), 1024, recompute=...)`:
#    selective re-runs the core attention's forward, $4.50 \cdot 10^{15}$ FLOPs, 2.2% on top of
#    the $2.02 \cdot 10^{17}$ model FLOPs; full re-runs every layer's forward,
#    $6.31 \cdot 10^{16}$, 31.2% (the 1.31× above). MFU counts neither.
#
#    </details>
#
# 2. Untie the embedding of the running example: what changes in `flops_terms`, and in the
#    parameter count?
#
#    <details><summary>Answer</summary>
#
#    Nothing in `flops_terms`: the input embedding is a
#    lookup (0 FLOPs) and the logits matmul is paid once either way. The parameters grow by
#    one $V \times h$ table, $128\,256 \cdot 4096$ = 525,336,576 (0.53 B), so
#    "6 × parameters" would now over-count by $6 T V h$.
#
#    </details>
#
# 3. At which sequence length does causal attention cost as much as the MLP in the running
#    example?
#
#    <details><summary>Answer</summary>
#
#    Per token and layer, the scores and values cost
#    $2 (s+1)\, a d$ forward (causal pairs $s(s+1)/2$ per sequence), the MLP $6 h f$. They are
#    equal at $s + 1 = 3 h f / (a d) = 3 \cdot 14336 = 43\,008$, i.e. $s$ = 43,007, where
#    `flops_terms` gives both exactly $1.4546 \cdot 10^{15}$ for one sequence.
#
#    </details>

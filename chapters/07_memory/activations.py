# %% [markdown]
# # 07.3 · Memory: the flowing part — what one micro-batch keeps, tensor by tensor
#
# Activations are what autograd keeps from the forward pass for the backward pass. They are
# created by every micro-batch and freed by its backward, so what counts first is how much
# *one* micro-batch leaves behind on a stage. This page lists, tensor by tensor, what a layer
# of appendix B's model saves — for GQA, SwiGLU, RMSNorm, RoPE, the attention kernel in use,
# dropout, SP, CP, recompute and activation offload — then the embedding and the head. The
# next page multiplies by the micro-batches in flight.
#
# You will build: `Saved`, `Dims`, `attention_kernel`, `layer_saved`, `embedding_saved`,
# `head_saved` and `chunk_saved`.

# %%
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tinytron.memory._sdpa import SdpaCall, lse_rows, sdpa_choice
from tinytron.memory.states import MemoryConfig
from tinytron.model.config import stage_layer_ranges

__all__ = ["Saved", "Dims", "attention_kernel", "attention_kernel_why", "layer_saved",
           "embedding_saved", "head_saved", "chunk_saved", "saved_bytes", "CPU_RNG_STATE", "dropout_mask_bytes"]

# %% [markdown]
# ## What one layer saves, tensor by tensor
#
# Notation for one rank: $s_c = s/c$ tokens of the sequence (context parallel), $s_r = s_c/t$
# with sequence parallelism (else $s_c$) for the residual stream, $b$ the micro-batch, $d$ the
# head size, $a_t = a/t$ query heads and $g_t = g/t$ key/value groups on this rank,
# $f_t = f/t$, $P$ bytes per parameter-dtype element (2 in bf16). Reading the model of
# [B.3](../model/transformer_layer.py) op by op (`torch.autograd.graph.saved_tensors_hooks` lists the same
# thing; the tests compare the two):
#
# | module | saved tensor | bytes |
# |---|---|---|
# | RMSNorm (×2) | its input in $P$, one fp32 $1/\mathrm{rms}$ per row | $P s_r b h + 4 s_r b$ |
# | `linear_qkv`, `linear_fc1` | their input, this rank's SP slice (gathered again in backward) | $P s_r b h$ each |
# | RoPE | only the cos/sin tables, which the model builds once per sequence length and keeps | 0 |
# | flash attention | q, k, the whole QKV output (v is a view of it), out, logsumexp | $P s_c b (a_t + g_t + (a_t + 2 g_t) + a_t) d + 4 b a_t s_c$ |
# | SwiGLU | fc1 output ($2 f_t$), silu(gate), the product (fc2's input) | $P s_c b \cdot 4 f_t$ |
# | dropout (×2, if $p > 0$) | the mask | $M s_r b h$ |
#
# The norms and the SP linears keep what Megatron's keep, as the table says
# ([B.2](../model/layers.py), [A.2](../parallel/tensor_parallel.py),
# `megatron/core/tensor_parallel/layers.py:486, 543-545`). What still differs from the paper
# count (Korthikanti et al., Table 2) and from Megatron's formula is visible in the table:
# **GQA** shrinks K and V ($g_t d$ instead of $h/t$); **SwiGLU** stores $4 f_t$ per token
# where the formula counts $2 f_t$ (a GELU MLP's input and output); and the two 1-byte
# residual dropout masks the formula always counts are kept here only when $p > 0$.
#
# **The kernel.** `scaled_dot_product_attention` picks a kernel per call, from the dtype, the
# head layout, the mask, dropout, the device and the torch version, and `attention_kernel`
# predicts that pick (`attention_kernel_why` also says why). Where the ledger's device is at
# hand it asks torch itself (`torch._fused_sdp_choice`, the dispatcher's own answer); a CUDA
# ledger computed without a GPU uses a table of torch's dispatch rules, kept with its sources
# in the private module `chapters/07_memory/_sdpa.py`:
#
# | device | dtype | mask (CP) | grouped queries ($g < a$) | kernel |
# |---|---|---|---|---|
# | CPU | any | any | any | flash; math with attention dropout |
# | CUDA | bf16, fp16 | none | any | flash (head size $\le 256$) |
# | CUDA | fp32 | any | none | mem-efficient |
# | CUDA | bf16, fp16 | yes | none | mem-efficient |
# | CUDA | fp32 | any | yes | **math** |
# | CUDA | bf16, fp16 | yes | yes | **math** |
#
# Mem-efficient refuses grouped queries (torch 2.5 to 2.13 at least) and flash refuses fp32
# and masks, so on a GPU grouped queries in fp32, or under CP, materialize the scores. The
# flash, mem-efficient and cuDNN kernels (the last preferred on sm_90 by some newer builds,
# and then named by torch on the GPU) save q, k, v, the output and one fp32 logsumexp per query and head —
# nothing of size $s^2$; mem-efficient pads the logsumexp rows to a multiple of 32. When the
# math path runs (the table says so, or `attention_kernel = "math"`), it casts bf16 and fp16
# inputs to fp32 **on every device** ("keep query, key, value in high precision",
# `aten/src/ATen/native/transformers/attention.cpp`, `_scaled_dot_product_attention_math`),
# repeats K and V to all $a_t$ heads (GQA is undone) and saves the scaled q, $K^T$, V, the
# probabilities, the dropout mask and the dropped probabilities:
# $b\,a_t\,(4 s_c d + 8 s d + (8 + M_4) s_c s)$ bytes with dropout, $M_4$ the mask's width
# below — the paper's $5 a s/h$ term, in fp32 and not in bf16.
#
# **CP.** A CP rank holds $s_c$ queries but gathers the keys and values of the whole sequence:
# the flash kernel then saves the gathered K and V ($P s b g_t d$ each) instead of the QKV
# output, and an additive mask $P s_c s$ (the causal rule in global positions).
#
# **Dropout masks — one rule, per device** (`dropout_mask_bytes`). On CUDA, `F.dropout` runs
# the fused `native_dropout`, which keeps a bool mask: $M = 1$ byte per element, for the
# residual and embedding dropouts and for the math kernel's attention dropout alike. On CPU
# `F.dropout` multiplies by a noise tensor in the input's dtype and autograd keeps it:
# $M = P$ on the residuals, $M_4 = 4$ inside the math kernel (its input is fp32 there).
# Chapter 06's running table
# counts Megatron's *unfused* softmax instead (bf16 probabilities and a 1-byte mask, the
# memory formula's assumption); this rule is what PyTorch's SDPA math kernel, which tinytron
# runs, keeps.

# %%
@dataclass(frozen=True)
class Saved:
    """One tensor autograd keeps: which module, what, how many elements of how many bytes."""

    module: str
    what: str
    elements: int
    itemsize: int
    view_elements: int | None = None
    """Elements of the saved view when it is smaller than its storage (v inside the QKV output)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's storage."""
        return self.elements * self.itemsize

    @property
    def saved_numel(self) -> int:
        """Elements of what autograd holds (what offload compares with its threshold and copies)."""
        return self.view_elements if self.view_elements is not None else self.elements

    def times(self, n: int) -> "Saved":
        """The same tensor kept by n layers (one entry, n times the elements)."""
        return Saved(self.module, f"{self.what} (x{n} layers)", self.elements * n, self.itemsize)


def saved_bytes(entries: list[Saved]) -> int:
    """Total bytes of a list of saved tensors."""
    return sum(e.nbytes for e in entries)

# %% [markdown]
# `Dims` computes the notation's per-rank sizes once from the layout, so each saved tensor
# below reads like its row of the table.

# %%
@dataclass(frozen=True)
class Dims:
    """The per-rank sizes every activation formula uses."""

    s_c: int
    s_r: int
    s: int
    b: int
    h: int
    d: int
    a_t: int
    g_t: int
    f_t: int
    v_t: int
    P: int

    @classmethod
    def of(cls, cfg: MemoryConfig) -> "Dims":
        """Sizes for this layout: local sequence (CP, SP), local heads and widths (TP)."""
        m, t, c = cfg.model, cfg.tensor_model_parallel_size, cfg.context_parallel_size
        s_c = m.seq_length // c
        return cls(s_c=s_c, s_r=s_c // t if m.sequence_parallel else s_c, s=m.seq_length,
                   b=cfg.micro_batch_size, h=m.hidden_size, d=m.head_dim,
                   a_t=m.num_attention_heads // t, g_t=m.num_query_groups // t,
                   f_t=m.ffn_hidden_size // t, v_t=m.vocab_size // t, P=cfg.param_bytes)


# %% [markdown]
# Which kernel runs: the one the config names, else torch's pick for this layer's call, with
# the reason.

# %%
def attention_kernel(cfg: MemoryConfig) -> str:
    """The SDPA kernel that runs: flash, efficient, cudnn or math (see `attention_kernel_why`)."""
    return attention_kernel_why(cfg)[0]


def attention_kernel_why(cfg: MemoryConfig) -> tuple[str, str]:
    """(kernel, why): the one set in the config, else what torch picks for this layer's call."""
    if cfg.attention_kernel != "auto":
        return cfg.attention_kernel, "set in the MemoryConfig"
    x = Dims.of(cfg)
    return sdpa_choice(SdpaCall(cfg.device, torch.bfloat16 if cfg.bf16 else torch.float32,
                                x.b, x.a_t, x.g_t, x.s_c, x.s, x.d, cfg.model.dropout,
                                masked=cfg.context_parallel_size > 1))


# %% [markdown]
# Two rules the rows below share: a dropout mask's width per device, and what a norm keeps.

# %%
def dropout_mask_bytes(cfg: MemoryConfig, input_bytes: int) -> int:
    """Bytes per element of the mask `F.dropout` keeps: a bool on CUDA, the input's dtype on CPU."""
    return 1 if cfg.device == "cuda" else input_bytes


def _norm(module: str, x: Dims) -> list[Saved]:
    """RMSNorm, as Megatron's fused norm: its input in the param dtype and one fp32 1/rms per row."""
    n = x.s_r * x.b
    return [Saved(module, "input", n * x.h, x.P), Saved(module, "1/rms", n, 4)]

# %% [markdown]
# Core attention by kernel, as in the table, and its selective-recompute form (the
# checkpoint's inputs and the output).

# %%
def _core_attention(cfg: MemoryConfig, x: Dims) -> list[Saved]:
    """What the attention kernel saves (and the proj input when it is a separate tensor)."""
    n, c, kernel = x.s_c * x.b, cfg.context_parallel_size, attention_kernel(cfg)
    if kernel != "math":  # flash, cudnn and mem-efficient keep the same tensors
        kv = ([Saved("core_attn", "k (after RoPE)", n * x.g_t * x.d, x.P),
               Saved("core_attn", "qkv output (v is a view)", n * (x.a_t + 2 * x.g_t) * x.d, x.P,
                     n * x.g_t * x.d)]
              if c == 1 else
              [Saved("core_attn", "k gathered over CP", x.s * x.b * x.g_t * x.d, x.P),
               Saved("core_attn", "v gathered over CP", x.s * x.b * x.g_t * x.d, x.P),
               Saved("core_attn", "additive causal mask", x.s_c * x.s, x.P)])
        return [Saved("core_attn", "q (after RoPE)", n * x.a_t * x.d, x.P), *kv,
                Saved("core_attn", "logsumexp", x.b * x.a_t * lse_rows(kernel, x.s_c), 4),
                Saved("core_attn", "output (= linear_proj input)", n * x.a_t * x.d, x.P)]
    e = 4  # the math path computes in fp32 on every device
    heads = x.b * x.a_t
    out = [Saved("core_attn", "q scaled", heads * x.s_c * x.d, e),
           Saved("core_attn", "K^T repeated to all heads", heads * x.s * x.d, e),
           Saved("core_attn", "V repeated to all heads", heads * x.s * x.d, e)]
    if cfg.model.dropout > 0:  # probabilities, their dropout mask, the dropped probabilities
        out += [Saved("core_attn", "scores: probs and dropped probs", 2 * heads * x.s_c * x.s, e),
                Saved("core_attn", "scores: dropout mask", heads * x.s_c * x.s,
                      dropout_mask_bytes(cfg, e))]
    else:
        out.append(Saved("core_attn", "scores: probs", heads * x.s_c * x.s, e))
    return out + [Saved("attn_proj", "linear_proj input", n * x.a_t * x.d, x.P)]


def _selective_core_attention(cfg: MemoryConfig, x: Dims) -> list[Saved]:
    """Core attention recomputed: only its inputs (q, k, v's QKV storage) and output stay."""
    n = x.s_c * x.b
    return [Saved("core_attn", "q (checkpoint input)", n * x.a_t * x.d, x.P),
            Saved("core_attn", "k (checkpoint input)", n * x.g_t * x.d, x.P),
            Saved("core_attn", "qkv output (v is a view)", n * (x.a_t + 2 * x.g_t) * x.d, x.P,
                  n * x.g_t * x.d),
            Saved("attn_proj", "linear_proj input", n * x.a_t * x.d, x.P)]


# %% [markdown]
# The layer, assembled. The first norm of a chunk that received its input from the previous
# stage saves the received tensor itself, counted once as the stage input. RoPE's tables (in
# $P$, one per sequence length) are resident, cached by the model
# ([page B.4](../model/gpt.py)), not per micro-batch.
#
# **Recompute** (chapter 06, the model config's `recompute_*` switches, Megatron's names):
#
# | switch | what a layer keeps instead |
# |---|---|
# | selective `core_attn` (`attention.py:426-468`) | the checkpoint's inputs q, k and v (the QKV output): the flash kernel's logsumexp goes, the math kernel's whole $s^2$ term goes |
# | selective `mlp` | the MLP's input only (fc1's output, silu and the product go) |
# | selective `layernorm` | the norm's input; its internals and (without SP) its output are freed by `CheckpointWithoutOutput` |
# | full, `uniform` $n$ | nothing per layer: each run of $n$ layers keeps its input (`recompute.py:139`) |
# | full, `block` $n$ | the first $n$ layers of the stage keep their input, the rest everything (`:149`) |
# | `distribute_saved_activations` | each run input split over TP: $1/t$ of it per rank |
#
# Every checkpoint also keeps an RNG snapshot so that its replay draws the same dropout masks:
# on CPU a 5,056-byte state of the CPU generator, plus one per tracker stream (3) when the
# model uses dropout; on CUDA small host tensors, nothing on the device. The CPU generator's
# copy is made outside PyTorch's dispatcher, so chapter 01's meter cannot see it; the ledger
# counts it, and page 07.6 leaves it out of the comparison by name. During backward a
# recompute re-creates what it dropped — a run of layers, or the module's inside — on top of
# what is kept (the transient of the next section).
#
# **Activation offload** (chapter 06, `fine_grained_activation_offloading`, `offload_modules`)
# copies the tensors saved inside the chosen regions (`attn_norm`, `qkv_linear`, `core_attn`,
# `attn_proj`, `mlp_norm`) to host memory when they have at least `min_offloaded_tensor_size`
# elements. A storage leaves the device only when every holder is offloaded: attention's
# output is saved by the kernel *and* by `linear_proj`, so it moves only with both regions
# (hence Megatron's rule that `attn_proj` needs `core_attn`); v is a view of the QKV output, so
# its group copies v's elements and frees the whole QKV storage. The head's chunk keeps its
# last layer on the device (the offload margin).

# %%
def _mlp(x: Dims) -> list[Saved]:
    """SwiGLU MLP: fc1 input, fc1 output (gate and up), silu(gate), the product."""
    n = x.s_c * x.b
    return [Saved("mlp", "linear_fc1 input (this rank's SP slice)", x.s_r * x.b * x.h, x.P),
            Saved("mlp", "fc1 output (gate, up)", n * 2 * x.f_t, x.P),
            Saved("mlp", "silu(gate)", n * x.f_t, x.P),
            Saved("mlp", "silu(gate) * up (= linear_fc2 input)", n * x.f_t, x.P)]


CPU_RNG_STATE = "RNG snapshots: CPU generator"


def _snapshots(cfg: MemoryConfig, count: int) -> list[Saved]:
    """RNG snapshots of `count` checkpoints: the CPU generator and the tracker's streams.

    On CPU each state is a 5,056-byte Mersenne-twister tensor; on CUDA the snapshots are small
    host tensors, none on the device. The CPU generator's copy is made outside PyTorch's
    dispatcher, so chapter 01's meter does not see it (page 07.6 leaves it out of the
    comparison); the tracker streams' copies it does see.
    """
    if cfg.device == "cuda" or not count:
        return []
    out = [Saved("recompute", CPU_RNG_STATE, count, 5056)]
    if cfg.model.dropout > 0:  # the model forks its tracker (3 streams) only with dropout
        out.append(Saved("recompute", "RNG snapshots: tracker streams", 3 * count, 5056))
    return out


def _selected(cfg: MemoryConfig, module: str, recompute: bool = True) -> bool:
    """Whether selective recompute checkpoints this module."""
    return (recompute and cfg.recompute_granularity == "selective"
            and module in cfg.recompute_modules)


def _selective_norms(x: Dims, norms: list[Saved], linear_input: Saved, module: str):
    """Output-discarding norm: its input stays; its 1/rms and its output (the linear's input) go."""
    n = x.s_r * x.b * x.h
    keep = [Saved(module, "norm input (checkpoint input)", n, x.P)]
    return keep, None

# %% [markdown]
# `layer_saved` assembles one layer from these parts, then applies the recompute switches in
# the order of the table above and appends the RNG snapshots and the dropout masks.

# %%
def layer_saved(cfg: MemoryConfig, input_is_received: bool = False,
                recompute: bool = True) -> list[Saved]:
    """Every tensor one layer saves for backward on one rank (selective recompute unless off)."""
    x = Dims.of(cfg)
    n = x.s_c * x.b
    norm1, norm2 = _norm("attn_norm", x), _norm("mlp_norm", x)
    if input_is_received:  # the norm's saved input is the received tensor itself
        norm1 = norm1[1:]
    qkv_in = Saved("qkv_linear", "linear_qkv input (this rank's SP slice)", x.s_r * x.b * x.h, x.P)
    mlp = _mlp(x)
    snapshots = 0
    if _selected(cfg, "layernorm", recompute):
        norm1, qkv_in = _selective_norms(x, norm1, qkv_in, "attn_norm")
        norm2, fc1_in = _selective_norms(x, norm2, mlp[0], "mlp_norm")
        mlp = ([fc1_in] if fc1_in else []) + mlp[1:]
        snapshots += 2
    core = _core_attention(cfg, x)
    if _selected(cfg, "core_attn", recompute):
        core, snapshots = _selective_core_attention(cfg, x), snapshots + 1
    if _selected(cfg, "mlp", recompute):
        mlp = [Saved("mlp", "MLP input (checkpoint input)", n * x.h, x.P)]
        snapshots += 1
    out = [*norm1, *([qkv_in] if qkv_in else []), *core, *norm2, *mlp]
    out += _snapshots(cfg, snapshots)
    if cfg.model.dropout > 0:
        out += [Saved("bda", "dropout mask (attention, mlp)", 2 * x.s_r * x.b * x.h,
                      dropout_mask_bytes(cfg, x.P))]
    return out


# %% [markdown]
# ## The ends of the model
#
# **Embedding** (first stage): the token ids, 8 bytes each; with TP the vocab-parallel lookup
# also keeps its local ids (int64) and the out-of-range mask (bool) (appendix A). With dropout,
# one more mask of the residual size.
#
# **Head** (last stage): the final norm, the output layer's input ($P s_c b h$, gathered under
# SP: the head gathers the sequence and then multiplies, so unlike the layers' linears it keeps
# the gathered tensor, $(t - 1) P s_r b h$ more than Megatron's output layer, 32 MiB in the
# running example), and the vocab-parallel cross-entropy's saved softmax in fp32 — $4 b s_c V/t$, the
# largest single activation of a small model — plus its target ids and mask, and the per-token
# loss it returns.
#
# **Between stages**: a non-first chunk keeps the received activation ($P s_r b h$) until its
# backward; a non-last chunk returns its output, which the schedule pseudo-frees once sent
# (chapter 01's `deallocate_output_tensor`).

# %%
def embedding_saved(cfg: MemoryConfig) -> list[Saved]:
    """What the first chunk's embedding keeps: ids (and local ids + mask with TP), dropout."""
    x = Dims.of(cfg)
    n = x.b * x.s_c
    out = [Saved("embedding", "token ids (int64)", n, 8)]
    if cfg.tensor_model_parallel_size > 1:
        out = [Saved("embedding", "local token ids (int64)", n, 8),
               Saved("embedding", "out-of-range mask (bool)", n, 1)]
    if cfg.model.dropout > 0:
        out.append(Saved("embedding", "dropout mask", x.s_r * x.b * x.h,
                         dropout_mask_bytes(cfg, x.P)))
    return out


def head_saved(cfg: MemoryConfig) -> list[Saved]:
    """What the last chunk's head keeps: final norm, output-layer input, CE softmax, loss."""
    x = Dims.of(cfg)
    n = x.b * x.s_c
    return [*_norm("head", x), Saved("head", "output layer input", n * x.h, x.P),
            Saved("head", "cross-entropy softmax (fp32)", n * x.v_t, 4),
            Saved("head", "target ids (int64)", n, 8), Saved("head", "target mask (bool)", n, 1),
            Saved("head", "per-token loss (the output)", n, 4)]

# %% [markdown]
# Full recompute, as in the table: each checkpointed run keeps its input and RNG snapshots.

# %%
def _full_recompute_groups(cfg: MemoryConfig, num_layers: int) -> tuple[int, int]:
    """(checkpointed groups, layers kept normally) of one chunk under full recompute."""
    if cfg.recompute_granularity != "full":
        return 0, num_layers
    n = cfg.recompute_num_layers or 1
    if cfg.recompute_method == "block":
        return min(n, num_layers), num_layers - min(n, num_layers)
    return math.ceil(num_layers / n), 0


def _full_recompute_saved(cfg: MemoryConfig, x: Dims, groups: int, first: bool) -> list[Saved]:
    """Each checkpointed run keeps its input (1/t with distribute_saved_activations) + RNG."""
    resid = x.s_r * x.b * x.h
    if cfg.model.distribute_saved_activations and cfg.tensor_model_parallel_size > 1:
        out = [Saved("recompute", "run inputs, this rank's 1/t", groups * resid
                     // cfg.tensor_model_parallel_size, x.P)]
    else:  # the chunk's own input is the received tensor, counted as the stage input
        out = [Saved("recompute", "checkpointed run inputs", (groups - (0 if first else 1))
                     * resid, x.P)]
    return out + _snapshots(cfg, groups)

# %% [markdown]
# Offload splits each kept layer's tensors into what stays on the device and what goes to the
# host, by the two rules above.

# %%
def _offloaded(cfg: MemoryConfig, layer: list[Saved]) -> tuple[list[Saved], list[Saved]]:
    """(stays on the device, copied to the host) for one layer's saved tensors (chapter 06)."""
    m = cfg.model
    if not m.fine_grained_activation_offloading:
        return layer, []
    chosen, stay, host = set(m.offload_modules), [], []
    for e in layer:
        big = e.saved_numel >= m.min_offloaded_tensor_size
        copy = Saved(e.module, e.what, e.saved_numel, e.itemsize)
        if e.what.startswith("output (= linear_proj input)"):  # saved by attention and proj
            host += [copy] * (big * (("core_attn" in chosen) + ("attn_proj" in chosen)))
            if not (big and {"core_attn", "attn_proj"} <= chosen):
                stay.append(e)  # one holder left on the device keeps the storage alive
        elif big and e.module in chosen:
            host.append(copy)
        else:
            stay.append(e)
    return stay, host


def _kept_layers(cfg: MemoryConfig, normal: int, received: bool, last: bool):
    """(device, host) saved tensors of `normal` plain layers; the head's chunk keeps its last."""
    first, plain = layer_saved(cfg, input_is_received=received), layer_saved(cfg)
    if not cfg.model.fine_grained_activation_offloading:
        return first + ([e.times(normal - 1) for e in plain] if normal > 1 else []), []
    device, host = (first, []) if (last and normal == 1) else _offloaded(cfg, first)
    device, host = list(device), list(host)
    moved = max(0, normal - 1 - (1 if last else 0))  # the offload margin: the last layer stays
    if moved:
        d, h = _offloaded(cfg, plain)
        device += [e.times(moved) for e in d]
        host += [e.times(moved) for e in h]
    if normal - 1 - moved:
        device += [e.times(normal - 1 - moved) for e in plain]
    return device, host

# %% [markdown]
# `chunk_saved` puts one micro-batch on one model chunk together: the recompute runs, the kept
# layers (device and host), the embedding on the first chunk, the head on the last, and the
# received activation on every other.

# %%
def chunk_saved(cfg: MemoryConfig, pp_rank: int, chunk: int) -> dict[str, list[Saved]]:
    """Saved tensors of one micro-batch on one model chunk, by part ("host": offloaded)."""
    x = Dims.of(cfg)
    start, end = stage_layer_ranges(cfg.model.num_layers, cfg.pipeline_model_parallel_size,
                                    cfg.num_chunks, pp_rank)[chunk]
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == cfg.pipeline_model_parallel_size - 1 and chunk == cfg.num_chunks - 1
    groups, normal = _full_recompute_groups(cfg, end - start)
    layers = _full_recompute_saved(cfg, x, groups, first) if groups else []
    host: list[Saved] = []
    if normal:  # the first kept layer may differ (fp32 and a received input); the rest repeat
        device, host = _kept_layers(cfg, normal, not first and not groups, last)
        layers += device
    return {"layers": layers,
            "embedding": embedding_saved(cfg) if first else [],
            "head": head_saved(cfg) if last else [],
            "stage_input": [] if first else [Saved("p2p", "received activation",
                                                   x.s_r * x.b * x.h, x.P)],
            "host": host}


# %% [markdown]
# ## Demo: one layer of the running example, and a stage under each mode
#
# The running example's layer (flash attention, no dropout, selective recompute of
# `core_attn`, as on the front page) against Megatron's per-layer term. What the cell
# prints: one layer on one rank keeps **696.0 MiB** per micro-batch ($b = 2$, $s = 4096$,
# and 32 KiB of $1/\mathrm{rms}$), where Megatron's per-layer term $sbh(18 + 4f/h)/t$ gives
# 512.0 MiB. Term by term, in units of $sbh/t$ bytes (16 MiB here):
#
# | tensor | Megatron's formula | here | difference |
# |---|---|---|---|
# | the two norms' inputs | 2 + 2 | 2 + 2 (and $1/\mathrm{rms}$, 32 KiB) | +32 KiB: the formula leaves out the per-row statistic |
# | `linear_qkv`, `linear_fc1` inputs (SP slices) | 2 + 2 | 2 + 2 | 0 |
# | Q and K | 4 | 2 + 0.5 (k has $g = a/4$ heads) | GQA |
# | V | 2 | 3: the whole QKV output (v is a view of it) | GQA and the fused QKV: together −8 MiB |
# | `linear_proj` input | 2 | 2 | 0 |
# | two dropout masks | 1 + 1 | 0 (dropout 0) | −32 MiB |
# | MLP inside | $2f/h + 2f/h = 14$ | fc1 output $4f/h$, silu $2f/h$, product $2f/h$: 28 | SwiGLU: +224 MiB |
#
# $512 - 8 - 32 + 224 = 696$ MiB. The SwiGLU row is a difference of the formula, not of the
# implementation alone: Megatron's own fused SwiGLU keeps fc1's $2f$ output and fc2's input,
# $6f/h = 21$ units (+112 MiB over its formula); this model also keeps $\mathrm{silu}$ of the
# gate for the backward (+112 MiB more, B.3).
#
# <details><summary>Megatron detail: the layer before the norms matched</summary>
#
# Before the norms and the SP linears kept what Megatron's keep, the layer held 888.0 MiB:
# fp32 norm inputs and the normalized outputs (+64 MiB per norm) and the gathered linear
# inputs (+32 MiB each).
#
# </details>
#
# On stage 0's 16 layers and one micro-batch the modes give 10.88 GiB with no recompute and
# with selective recompute alike (flash saves no $s^2$ term, so selective recompute of core
# attention frees only the logsumexp, 0.5 MiB per layer), 0.50 GiB with full recompute of
# every layer, and 7.51 GiB on the device plus 3.25 GiB on the host with the five offloadable
# regions offloaded.
#
# <details><summary>Megatron detail: chapter 06's table, with materialized attention</summary>
#
# Chapter 06's 7B table assumes Megatron's materialized attention with dropout 0.1 instead.
# Under this ledger's rule for PyTorch's math kernel on CUDA (fp32 scores, bool mask) that
# layer keeps 5,440.0 MiB without recompute and 728.0 MiB with selective recompute: there,
# and only there, selective recompute is what makes a stage fit.
#
# </details>

# %%
if __name__ == "__main__":
    from tinytron.model.config import llama_7b_config

    big = MemoryConfig(llama_7b_config(sequence_parallel=True, recompute_granularity="selective"),
                       tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                       data_parallel_size=64, micro_batch_size=2, num_microbatches=8,
                       use_distributed_optimizer=True)
    rows = layer_saved(big)
    for e in rows:
        print(f"{e.module:>10}  {e.what:<40} {e.nbytes / 2**20:>9,.1f} MiB")
    ours = saved_bytes(rows)
    s, b, h, f = 4096, 2, 4096, 14336
    megatron_layer = s * b * h * (18 + 4 * f / h) / 2
    print(f"one layer, one rank: {ours / 2**20:,.1f} MiB here, Megatron's term "
          f"{megatron_layer / 2**20:,.1f} MiB")
    print("attention kernel: %s (%s)" % attention_kernel_why(big))
    fp32 = big.replace(bf16=False, grad_reduce_in_fp32=True)
    print("the same layer in fp32: %s (%s)" % attention_kernel_why(fp32))

    rstd = 2 * 2048 * b * 4  # the two norms' 1/rms (SP slice of 2048 rows per sample)
    assert ours - rstd == megatron_layer - 8 * 2**20 - 32 * 2**20 + 224 * 2**20  # GQA, masks, SwiGLU
    assert attention_kernel(big) == "flash" and attention_kernel(fp32) == "math"  # 32 / 8 heads

# %% [markdown]
# Then the 16 layers of stage 0 under each recompute mode, and with all five offload regions:
# device bytes, and the host bytes offload adds.

# %%
if __name__ == "__main__":
    import matplotlib.pyplot as plt

    plain = big.model.replace(recompute_granularity=None)
    modes = {"none": plain, "selective": big.model,
             "full, uniform 1": plain.replace(recompute_granularity="full",
                                              recompute_method="uniform", recompute_num_layers=1),
             "offload all 5": plain.replace(fine_grained_activation_offloading=True,
                                            offload_modules=["attn_norm", "qkv_linear",
                                                             "core_attn", "attn_proj",
                                                             "mlp_norm"])}
    stage = {name: chunk_saved(big.replace(model=m), 0, 0) for name, m in modes.items()}
    device = {n: saved_bytes(p["layers"]) / 2**30 for n, p in stage.items()}
    host = {n: saved_bytes(p["host"]) / 2**30 for n, p in stage.items()}
    fig, ax = plt.subplots(figsize=(7, 2.4))
    ax.barh(list(device), list(device.values()), label="device")
    ax.barh(list(host), list(host.values()), left=list(device.values()), label="host (offloaded)")
    ax.set_xlabel("GiB: the 16 layers of stage 0, one micro-batch, one GPU")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    for name in modes:
        print(f"{name:>16}: device {device[name]:6.2f} GiB, host {host[name]:5.2f} GiB")
    order = ["full, uniform 1", "offload all 5", "selective", "none"]
    assert [device[n] for n in order] == sorted(device.values())

# %% [markdown]
# ## Summary
#
# - A layer's activations are a list of tensors, each with a shape that the layout cuts:
#   TP divides the heads and the MLP width, SP the residual-stream tensors (norms, masks), CP
#   the sequence of everything but the gathered K and V.
# - The kernel matters most: flash saves $O(s)$ per head, the math path $O(s^2)$ in fp32.
#   Torch picks it from the dtype, the head layout, the mask and the device (on CUDA, fp32
#   with grouped queries runs the math path); the ledger predicts the pick and says why.
# - Recompute keeps checkpoint inputs (and RNG snapshots) instead of a region's insides;
#   offload moves a region's saved tensors to the host when their last device holder lets go.
#
# ## How production does it
#
# - Megatron: `megatron/core/tensor_parallel/layers.py` (SP linears that save the local slice),
#   `megatron/core/transformer/attention.py:426-468` (selective recompute),
#   `megatron/core/recompute.py` (full recompute),
#   `megatron/core/pipeline_parallel/fine_grained_activation_offload.py` (offload),
#   `megatron/training/theoretical_memory_usage.py:280` (the paper's per-layer count).
# - PyTorch: `torch.nn.functional.scaled_dot_product_attention` kernel selection
#   (`torch.nn.attention.sdpa_kernel`), `torch.autograd.graph.saved_tensors_hooks`.
#
# ## Exercises
#
# 1. Make `ColumnParallelLinear` save only its local slice under SP and all-gather it in
#    backward. Which rows of the table change, and by how much at TP 8?
#
#    <details><summary>Answer</summary>
#
#    The model already does this (B.3): the rows are the
#    `linear_qkv` and `linear_fc1` inputs. Gathered, each is $sbh$ elements in bf16, 64 MiB at
#    any $t$; the local slice is $64/t$ MiB, 8 MiB at TP 8. So 56 MiB less per linear, 112 MiB
#    per layer (at TP 2 the same rule gives the 32 MiB each of the note above).
#
#    </details>
#
# 2. Which offload region frees the most device memory per layer of the running example, and
#    why does `attn_proj` alone free nothing?
#
#    <details><summary>Answer</summary>
#
#    `core_attn`: 88 MiB of the layer's 696 MiB (q 32, k 8
#    and the whole 48 MiB QKV output, which leaves with v since v is a view of it; only 48 MiB
#    is copied to the host). `attn_norm`, `qkv_linear` and `mlp_norm` free 32 MiB each.
#    `attn_proj` saves core attention's output, which the attention kernel saves too: the
#    storage leaves only when both holders are offloaded (`_offloaded`), which is why the
#    config refuses `attn_proj` without `core_attn`. Together they free 120 MiB.
#
#    </details>

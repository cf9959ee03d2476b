"""Input checks of appendix C's kernels: what a kernel cannot take, refused in one line that names it.

The pages keep the mechanisms; these walls of `ValueError`s sit here, each named on its page.
"""

from __future__ import annotations

import torch

from tinytron.kernels._triton import check_tensor

ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
"""Head sizes the kernels take (powers of two for tl.arange, >= 16 for tl.dot, <= 128 for SRAM)."""


def check_attention_inputs(q, k, v) -> None:
    """ValueError naming the first thing the flash-attention kernels cannot take."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        check_tensor(f"flash_attention {name}", t, dims=4, dtype=q.dtype)
    b, hq, s, d = q.shape
    if d not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"flash_attention head size {d} is not supported; use one of "
                         f"{ATTENTION_HEAD_DIMS}")
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (s, d):
        raise ValueError(f"flash_attention key {tuple(k.shape)} and value {tuple(v.shape)} must "
                         f"be [b, kv_heads, s, d] matching query {tuple(q.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"flash_attention query heads ({hq}) must be a multiple of key/value "
                         f"heads ({k.shape[1]})")


def check_segment(main, grad_buffer, param_buffer, buffer_start, group_of) -> dict:
    """The piece's param group, after ValueErrors for what the fused AdamW step cannot serve."""
    if main.dtype != torch.float32:
        raise ValueError(f"fused AdamW masters must be fp32, got {main.dtype}")
    if grad_buffer.dtype != torch.float32:
        raise ValueError(f"fused AdamW reads grads from the grad buffer, which is {grad_buffer.dtype}; "
                         "it needs an fp32 grad buffer (grad_reduce_in_fp32=True)")
    if param_buffer is None:
        raise ValueError("fused AdamW writes into a param buffer; the buffer has none "
                         "(use_distributed_optimizer=False)")
    if not 0 <= buffer_start <= grad_buffer.numel() - main.numel():
        raise ValueError(f"piece [{buffer_start}, {buffer_start + main.numel()}) is outside the "
                         f"buffer of {grad_buffer.numel()} elements")
    group = group_of.get(id(main))
    if group is None:
        raise ValueError("a fused AdamW piece is in none of the optimizer's param groups")
    if not group.get("decoupled_weight_decay", True):
        raise ValueError("fused AdamW implements decoupled weight decay (AdamW); a param group "
                         "has decoupled_weight_decay=False")
    return group


def check_grad_view(main, want_ptr: int) -> None:
    """RuntimeError unless main.grad is the grad buffer's slice the chunk table points at."""
    grad = main.grad
    if grad is None or grad.data_ptr() != want_ptr or not grad.is_contiguous():
        raise RuntimeError("fused AdamW: a master's .grad is not its slice of the fp32 grad "
                           "buffer (the kernel reads the buffer directly)")


def check_one_step(steps: list[int]) -> int:
    """The step count shared by the pieces of one launch (its bias corrections are scalars)."""
    if len(set(steps)) > 1:
        raise RuntimeError(f"fused AdamW: pieces of one param group are at different steps "
                           f"{sorted(set(steps))}; one launch applies one bias correction")
    return steps[0]

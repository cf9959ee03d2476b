"""The checks behind appendix B's ModelConfig: every message names the field to change.

`ModelConfig.__post_init__` calls `check_shape`, `check_activation_fields` and `check_kernels`;
`ModelConfig.check_layout` uses `divides`. The page (chapters/model/config.py) explains what
each rule protects; this module holds the walls of `if ...: raise ValueError(...)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tinytron.kernels import ATTENTION_HEAD_DIMS, HAS_TRITON, KERNEL_CHOICES

if TYPE_CHECKING:
    from tinytron.model.config import ModelConfig


def divides(divisor: int, value: int, field: str, by: str):
    """ValueError naming `field` unless `divisor` divides `value`."""
    if value % divisor:
        raise ValueError(f"{field} ({value}) must be divisible by {by} ({divisor})")


def check_shape(c: ModelConfig) -> None:
    """ValueError naming the field when the shape itself is impossible (any layout)."""
    for name in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                 "ffn_hidden_size", "vocab_size", "seq_length", "rotary_base"):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    divides(c.num_attention_heads, c.hidden_size, "hidden_size", "num_attention_heads")
    divides(c.num_query_groups, c.num_attention_heads, "num_attention_heads", "num_query_groups")
    if c.head_dim % 2:
        raise ValueError(f"hidden_size // num_attention_heads = {c.head_dim} must be even "
                         "(RoPE rotates pairs)")
    if not 0.0 <= c.dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {c.dropout}")
    if not c.norm_epsilon > 0:
        raise ValueError(f"norm_epsilon must be > 0, got {c.norm_epsilon}")
    if not c.init_std > 0:
        raise ValueError(f"init_std must be > 0, got {c.init_std}")


# Megatron's allowed names (transformer_config.py:1546-1698 at e03878b5f); the MoE/MLA ones have no
# module in this dense model, so they are rejected rather than silently ignored.
_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
_OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
_MOE_MLA_MODULES = ("moe_act", "mla_up_proj", "moe", "shared_experts", "expert_fc1", "gdn_norm_out")


def _check_module_names(field: str, names, allowed: tuple[str, ...]) -> list[str]:
    """The names as a list; ValueError naming `field` for an unknown or MoE/MLA-only name."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{field} must be a list of names, got {names!r}")
    for name in names:
        if name not in allowed:
            why = "this dense model has no MoE/MLA module" if name in _MOE_MLA_MODULES else "unknown"
            raise ValueError(f"{field}: {name!r} is not one of {list(allowed)} ({why})")
    return list(names)


def check_activation_fields(c: ModelConfig) -> None:
    """Megatron's rules for the recompute and offload switches, as ValueErrors naming the field."""
    if c.recompute_granularity not in (None, "full", "selective"):
        raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', "
                         f"got {c.recompute_granularity!r}")
    if c.recompute_granularity == "full":
        if c.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be 'uniform' or 'block' with full recompute, "
                             f"got {c.recompute_method!r}")
        n = c.recompute_num_layers
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= c.num_layers:
            raise ValueError(f"recompute_num_layers must be an int in [1, num_layers = "
                             f"{c.num_layers}] with full recompute, got {n!r}")
    else:
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(c, name) is not None:
                raise ValueError(f"{name} must be None unless recompute_granularity is 'full' "
                                 f"(it is {c.recompute_granularity!r})")
    c.recompute_modules = _check_module_names(
        "recompute_modules", ["core_attn"] if c.recompute_modules is None else c.recompute_modules,
        _RECOMPUTE_MODULES)
    if c.distribute_saved_activations and c.sequence_parallel:
        raise ValueError("distribute_saved_activations cannot be combined with sequence_parallel "
                         "(the checkpointed input already differs across TP ranks)")
    c.offload_modules = _check_module_names("offload_modules", c.offload_modules or [],
                                            _OFFLOAD_MODULES)
    if not isinstance(c.min_offloaded_tensor_size, int) or c.min_offloaded_tensor_size < 0:
        raise ValueError(f"min_offloaded_tensor_size must be an int >= 0, "
                         f"got {c.min_offloaded_tensor_size!r}")
    if c.fine_grained_activation_offloading:
        if not c.offload_modules:
            raise ValueError("offload_modules must name at least one module when "
                             "fine_grained_activation_offloading is on")
        if "attn_proj" in c.offload_modules and "core_attn" not in c.offload_modules:
            raise ValueError("offload_modules: attn_proj needs core_attn (its input is core "
                             "attention's output, which core attention's backward also reads)")
        if c.recompute_granularity == "full":
            raise ValueError("fine_grained_activation_offloading cannot be combined with "
                             "recompute_granularity='full' (full recompute saves only layer inputs)")
        if (c.recompute_granularity == "selective" and "layernorm" in c.recompute_modules
                and "qkv_linear" in c.offload_modules):
            raise ValueError("offload_modules: qkv_linear cannot be offloaded while 'layernorm' is in "
                             "recompute_modules (the norm's output, qkv's input, is freed instead)")


def check_kernels(c: ModelConfig) -> None:
    """ValueError naming `kernels` (or the head size) when appendix C's kernels cannot serve c."""
    if c.kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {c.kernels!r}")
    if c.kernels == "triton" and not HAS_TRITON:
        raise ValueError("kernels='triton' needs the triton package (pip install 'tinytron[kernels]')")
    if c.kernels != "torch" and c.head_dim not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"kernels={c.kernels!r}: the flash-attention kernel takes head sizes "
                         f"{ATTENTION_HEAD_DIMS}, got hidden_size // num_attention_heads = {c.head_dim}")


# -- appendix B.4 (gpt.py): the model's input checks -----------------------------------------
def on_host(t: torch.Tensor) -> bool:
    """Whether a check of t reads host memory (free) rather than waiting for a device (a sync)."""
    return t.device.type == "cpu"


def check_ids(ids: torch.Tensor, name: str, vocab_size: int) -> None:
    """ValueError naming the largest (or a negative) id outside [0, vocab_size)."""
    low, high = (int(v) for v in torch.aminmax(ids))
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} hold id {high if high >= vocab_size else low} outside "
                         f"[0, vocab_size = {vocab_size}) (largest id {high})")


def check_attention_mask(mask: torch.Tensor) -> None:
    """ValueError when some query may attend to no key at all (a mask in the other convention)."""
    if bool(mask.to(torch.bool).all(dim=-1).any()):
        raise ValueError("attention_mask masks every key of some query: tinytron uses Megatron's "
                         "convention, True = masked (a Hugging Face mask has 1 = keep: pass ~mask)")

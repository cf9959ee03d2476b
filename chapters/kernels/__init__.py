"""Appendix C · Kernels: the fused operations of a training step, written in Triton."""

from tinytron.kernels._triton import (HAS_TRITON, INTERPRET, KERNEL_CHOICES, resolve_kernels,
                                      use_triton)
from tinytron.kernels.cross_entropy import (cross_entropy, cross_entropy_bytes,
                                            cross_entropy_saved_bytes, vocab_parallel_cross_entropy,
                                            vocab_parallel_cross_entropy_reference)
from tinytron.kernels.flash_attention import (ATTENTION_HEAD_DIMS, attention_bytes, attention_eager,
                                              attention_flops, attention_reference,
                                              flash_attention)
from tinytron.kernels.fused_adamw import FlatAdamW, adamw_bytes, adamw_reference_, fused_adamw_
from tinytron.kernels.rmsnorm import (rms_norm, rms_norm_bytes, rms_norm_forward_bound,
                                      rms_norm_moved, rms_norm_other_order, rms_norm_reference)
from tinytron.kernels.swiglu import swiglu, swiglu_bytes, swiglu_reference

__pages__ = ["roofline", "rmsnorm", "swiglu", "cross_entropy", "flash_attention", "fused_adamw",
             "inductor"]

__all__ = ["HAS_TRITON", "INTERPRET", "KERNEL_CHOICES", "resolve_kernels", "use_triton",
           "rms_norm", "rms_norm_reference", "rms_norm_bytes", "rms_norm_forward_bound", "rms_norm_moved",
           "rms_norm_other_order",
           "swiglu", "swiglu_reference", "swiglu_bytes",
           "cross_entropy", "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_reference",
           "cross_entropy_bytes", "cross_entropy_saved_bytes",
           "flash_attention", "attention_reference", "attention_eager", "attention_flops",
           "attention_bytes", "ATTENTION_HEAD_DIMS",
           "FlatAdamW", "fused_adamw_", "adamw_reference_", "adamw_bytes"]

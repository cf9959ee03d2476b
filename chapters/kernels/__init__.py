"""Appendix C · Kernels: the fused operations of a training step, written in Triton."""

from tinytron.kernels.cross_entropy import (cross_entropy, cross_entropy_bytes,
                                            cross_entropy_saved_bytes, vocab_parallel_cross_entropy,
                                            vocab_parallel_cross_entropy_reference)
from tinytron.kernels.rmsnorm import rms_norm, rms_norm_bytes, rms_norm_reference
from tinytron.kernels.swiglu import swiglu, swiglu_bytes, swiglu_reference

__pages__ = ["rmsnorm", "swiglu", "cross_entropy"]

__all__ = ["rms_norm", "rms_norm_reference", "rms_norm_bytes", "swiglu", "swiglu_reference",
           "swiglu_bytes", "cross_entropy", "vocab_parallel_cross_entropy",
           "vocab_parallel_cross_entropy_reference", "cross_entropy_bytes",
           "cross_entropy_saved_bytes"]

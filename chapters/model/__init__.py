"""Appendix B · The Llama-style GPT every chapter trains, built from appendix A's layers."""

from tinytron.model.config import (ModelConfig, count_parameters, count_parameters_per_rank,
                                   llama_7b_config, padded_vocab_size, parameter_breakdown,
                                   stage_layer_ranges, tiny_config)
from tinytron.model.layers import RMSNorm, ShardSpec, apply_rope, rope_cos_sin

__pages__ = ["config", "layers"]

__all__ = ["ModelConfig", "tiny_config", "llama_7b_config", "padded_vocab_size",
           "stage_layer_ranges", "parameter_breakdown", "count_parameters",
           "count_parameters_per_rank", "RMSNorm", "ShardSpec", "apply_rope", "rope_cos_sin"]

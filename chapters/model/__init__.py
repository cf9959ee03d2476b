"""Appendix B · The Llama-style GPT every chapter trains, built from appendix A's layers."""

from tinytron.model.config import (ModelConfig, count_parameters, count_parameters_per_rank,
                                   llama_7b_config, padded_vocab_size, parameter_breakdown,
                                   stage_layer_ranges, tiny_config)
from tinytron.model.gpt import (GPTModel, build_stage_models, global_parameter_name,
                                init_parameters, stage_tensor_shape)
from tinytron.model.hf import load_hf_llama, save_hf_llama
from tinytron.model.layers import RMSNorm, ShardSpec, apply_rope, rope_cos_sin, shard_of, unshard
from tinytron.model.transformer_layer import SelfAttention, SwiGLUMLP, TransformerLayer

__pages__ = ["config", "layers", "transformer_layer", "gpt", "hf", "generate"]

__all__ = ["ModelConfig", "tiny_config", "llama_7b_config", "padded_vocab_size",
           "stage_layer_ranges", "parameter_breakdown", "count_parameters",
           "count_parameters_per_rank", "RMSNorm", "ShardSpec", "apply_rope", "rope_cos_sin",
           "shard_of", "unshard", "GPTModel", "SelfAttention", "SwiGLUMLP", "TransformerLayer",
           "build_stage_models", "global_parameter_name", "init_parameters",
           "stage_tensor_shape", "load_hf_llama", "save_hf_llama"]

"""07 · The memory model: the ledger, how parallelism splits it, configuration search."""

from tinytron.memory.megatron_model import (NUM_BYTES_IN_MEGABYTE, megatron_args,
                                            megatron_param_counts,
                                            megatron_theoretical_memory)
from tinytron.memory.states import MemoryConfig, chunk_params, state_ledger
from tinytron.memory.activations import (Saved, activation_peak, chunk_saved, layer_saved,
                                         schedule_ops)

__pages__ = ["megatron_model", "states", "activations"]

__all__ = ["NUM_BYTES_IN_MEGABYTE", "megatron_args", "megatron_param_counts",
           "megatron_theoretical_memory", "MemoryConfig", "chunk_params", "state_ledger", "Saved",
           "activation_peak", "chunk_saved", "layer_saved", "schedule_ops"]

"""06 · Activation recompute and CPU offload."""

from tinytron.recompute.checkpoint import (CheckpointFunction, CheckpointOptions,
                                           CheckpointWithoutOutput, RNGSnapshot,
                                           capture_rng_states, checkpoint, fork_rng,
                                           restore_rng_states)
from tinytron.recompute.offload import (ChunkOffloadHandler, HostBufferPool, OffloadGroup,
                                        OffloadManager, install_offload)
from tinytron.recompute.recompute import (FullRecompute, apply_recompute,
                                          recompute_core_attention, recompute_module,
                                          recompute_norm_output)
from tinytron.recompute.activation_memory import (decoder_activation_bytes,
                                                  layer_activation_bytes, layer_activation_terms,
                                                  measure_activation_bytes, rng_snapshot_bytes)

__pages__ = ["checkpoint", "recompute", "offload", "activation_memory"]

__all__ = ["CheckpointFunction", "CheckpointOptions", "CheckpointWithoutOutput", "RNGSnapshot",
           "capture_rng_states", "checkpoint", "fork_rng", "restore_rng_states",
           "ChunkOffloadHandler", "HostBufferPool", "OffloadGroup", "OffloadManager",
           "install_offload", "FullRecompute", "apply_recompute", "recompute_core_attention",
           "recompute_module", "recompute_norm_output", "decoder_activation_bytes",
           "layer_activation_bytes", "layer_activation_terms", "measure_activation_bytes",
           "rng_snapshot_bytes"]

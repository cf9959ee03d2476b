"""03 · Checkpoint: Megatron's formats (legacy and torch_dist), async save, resharding resume."""

from tinytron.checkpoint.async_save import AsyncSaver
from tinytron.checkpoint.formats import (CheckpointSaveError, checkpoint_dir_name, checkpoint_sizes,
                                         detect_format, files_written, read_tracker, write_tracker)
from tinytron.checkpoint.resharding import flat_range_boxes, optimizer_pieces
from tinytron.checkpoint.resume import (CheckpointConfig, CheckpointHooks, CheckpointManager,
                                        load_checkpoint, make_checkpoint_hooks, save_checkpoint)
from tinytron.checkpoint.saved_state import get_rng_state, set_rng_state
from tinytron.checkpoint.sharded_keys import (ShardedObject, ShardedTensor, TensorLayout,
                                              model_sharded_state_dict, sharded_key)
from tinytron.checkpoint.staged_copy import StagedAsyncSaver
from tinytron.checkpoint.torch_dist import load_model_weights, save_model_weights

__pages__ = ["formats", "legacy", "sharded_keys", "torch_dist", "resharding", "async_save",
             "staged_copy", "saved_state", "resume", "convert"]

__all__ = ["AsyncSaver", "StagedAsyncSaver", "CheckpointSaveError", "checkpoint_dir_name",
           "checkpoint_sizes", "detect_format", "files_written", "read_tracker", "write_tracker",
           "flat_range_boxes", "optimizer_pieces", "CheckpointConfig", "CheckpointHooks",
           "CheckpointManager", "get_rng_state", "load_checkpoint", "make_checkpoint_hooks",
           "save_checkpoint", "set_rng_state", "ShardedObject", "ShardedTensor", "TensorLayout",
           "model_sharded_state_dict", "sharded_key", "load_model_weights", "save_model_weights"]

"""05 · Grad/param buffers: the contiguous buffer and its read/write loop."""

from tinytron.buffers.param_and_grad_buffer import (Bucket, BufferKey, ParamAndGradBuffer,
                                                    ParamLayout, ShardRange, compute_param_layout,
                                                    group_params_for_buffers, pad_bucket_end,
                                                    pad_param_start)
from tinytron.buffers.bucket_group import BucketGroup, default_bucket_size
from tinytron.buffers.distributed_data_parallel import (DistributedDataParallel,
                                                        DistributedDataParallelConfig)

from tinytron.buffers.finalize_model_grads import finalize_model_grads, main_grad_of

__pages__ = ["naive_ddp", "param_and_grad_buffer", "bucket_group", "distributed_data_parallel",
             "overlap_timeline", "finalize_model_grads"]

__all__ = ["Bucket", "BufferKey", "ParamAndGradBuffer", "ParamLayout", "ShardRange",
           "compute_param_layout", "group_params_for_buffers", "pad_bucket_end", "pad_param_start",
           "BucketGroup", "DistributedDataParallel", "DistributedDataParallelConfig",
           "default_bucket_size", "finalize_model_grads", "main_grad_of"]

"""02 · Optimizer: the algorithms and the infrastructure (master weights, scaler, clip, DistributedOptimizer)."""

from tinytron.optimizer.algorithms import (SGD, Adam, AdamW, ChainedOptimizer, Lion,
                                           build_param_groups)
from tinytron.optimizer.distributed import DistributedOptimizer
from tinytron.optimizer.factory import (OptimizerConfig, SchedulerConfig, get_megatron_optimizer,
                                        get_optimizer_param_scheduler)
from tinytron.optimizer.layer_wise import LayerWiseDistributedOptimizer
from tinytron.optimizer.mixed_precision import (ConstantGradScaler, DynamicGradScaler,
                                                MixedPrecisionOptimizer)
from tinytron.optimizer.muon import MaxLogitTracker, Muon, build_muon_adamw, qk_clip_
from tinytron.optimizer.offload import HybridDeviceOptimizer
from tinytron.optimizer.scheduler import OptimizerParamScheduler

__pages__ = ["algorithms", "muon", "scheduler", "mixed_precision", "zero1", "distributed",
             "zero_fsdp", "layer_wise", "offload", "factory", "training"]

__all__ = ["SGD", "Adam", "AdamW", "ChainedOptimizer", "Lion", "build_param_groups",
           "DistributedOptimizer", "OptimizerConfig", "SchedulerConfig", "get_megatron_optimizer",
           "get_optimizer_param_scheduler", "LayerWiseDistributedOptimizer", "ConstantGradScaler",
           "DynamicGradScaler", "MixedPrecisionOptimizer", "MaxLogitTracker", "Muon",
           "build_muon_adamw", "qk_clip_", "HybridDeviceOptimizer", "OptimizerParamScheduler"]

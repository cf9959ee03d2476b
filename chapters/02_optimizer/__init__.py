"""02 · Optimizer: the algorithms and the infrastructure (master weights, scaler, clip, DistributedOptimizer)."""

__pages__ = ["algorithms", "muon", "scheduler", "mixed_precision", "distributed", "layer_wise",
             "offload", "factory", "training"]

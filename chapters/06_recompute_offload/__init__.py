"""06 · Activation recompute and CPU offload."""

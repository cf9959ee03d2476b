"""08 · Reliability, observability and the full-iteration CUDA graph."""

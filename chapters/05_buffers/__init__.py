"""05 · Grad/param buffers: the contiguous buffer and its read/write loop."""

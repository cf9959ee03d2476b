"""Appendix A · Parallel primitives: the process-group grid, TP/SP layers, CP, pipeline p2p, RNG."""

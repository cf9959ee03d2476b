"""Appendix A · Parallel primitives: the process-group grid, TP/SP layers, CP, pipeline p2p, RNG."""

from tinytron.parallel.grid import AXES, DEFAULT_ORDER, ParallelGrid, RankLayout, rank_layout

__pages__ = ["grid"]

__all__ = ["AXES", "DEFAULT_ORDER", "ParallelGrid", "RankLayout", "rank_layout"]

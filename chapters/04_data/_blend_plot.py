"""The drawing of a blend's realized mixture, for chapter 04's blend page (not a page)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def plot_blend_ratios(dataset_index: np.ndarray, weights: Sequence[float], names=None, seed: int = 0):
    """Running fraction of each dataset vs its weight; worst |count - w*k| vs a random mixture."""
    import matplotlib.pyplot as plt

    di = np.asarray(dataset_index, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)
    k = np.arange(1, len(di) + 1)
    rand = np.random.default_rng(seed).choice(len(w), size=len(di), p=w)
    fig, (ax, ax_err) = plt.subplots(1, 2, figsize=(10, 3.2))
    for i, wi in enumerate(w):
        ax.plot(k, np.cumsum(di == i) / k, label=f"{names[i] if names else i} (w={wi:.3f})")
        ax.axhline(wi, color="0.6", lw=0.6, ls="--")
    for picks, label in ((di, "greedy (Megatron)"), (rand, "random, same weights")):
        counts = np.cumsum(np.eye(len(w), dtype=np.int64)[picks], axis=0)
        ax_err.plot(k, np.abs(counts - np.outer(k, w)).max(axis=1), label=label)
    ax.set(xscale="log", xlabel="samples drawn", ylabel="realized fraction")
    ax_err.set(xscale="log", yscale="log", xlabel="samples drawn",
               ylabel="worst |count − w·k| (samples)")
    ax_err.axhline(1, color="r", lw=0.6)
    for a in (ax, ax_err):
        a.legend(fontsize=8)
    fig.tight_layout()
    return fig

"""Chapter 06's drawings, out of the pages' way (not a page)."""

from __future__ import annotations


def plot_live_bytes(lines: dict[str, list[int]]):
    """One curve of device live MiB per operator call for each named timeline; the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.6))
    for (label, line), color in zip(lines.items(), ("#4c72b0", "#55a868", "#c44e52")):
        ax.plot([v / 2**20 for v in line], label=label, color=color)
    ax.set_xlabel("operator call (forward, then backward)"), ax.set_ylabel("live MiB")
    ax.set_title("device live bytes of one micro-batch (measured, CPU)")
    ax.legend(fontsize=8)
    plt.tight_layout()
    return fig

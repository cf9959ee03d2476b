"""Drawing helpers of chapter 07's pages, kept off the pages (the pages keep the numbers).

[07.2](states.py) calls `plot_bytes_per_param` for its bytes-per-parameter bars.
"""

from __future__ import annotations

_COLORS = {"weights": "#4c72b0", "grad_buffer": "#64b5cd", "master_params": "#8172b3",
           "optimizer_state": "#b39ddb", "host_optimizer": "#dd8452",
           "fp32_grad_copies": "#937860"}


def plot_bytes_per_param(per_param: dict[str, dict[str, float]], xlabel: str):
    """Stacked horizontal bars, one per ledger: bytes per parameter, term by term."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.4))
    for i, (name, terms) in enumerate(per_param.items()):
        left = 0.0
        for term, value in terms.items():
            ax.barh(name, value, left=left, color=_COLORS.get(term),
                    label=term.replace("_", " ") if i == 0 else None)
            left += value
        ax.text(left + 0.2, name, f"{left:g} B", va="center", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, 20)
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncol=2, loc="lower right")
    fig.tight_layout()
    return fig

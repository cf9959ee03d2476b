"""The drawing of packed SFT rows for chapter 04's SFT page (not a page)."""

from __future__ import annotations


def plot_packed_rows(named_rows, seq_length: int):
    """One line per (name, row): conversation segments in colors, pads gray, loss tokens dotted."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 1.9))
    for y, (name, row) in enumerate(named_rows):
        cu = row["cu_seqlens"].tolist()
        for k, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
            for t in range(lo, hi):
                pad = bool(row["tokens"][t] == 0)
                ax.add_patch(plt.Rectangle((t, -y), 0.95, 0.8, color="0.85" if pad else f"C{k}"))
                if row["loss_mask"][t] > 0:
                    ax.plot(t + 0.47, -y + 0.4, "k.", ms=4)
        ax.text(-0.6, -y + 0.4, name, ha="right", va="center", fontsize=9)
    ax.set_xlim(-4, seq_length)
    ax.set_ylim(-1.2, 1)
    ax.axis("off")
    ax.set_title("one packed SFT row: conversations (colors), pads (gray), loss tokens (dots)",
                 fontsize=9)
    return fig

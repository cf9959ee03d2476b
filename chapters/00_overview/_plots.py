"""The drawing of one row's masks and positions, for chapter 00's pages (not a page)."""

from __future__ import annotations

import torch


def plot_masks(attention_mask: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor,
               labels: list[str] | None = None, title: str = ""):
    """Draw attention mask (dark = may attend), loss mask and position ids of one row; returns the figure."""
    import matplotlib.pyplot as plt

    allowed = (~attention_mask.reshape(attention_mask.shape[-2:])).float().numpy()
    s = allowed.shape[0]
    fig, axes = plt.subplots(3, 1, figsize=(max(4.0, 0.28 * s + 1.5), 0.28 * s + 3.2),
                             gridspec_kw={"height_ratios": [s, 1.2, 1.2]})
    axes[0].imshow(allowed, cmap="Greys", vmin=0, vmax=1)
    axes[0].set_ylabel("query")
    axes[0].set_title(title or "attention (dark = may attend)", fontsize=9)
    axes[1].imshow(loss_mask.reshape(1, -1).float().numpy(), cmap="Greens", vmin=0, vmax=1,
                   aspect="auto")
    axes[1].set_ylabel("loss", rotation=0, ha="right")
    pos = position_ids.reshape(1, -1).numpy()
    axes[2].imshow(pos, cmap="Blues", aspect="auto")
    for k in range(s):
        axes[2].text(k, 0, str(pos[0, k]), ha="center", va="center", fontsize=7)
    axes[2].set_ylabel("pos", rotation=0, ha="right")
    for ax in axes:
        ax.set_yticks([] if ax is not axes[0] else range(s))
        ax.set_xticks(range(s))
        ax.set_xticklabels(labels or [""] * s, rotation=90, fontsize=7)
    if labels:
        axes[0].set_yticklabels(labels, fontsize=7)
    fig.tight_layout()
    return fig

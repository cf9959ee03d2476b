"""The drawing of which ranks build datasets, for chapter 04's pipeline page (not a page)."""

from __future__ import annotations


def plot_dataset_ranks(layouts, builds_datasets):
    """One panel per (tp, pp) of 8 ranks: green where `builds_datasets(tp, pp, pp_size)`."""
    import matplotlib.pyplot as plt

    from tinytron.parallel.grid import rank_layout

    fig, axes = plt.subplots(1, len(layouts), figsize=(10, 2.6))
    for ax, (tp, pp) in zip(axes, layouts):
        layout = rank_layout(8, tp=tp, pp=pp)
        built = []
        for r, c in enumerate(layout.coords):
            x, y = c["pp"] * tp + c["tp"], c["dp"]  # columns: stage, then TP rank; rows: DP
            yes = builds_datasets(c["tp"], c["pp"], pp)
            built.append(r) if yes else None
            ax.add_patch(plt.Rectangle((x, -y), 0.92, 0.85, color="tab:green" if yes else "0.88"))
            ax.text(x + 0.46, -y + 0.42, f"rank {r}\ntp{c['tp']} pp{c['pp']} dp{c['dp']}",
                    ha="center", va="center", fontsize=7)
        ax.set_xlim(0, tp * pp)
        ax.set_ylim(-layout.sizes["dp"] + 1, 1)
        ax.axis("off")
        ax.set_title(f"TP{tp} × PP{pp} × DP{layout.sizes['dp']}: datasets on ranks {built}",
                     fontsize=9)
    fig.tight_layout()
    return fig

"""The drawing of a ParamAndGradBuffer's layout, for chapter 05's buffer page (not a page)."""

from __future__ import annotations


def plot_buffer_layout(buffer: ParamAndGradBuffer, ax=None, title: str = ""):
    """Draw params, padding, bucket boundaries and each DP rank's shard of ``buffer``."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * buffer.dp_size))
    cmap = plt.get_cmap("tab20")
    ax.barh(0, buffer.numel, left=0, height=0.8, color="#dddddd", hatch="//", edgecolor="#999999")
    for i, p in enumerate(sorted(buffer.params, key=lambda q: buffer.param_index_map[q][0])):
        s, e, _ = buffer.param_index_map[p]
        ax.barh(0, e - s, left=s, height=0.8, color=cmap(i % 20), edgecolor="black", lw=0.5)
        if e - s > buffer.numel / 40:
            ax.text((s + e) / 2, 0, buffer.name(p), ha="center", va="center", fontsize=7,
                    rotation=90 if e - s < buffer.numel / 8 else 0)
    for b in buffer.buckets:
        ax.axvline(b.offset, color="red", lw=1.5)
        ax.text(b.offset + b.numel / 2, 0.5, f"bucket {b.bucket_id}", ha="center", va="bottom",
                color="red", fontsize=8)
        for r in range(buffer.dp_size):
            s, e = b.shard_range(r)
            ax.barh(-1 - r, e - s, left=b.offset + s, height=0.6, color=plt.get_cmap("Set2")(r),
                    edgecolor="black", lw=0.5)
    ax.axvline(buffer.numel, color="red", lw=1.5)
    ax.set_ylim(-buffer.dp_size - 0.5, 1.0)
    ax.set_yticks([0] + [-1 - r for r in range(buffer.dp_size)],
                  ["params"] + [f"dp rank {r}" for r in range(buffer.dp_size)])
    ax.set_xlabel("element offset in the flat buffer (gray hatch = padding)")
    ax.set_title(title or repr(buffer), fontsize=9)
    return ax

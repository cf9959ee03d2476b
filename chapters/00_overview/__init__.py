"""00 · The big picture: from data to a weight update (labels, masks, one loss contract)."""

__pages__ = ["batch", "sft", "loss", "grpo"]

"""00 · The big picture: from data to a weight update (labels, masks, one loss contract)."""

__pages__ = ["pipeline", "batch", "sft", "loss", "grpo", "modes"]

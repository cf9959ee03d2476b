"""03 · Checkpoint: formats, async save and resharding resume."""

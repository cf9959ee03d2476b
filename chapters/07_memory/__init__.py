"""07 · The memory model: the ledger, how parallelism splits it, configuration search."""

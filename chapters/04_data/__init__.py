"""04 · Data: from .bin/.idx to get_batch."""

"""04 · Data: from .bin/.idx to get_batch."""

__pages__ = ["indexed", "gpt_dataset"]

"""04 · Data: from .bin/.idx to get_batch."""

__pages__ = ["indexed", "preprocess", "gpt_dataset", "blended", "samplers", "get_batch", "sft"]

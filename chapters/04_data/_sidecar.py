"""The tokenizer sidecar: `<prefix>.tokenizer_info.json` beside Megatron's `<prefix>.bin/.idx`.

Megatron's indexed format stores token ids and nothing about the tokenizer that made them, so
data tokenized with a BPE (EOD 0, pad 1) trains without complaint under the byte tokenizer
(EOD 256, pad 257): wrong document boundaries, a pad id that is a real token. `tinytron-preprocess`
therefore writes, next to the unchanged `.bin/.idx`, one small JSON object naming the tokenizer:

    {"format": "tinytron-tokenizer-sidecar", "version": 1, "tokenizer_type": "hf",
     "tokenizer_file": "/abs/path/tokenizer.json", "tokenizer_sha256": "…",
     "vocab_size": 600, "eod": 0, "pad": 1}

The trainer compares it with `[tokenizer]` before any process group exists. Data without a
sidecar (made by Megatron's `tools/preprocess_data.py`) is read as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

FORMAT = "tinytron-tokenizer-sidecar"
VERSION = 1
SUFFIX = ".tokenizer_info.json"

__all__ = ["sidecar_path", "describe_tokenizer", "write_sidecar", "read_sidecar",
           "sidecar_mismatch"]


def sidecar_path(prefix: str) -> str:
    """`<prefix>.tokenizer_info.json`."""
    return str(prefix) + SUFFIX


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def describe_tokenizer(kind: str, path: Optional[str], tokenizer) -> dict:
    """The sidecar's content for a built tokenizer ("byte", or "hf" with its file)."""
    return {"format": FORMAT, "version": VERSION, "tokenizer_type": kind,
            "tokenizer_file": os.path.abspath(path) if path else None,
            "tokenizer_sha256": file_sha256(path) if path else None,
            "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod),
            "pad": int(getattr(tokenizer, "pad", -1))}


def write_sidecar(prefix: str, info: dict) -> str:
    """Write the sidecar atomically (a reader never sees half of it); return its path."""
    path = sidecar_path(prefix)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_sidecar(prefix: str) -> Optional[dict]:
    """The sidecar of a dataset prefix, or None when it has none (Megatron-made data)."""
    path = sidecar_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable tokenizer sidecar ({e})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"{path}: not a tinytron tokenizer sidecar (no format {FORMAT!r})")
    return info


def sidecar_mismatch(info: dict, expected: dict) -> list[str]:
    """The fields on which the data's tokenizer and the run's disagree, as 'name X vs Y'."""
    out = []
    for key in ("tokenizer_type", "tokenizer_sha256", "vocab_size", "eod", "pad"):
        if info.get(key) != expected.get(key):
            a, b = info.get(key), expected.get(key)
            if key == "tokenizer_sha256":
                a, b = (a or "none")[:12], (b or "none")[:12]
            out.append(f"{key.replace('tokenizer_', '')} {a} (data) vs {b} ([tokenizer])")
    return out

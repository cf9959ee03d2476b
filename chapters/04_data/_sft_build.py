"""The trainer's SFT mode (`[data] sft = true`): chat JSONL files -> chapter 04's SFTDataset splits.

Megatron's `--sft` (`megatron/training/arguments.py:3383`) swaps GPTDataset for SFTDataset
(`pretrain_gpt.py:344-346`), whose low-level dataset reads the JSONL file itself
(`megatron/training/datasets/sft_dataset.py:35-41`): there is no preprocessing step, so the
message roles that decide which tokens carry a loss are never flattened away. This module does
the same with [the SFT page's](sft.py) `SFTDataset`: one JSONL path (or one per split), its
records cut into train/valid/test by `[data] split` exactly as a `.bin/.idx` prefix's documents
are (`split_indices`), each record packed into one row when it is read.

The packer writes every message as `<|role|> content <|end|>` (chapter 00's template), so a
Hugging Face tokenizer must hold those four tokens; `chat_tokenizer` names the one it lacks.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

__all__ = ["CHAT_TOKENS", "chat_tokenizer", "sft_paths", "build_sft_datasets"]

CHAT_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end|>"


class _HFChat:
    """A Hugging Face tokenizer with the byte tokenizer's chat interface (role ids, end of turn)."""

    def __init__(self, tok, path: Optional[str] = None):
        self._tok, self.eod, self.vocab_size = tok, tok.eod, tok.vocab_size
        self.pad = tok.pad
        ids = {name: tok._tok.token_to_id(text) for name, text in
               {**CHAT_TOKENS, "end": END_OF_TURN}.items()}
        missing = [t for name, t in {**CHAT_TOKENS, "end": END_OF_TURN}.items() if ids[name] is None]
        if missing:
            raise ValueError(f"tokenizer {path or ''} has no chat token {missing[0]!r}: SFT writes "
                             f"each message as <|role|> content <|end|> and needs "
                             f"{', '.join([*CHAT_TOKENS.values(), END_OF_TURN])} as tokens")
        self._roles, self.end_of_turn = {r: ids[r] for r in CHAT_TOKENS}, ids["end"]

    def role_id(self, role: str) -> int:
        if role not in self._roles:
            raise ValueError(f"unknown chat role {role!r}; expected one of {sorted(self._roles)}")
        return self._roles[role]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)


def chat_tokenizer(tok, path: Optional[str] = None):
    """The tokenizer chapter 00's packer calls: the byte tokenizer as it is, an HF one adapted."""
    return tok if hasattr(tok, "role_id") else _HFChat(tok, path)


def sft_paths(cfg) -> list[str]:
    """Every JSONL path the data config names, checked: a file, no blend weights."""
    out = []
    for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        words = getattr(cfg, key) or []
        if len(words) > 1:
            raise ValueError(f"data.{key}: SFT reads one chat JSONL file per split, got {words} "
                             "(blending chat files is not built)")
        for word in words:
            if not os.path.isfile(str(word)):
                raise ValueError(f"data.{key}: chat JSONL {word} does not exist")
            out.append(str(word))
    if not out:
        raise ValueError("data.sft needs data.data_path (a chat JSONL file: one "
                         "{\"messages\": [{\"role\", \"content\"}, ...]} per line)")
    return out


def build_sft_datasets(cfg, seq_length: int, num_samples: Sequence[int], is_built_on_rank,
                       tokenizer, context_parallel_size: int = 1) -> list:
    """[train, valid, test] SFTDatasets (None where empty or not built on this rank)."""
    from tinytron.data._chat_jsonl import read_chat_jsonl
    from tinytron.data.gpt_dataset import (convert_split_vector_to_split_matrix,
                                           parse_and_normalize_split, split_indices)
    from tinytron.data.sft import SFTDataset

    if not is_built_on_rank():
        return [None, None, None]
    tok = chat_tokenizer(tokenizer)
    per_split = [cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path]
    if any(per_split):
        sources = [(read_chat_jsonl(str(p[0])), None) if p else None for p in per_split]
    else:
        records = read_chat_jsonl(str(cfg.data_path[0]))
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(cfg.split))
        sources = [(records, idx) if idx is not None and len(idx) else None
                   for idx in (split_indices(b, len(records)) for b in matrix)]
    out = []
    for source, n in zip(sources, num_samples):
        if source is None or not n:
            out.append(None)
            continue
        records, idx = source
        out.append(SFTDataset(records, seq_length, tok, indices=idx, num_samples=n,
                              context_parallel_size=context_parallel_size))
    return out

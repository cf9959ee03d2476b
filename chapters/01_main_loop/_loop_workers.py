"""Helpers and per-rank workers for the loop pages' demos (importable by name for spawned ranks)."""

from __future__ import annotations

import torch

__all__ = ["SyntheticTokens", "synthetic_iterators"]


class SyntheticTokens(torch.utils.data.Dataset):
    """Sequences t, t+7, t+14, ... (mod V) from a per-index random start: learnable, deterministic."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234,
                 stride: int = 7):
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.stride = seed, stride

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(idx))
        start = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        seq = (start + self.stride * torch.arange(self.seq_length + 1)) % self.vocab_size
        return {"tokens": seq[:-1], "labels": seq[1:],
                "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
                "position_ids": torch.arange(self.seq_length)}


def synthetic_iterators(model_config, grid, state, *, micro_batch_size: int,
                        num_samples: int = 100_000, seed: int = 1234):
    """(train, valid) iterators over SyntheticTokens through chapter 04's sampler, resumed."""
    from tinytron.data.samplers import build_pretraining_data_loader

    dp_rank, dp = max(grid.rank("dp"), 0), grid.size("dp")
    out = []
    for ds_seed, consumed in ((seed, state.consumed_train_samples),
                              (seed + 1, state.consumed_valid_samples)):
        ds = SyntheticTokens(num_samples, model_config.seq_length, model_config.vocab_size, ds_seed)
        out.append(iter(build_pretraining_data_loader(ds, consumed, micro_batch_size, dp_rank, dp)))
    return out[0], out[1]

# %% [markdown]
# # 04 · Data: the whole pipeline in one call
#
# The pieces of this chapter, assembled the way a trainer uses them: a config with Megatron's
# flag names, the datasets built where Megatron builds them, data loaders that resume from
# `consumed_samples`, and `get_batch` at every step. You will run it end to end on the Python
# standard library's own source code.

# %%
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from tinytron._fields import check_choice, check_fields, check_range, document_fields
from tinytron.data.blended import BlendedMegatronDatasetBuilder, parse_data_path
from tinytron.data.gpt_dataset import GPTDataset, GPTDatasetConfig, parse_and_normalize_split
from tinytron.data.samplers import build_pretraining_data_loader, cyclic_iter
from tinytron.overview.batch import PAD_SENTINEL

__all__ = ["DataConfig", "build_train_valid_test_datasets", "build_data_iterators",
           "is_dataset_built_on_rank"]

# %% [markdown]
# ## One config
#
# The fields are Megatron's data flags (`megatron/training/arguments.py`, data group) with their
# defaults; `data_path` takes the `w1 p1 w2 p2` syntax — as a list, or as one string split on
# whitespace the way Megatron's command line splits it (`"0.3 wiki 0.7 code"`) — or the per-split
# paths replace it. Every field is checked on construction, so `num_workers="2"` or a split of
# `"a,b"` fails here, naming the field. The sequence length and batch sizes belong to the model
# and the schedule and are passed in.
#
# ```mermaid
# flowchart LR
#   C["DataConfig"] --> B["BlendedMegatronDatasetBuilder (rank 0 builds the cache)"]
#   B --> D["train / valid / test datasets"]
#   D --> L["DataLoader + sampler from consumed_samples"]
#   L --> I["iterator on TP rank 0"]
#   I --> G["get_batch: TP broadcast, CP slice"]
# ```

# %%
@document_fields
@dataclass
class DataConfig:
    """Megatron's data flags."""

    data_path: Optional[list] = None
    """`--data-path`: prefixes, or `w1 p1 w2 p2 ...` (a list, or one whitespace-separated string)."""
    train_data_path: Optional[list] = None
    """`--train-data-path` (with valid/test, replaces data_path + split)."""
    valid_data_path: Optional[list] = None
    """`--valid-data-path`."""
    test_data_path: Optional[list] = None
    """`--test-data-path`."""
    split: str = "969, 30, 1"
    """`--split`: train, valid, test weights."""
    data_cache_path: Optional[str] = None
    """`--data-cache-path`: where index files are cached."""
    dataloader_type: str = "single"
    """`--dataloader-type`: single (sequential) or cyclic (random)."""
    num_workers: int = 2
    """`--num-workers` of the DataLoader."""
    seed: int = 1234
    """`--seed`: the dataset shuffles."""
    mid_level_dataset_surplus: float = 0.005
    """`--mid-level-dataset-surplus`."""
    reset_position_ids: bool = False
    """`--reset-position-ids`."""
    reset_attention_mask: bool = False
    """`--reset-attention-mask`."""
    eod_mask_loss: bool = False
    """`--eod-mask-loss`."""
    create_attention_mask_in_dataloader: bool = True
    """False = `--no-create-attention-mask-in-dataloader`."""
    mmap_bin_files: bool = True
    """False = `--no-mmap-bin-files`."""
    extra: dict = field(default_factory=dict)
    """Room for site-specific flags (ignored here)."""

    def __post_init__(self):
        for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
            setattr(self, name, _path_list(name, getattr(self, name)))
        check_fields(self)
        check_choice(self, "dataloader_type", ("single", "cyclic"))
        check_range(self, "num_workers", 0)
        check_range(self, "mid_level_dataset_surplus", 0)
        parse_and_normalize_split(self.split)  # "a,b" fails now, not when datasets are built

    def blend(self):
        """(blend, blend_per_split) for GPTDatasetConfig."""
        per_split = [self.train_data_path, self.valid_data_path, self.test_data_path]
        if any(p for p in per_split):
            if self.data_path:
                raise ValueError("give data_path or train/valid/test_data_path, not both")
            return None, [parse_data_path(p) if p else None for p in per_split]
        if not self.data_path:
            raise ValueError("DataConfig needs data_path (or train/valid/test_data_path)")
        return parse_data_path(self.data_path), None

def _path_list(name: str, value) -> Optional[list]:
    """None, or the list of words of a path argument (a string is split on whitespace)."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value).split()
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike, int, float))
                                                and not isinstance(v, bool) for v in value):
        return [v if isinstance(v, (int, float)) else os.fspath(v) for v in value]
    raise ValueError(f"DataConfig.{name} must be a string or a list of prefixes (and weights), "
                     f"got {value!r}")

# %% [markdown]
# ## Building where Megatron builds
#
# Datasets exist only on the ranks that read data: tensor-parallel rank 0 of the first and the
# last pipeline stage (`is_dataset_built_on_rank`, `pretrain_gpt.py:254`). Global rank 0 builds
# the index caches first; the others meet it at a barrier and memory-map them.

# %%
def is_dataset_built_on_rank(grid) -> bool:
    """TP rank 0 of the first or last pipeline stage."""
    return grid.rank("tp") == 0 and (grid.is_first_stage() or grid.is_last_stage())


def build_train_valid_test_datasets(cfg: DataConfig, seq_length: int,
                                    num_samples: Sequence[Optional[int]],
                                    is_built_on_rank: Callable[[], bool], eod_id: int,
                                    pad_id: int = PAD_SENTINEL) -> list:
    """[train, valid, test] GPT datasets (None where empty or not built on this rank).

    Example (one process; under torch.distributed pass `is_dataset_built_on_rank(grid)`)::

        cfg = DataConfig(data_path="0.3 data/wiki_text_document 0.7 data/code_text_document",
                         split="90,5,5")
        train, valid, test = build_train_valid_test_datasets(
            cfg, seq_length=128, num_samples=[1000, 50, 50], is_built_on_rank=lambda: True,
            eod_id=tokenizer.eod)
    """
    blend, per_split = cfg.blend()
    gcfg = GPTDatasetConfig(
        sequence_length=seq_length, random_seed=cfg.seed, blend=blend, blend_per_split=per_split,
        split=cfg.split, path_to_cache=cfg.data_cache_path, mmap_bin_files=cfg.mmap_bin_files,
        mid_level_dataset_surplus=cfg.mid_level_dataset_surplus, eod_id=eod_id, pad_id=pad_id,
        reset_position_ids=cfg.reset_position_ids, reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=cfg.create_attention_mask_in_dataloader)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), is_built_on_rank, gcfg).build()


def build_data_iterators(cfg: DataConfig, datasets: Sequence, consumed_samples: Sequence[int],
                         micro_batch_size: int, grid) -> list:
    """Iterators over each dataset for this DP rank, resumed at its consumed_samples.

    Example::

        train_it, valid_it, test_it = build_data_iterators(cfg, [train, valid, test], [0, 0, 0],
                                                           micro_batch_size=4, grid=grid)
        batch = get_batch(train_it, grid, micro_batch_size=4, seq_length=128)
    """
    out = []
    for ds, consumed in zip(datasets, consumed_samples):
        loader = build_pretraining_data_loader(
            ds, consumed, micro_batch_size, max(grid.rank("dp"), 0), grid.size("dp"),
            cfg.dataloader_type, cfg.num_workers)
        if loader is None:
            out.append(None)
        else:
            out.append(cyclic_iter(loader) if cfg.dataloader_type == "cyclic" else iter(loader))
    return out

# %% [markdown]
# ## Demo: the standard library, end to end on one process

# %%
if __name__ == "__main__":
    import os
    import tempfile

    import torch

    from tinytron.data.distribute import get_batch
    from tinytron.data.preprocess import run as preprocess, stdlib_corpus
    from tinytron.overview.batch import ByteTokenizer
    from tinytron.parallel.grid import ParallelGrid

    tmp = tempfile.mkdtemp()
    files = stdlib_corpus(30)
    a = preprocess(["--input", *files[:15], "--output-prefix", f"{tmp}/a", "--workers", "1",
                         "--no-progress"])
    b = preprocess(["--input", *files[15:], "--output-prefix", f"{tmp}/b", "--workers", "1",
                         "--no-progress"])
    cfg = DataConfig(data_path=["0.7", a, "0.3", b], split="90,10,0", num_workers=0,
                     data_cache_path=os.path.join(tmp, "cache"))
    grid = ParallelGrid.single()
    tok = ByteTokenizer()
    train, valid, test = build_train_valid_test_datasets(
        cfg, seq_length=64, num_samples=[40, 8, None],
        is_built_on_rank=lambda: is_dataset_built_on_rank(grid), eod_id=tok.eod, pad_id=tok.pad)
    train_it, valid_it, _ = build_data_iterators(cfg, [train, valid, test], [8, 0, 0], 4, grid)
    batch = get_batch(train_it, grid, micro_batch_size=4, seq_length=64)
    print({k: tuple(v.shape) for k, v in batch.items() if v is not None})
    print("row 0:", repr(tok.decode(batch["tokens"][0])[:60]))
    assert torch.equal(batch["tokens"][0], train[8]["tokens"])  # resumed at consumed_samples = 8
    assert batch["attention_mask"].shape == (4, 1, 64, 64) and test is None

# %% [markdown]
# ## Summary
#
# * `DataConfig` speaks Megatron's flags; one call builds all splits where Megatron would.
# * Loaders start at `consumed_samples`, so a resumed run sees exactly the batches it would
#   have seen.
#
# ## How production does it
#
# * Megatron: `pretrain_gpt.py:332` (`train_valid_test_datasets_provider`),
#   `megatron/training/training.py:4157-4300` (building loaders and iterators).
#
# ## Exercises
#
# 1. Switch `dataloader_type` to `cyclic` and resume at `consumed_samples = 12`: which rows?
# 2. Point `data_path` at your own JSONL after `tinytron-preprocess --input my.jsonl ...`.

"""Chapter 04 · DataConfig -> datasets -> iterators -> get_batch on one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinytron.data import (DataConfig, build_data_iterators, build_train_valid_test_datasets,
                           get_batch, is_dataset_built_on_rank)
from tinytron.data.indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path
from tinytron.parallel.grid import ParallelGrid


def _make(prefix, seed):
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for _ in range(60):
        b.add_item(rng.integers(1, 300, rng.integers(4, 50)))
        b.end_document()
    b.finalize(get_idx_path(prefix))
    return prefix


@pytest.mark.parametrize("loader", ["single", "cyclic"])
def test_pipeline_resumes_where_it_stopped(tmp_path, loader):
    a, b = _make(str(tmp_path / "a"), 0), _make(str(tmp_path / "b"), 1)
    cfg = DataConfig(data_path=["0.6", a, "0.4", b], split="80,20,0", num_workers=0,
                     data_cache_path=str(tmp_path / "cache"), dataloader_type=loader)
    grid = ParallelGrid.single()
    datasets = build_train_valid_test_datasets(cfg, 16, [64, 8, None],
                                               lambda: is_dataset_built_on_rank(grid), eod_id=0)
    assert datasets[2] is None and len(datasets[0]) >= 64
    full_it = build_data_iterators(cfg, datasets, [0, 0, 0], 4, grid)[0]
    full = [get_batch(full_it, grid, micro_batch_size=4, seq_length=16)["tokens"] for _ in range(6)]
    resumed_it = build_data_iterators(cfg, datasets, [12, 0, 0], 4, grid)[0]
    resumed = [get_batch(resumed_it, grid, micro_batch_size=4, seq_length=16)["tokens"] for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(full[3:], resumed))


def test_data_config_errors(tmp_path):
    with pytest.raises(ValueError, match="needs data_path"):
        DataConfig().blend()
    with pytest.raises(ValueError, match="not both"):
        DataConfig(data_path=["a"], train_data_path=["b"]).blend()
    blend, per_split = DataConfig(train_data_path=["0.5", "a", "0.5", "b"], valid_data_path=["c"]).blend()
    assert blend is None and per_split == [(["a", "b"], [0.5, 0.5]), (["c"], None), None]


def test_loader_workers_give_the_same_batches(tmp_path):
    """DataConfig's default of 2 loader worker processes reads exactly what one process reads."""
    a = _make(str(tmp_path / "a"), 0)
    grid = ParallelGrid.single()
    outs = []
    for workers in (0, 2):
        cfg = DataConfig(data_path=[a], split="100,0,0", num_workers=workers,
                         data_cache_path=str(tmp_path / "cache"))
        datasets = build_train_valid_test_datasets(cfg, 16, [32, None, None], lambda: True, eod_id=0)
        it = build_data_iterators(cfg, datasets, [4, 0, 0], 4, grid)[0]
        outs.append([next(it)["tokens"] for _ in range(3)])
    assert all(torch.equal(x, y) for x, y in zip(*outs))

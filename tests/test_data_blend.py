"""Chapter 04 · blending: Megatron's greedy rule, prefix ratios, sizes, builder, --data-path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tinytron.data._reference import (reference_blending_indices,
                                      reference_exhaustive_blending_indices)
from tinytron.data.blended import (BlendedDataset, BlendedMegatronDatasetBuilder,
                                   build_blending_indices, build_exhaustive_blending_indices,
                                   get_size_per_split_per_dataset, normalize, parse_data_path)
from tinytron.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from tinytron.data.indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path

WEIGHTS = [[0.3, 0.7], [0.001, 0.999], [0.5, 0.5], [0.2, 0.3, 0.5], [0.1] * 10,
           [1 / 3, 1 / 3, 1 / 3], [0.05, 0.9, 0.05]]


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_blending_equals_the_reference_loop_and_tracks_weights(weights):
    w = normalize(weights)
    size = 3000
    di, dsi = build_blending_indices(w, size)
    ref_di, ref_dsi = reference_blending_indices(w, size)
    assert np.array_equal(di, ref_di) and np.array_equal(dsi, ref_dsi)
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[di], axis=0)  # count_i after k+1 picks
    err = counts - np.outer(np.arange(1, size + 1), w)
    # Never more than one sample ahead of its weight; at most N-1 behind (the errors sum to 0
    # and none drops below -1). For two datasets that is within one sample both ways.
    assert err.max() < 1.0 and err.min() > -(len(w) - 1)
    if len(w) == 2:
        assert np.abs(err).max() < 1.0
    for i in range(len(w)):  # dataset_sample_index counts each dataset's own samples
        assert dsi[di == i].tolist() == list(range(int((di == i).sum())))


def test_megatron_rule_can_lag_more_than_one_sample_with_many_datasets():
    """A documented property of Megatron's rule (kept for sample-for-sample compatibility)."""
    w = normalize([0.171, 0.003, 0.817, 0.003, 0.003, 0.003])
    di, _ = build_blending_indices(w, 2000)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[di], axis=0)
    err = counts - np.outer(np.arange(1, 2001), w)
    assert -(len(w) - 1) < err.min() < -1.0


def test_exhaustive_blend_uses_every_sample_once():
    sizes = [7, 1, 13, 4]
    di, dsi = build_exhaustive_blending_indices(sizes)
    ref = reference_exhaustive_blending_indices(sizes)
    assert np.array_equal(di, ref[0]) and np.array_equal(dsi, ref[1])
    for i, n in enumerate(sizes):
        assert sorted(dsi[di == i].tolist()) == list(range(n))


def test_sizes_per_split_with_surplus():
    w = normalize([0.3, 0.7])
    assert get_size_per_split_per_dataset(w, [1000, 10, None]) == [[300, 3, None], [700, 7, None]]
    assert get_size_per_split_per_dataset(w, [1000, 10, None], 0.005) == [[302, 4, None], [704, 8, None]]


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    for bad in (["0.3", "a", "0.7"], ["0.3", "a", "b", "0.7"], ["a", "0.3"], []):
        with pytest.raises(ValueError, match="data-path"):
            parse_data_path(bad)


def _make(prefix, n_docs, seed, lo=5, hi=60):
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for _ in range(n_docs):
        b.add_item(rng.integers(1, 1000, rng.integers(lo, hi)))
        b.end_document()
    b.finalize(get_idx_path(prefix))
    return prefix


def test_builder_extreme_weights_and_per_dataset_sizes(tmp_path):
    # the small component's train split holds ~80 tokens; 0.001 of 5000 samples of 16 tokens
    # needs more than one epoch of it (the case of Megatron-LM issue #705)
    big, small = _make(str(tmp_path / "big"), 300, 0), _make(str(tmp_path / "small"), 12, 1, 5, 12)
    prefixes, weights = parse_data_path(["0.999", big, "0.001", small])
    cfg = GPTDatasetConfig(sequence_length=16, blend=(prefixes, weights), split="90,10,0",
                           path_to_cache=str(tmp_path / "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [5000, 200, None],
                                                       lambda: True, cfg).build()
    assert test is None
    assert len(train) == math.ceil(5000 * 0.999) + math.ceil(5000 * 0.001)
    assert [d.num_samples for d in train.datasets] == [math.ceil(math.ceil(5000 * 0.999) * 1.005),
                                                      math.ceil(math.ceil(5000 * 0.001) * 1.005)]
    assert np.bincount(train.dataset_index).tolist() == [4995, 5]
    tiny = train.datasets[1]
    assert len(tiny.document_index) > len(tiny.indices)  # more than one epoch of the small one
    s = train[17]
    assert s["dataset_id"] in (0, 1) and s["tokens"].shape == (16,)
    assert len(valid) == math.ceil(200 * 0.999) + math.ceil(200 * 0.001)
    # the same build again hits every cache (GPT and blend)
    again = BlendedMegatronDatasetBuilder(GPTDataset, [5000, 200, None], lambda: True, cfg).build()
    assert all(d.cache_hit for d in again[0].datasets)
    assert np.array_equal(again[0].dataset_index, train.dataset_index)


def test_unweighted_blend_and_single_prefix(tmp_path):
    a, b = _make(str(tmp_path / "a"), 40, 2), _make(str(tmp_path / "b"), 80, 3)
    cfg = GPTDatasetConfig(sequence_length=8, blend=([a, b], None), split="100,0,0",
                           path_to_cache=str(tmp_path / "c"))
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, cfg).build()
    assert valid is None
    assert len(train) == sum(len(d) for d in train.datasets)  # exhaustive: every sample once
    one = GPTDatasetConfig(sequence_length=8, blend=([a], None), split="100,0,0",
                           path_to_cache=str(tmp_path / "c"))
    only, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [50, None, None], lambda: True, one).build()
    assert isinstance(only, GPTDataset) and len(only) >= 50


def test_blend_per_split(tmp_path):
    a, b = _make(str(tmp_path / "a"), 40, 2), _make(str(tmp_path / "b"), 40, 3)
    cfg = GPTDatasetConfig(sequence_length=8, blend_per_split=[([a, b], [1, 1]), ([b], None), None],
                           path_to_cache=str(tmp_path / "c"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [100, 20, None], lambda: True, cfg).build()
    assert isinstance(train, BlendedDataset) and len(train) == 100 and test is None
    assert valid.dataset_path == b and len(valid) >= 20
    # a single *weighted* prefix per split is a plain dataset too, its weight ignored, as in
    # Megatron (blended_megatron_dataset_builder.py:251-255): same samples as the unweighted one
    weighted = GPTDatasetConfig(sequence_length=8, path_to_cache=str(tmp_path / "c"),
                                blend_per_split=[([a, b], [1, 1]), ([b], [0.3]), None])
    _, valid_w, _ = BlendedMegatronDatasetBuilder(GPTDataset, [100, 20, None], lambda: True,
                                                  weighted).build()
    assert isinstance(valid_w, GPTDataset) and len(valid_w) == len(valid)
    assert all(torch.equal(valid_w[i]["tokens"], valid[i]["tokens"]) for i in range(len(valid)))


def test_empty_split_with_requested_samples_names_dataset_and_split(tmp_path):
    tiny = _make(str(tmp_path / "tiny"), 20, 4)
    big = _make(str(tmp_path / "big"), 300, 5)
    cfg = GPTDatasetConfig(sequence_length=8, blend=([big, tiny], [0.5, 0.5]), split="99,1,0",
                           path_to_cache=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"tiny.*split 'valid' holds no sequences"):
        BlendedMegatronDatasetBuilder(GPTDataset, [100, 10, None], lambda: True, cfg).build()


def test_oversampling_a_component_raises(tmp_path):
    a, b = _make(str(tmp_path / "a"), 40, 2), _make(str(tmp_path / "b"), 40, 3)
    cfg = GPTDatasetConfig(sequence_length=8, blend=([a, b], None), split="100,0,0")
    ds = [BlendedMegatronDatasetBuilder(GPTDataset, [None] * 3, lambda: True,
                                        GPTDatasetConfig(sequence_length=8, blend=([p], None),
                                                         split="100,0,0")).build()[0] for p in (a, b)]
    with pytest.raises(ValueError, match="asks dataset 0 .* raise mid_level_dataset_surplus"):
        BlendedDataset(ds, [0.9, 0.1], 10 * len(ds[0]), cfg)

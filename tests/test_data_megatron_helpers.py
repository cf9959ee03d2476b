"""Chapter 04: the numpy index builders against Megatron's own compiled helpers.cpp.

By default the oracle is the `helpers_cpp` extension that the megatron-core 0.16.1 wheel ships
(a test dependency). TINYTRON_MEGATRON_HELPERS may instead name a folder holding a `helpers_cpp`
built from megatron/core/datasets/helpers.cpp at e03878b5f, e.g.
    g++ -O3 -shared -std=c++17 -fPIC $(python -m pybind11 --includes) helpers.cpp \
        -o helpers_cpp$(python3-config --extension-suffix)
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest

from tinytron.data.blended import build_blending_indices, build_exhaustive_blending_indices
from tinytron.data.gpt_indices import build_document_index, build_sample_index, get_num_epochs

HELPERS_DIR = os.environ.get("TINYTRON_MEGATRON_HELPERS")


@pytest.fixture(scope="module")
def helpers():
    if not HELPERS_DIR:  # the compiled helpers of the installed megatron-core wheel
        return pytest.importorskip("megatron.core.datasets.helpers_cpp",
                                   reason="megatron-core (a test dependency) is not installed")
    sys.path.insert(0, HELPERS_DIR)
    try:
        return importlib.import_module("helpers_cpp")
    finally:
        sys.path.remove(HELPERS_DIR)


def test_sample_index_is_identical_to_helpers_cpp(helpers):
    rng = np.random.default_rng(0)
    for trial in range(200):
        sizes = rng.integers(0 if trial % 3 == 0 else 1, rng.integers(2, 3000),
                             rng.integers(2, 300)).astype(np.int32)
        sizes[0] += 2
        total, seq = int(sizes.sum()), int(rng.integers(2, 2048))
        extra, drop = int(trial % 4 != 1), trial % 5 != 2
        epochs = get_num_epochs(total, int(rng.integers(1, 4 * total // seq + 2)), seq, extra)
        di = build_document_index(np.arange(len(sizes), dtype=np.int32), epochs,
                                  np.random.RandomState(trial), False)
        ref = helpers.build_sample_idx_int32(sizes, di, seq, epochs, total, drop, extra)
        assert np.array_equal(ref, build_sample_index(sizes, di, seq, epochs, total, drop, extra))


@pytest.mark.parametrize("sizes,seq", [
    ([17], 4),                                  # one sequence, many epochs
    ([6, 3, 9, 3], 3),                          # every boundary exactly on a sequence end
    ([1, 2, 1, 1, 2, 1, 1], 5),                 # several sequences end before one boundary
    ([2, 0, 0, 5, 0, 0, 0, 4, 0, 3, 0], 2),     # empty sequences, the last one too
    ([50, 1, 1, 1, 1, 1, 1], 7),
])
def test_sample_index_corners_are_identical_to_helpers_cpp(helpers, sizes, seq):
    sizes = np.array(sizes, dtype=np.int32)
    total = int(sizes.sum())
    for epochs in (1, 2, 7):
        for extra in (0, 1):
            for drop in (True, False):
                di = build_document_index(np.arange(len(sizes), dtype=np.int32), epochs,
                                          np.random.RandomState(epochs), False)
                ref = helpers.build_sample_idx_int32(sizes, di, seq, epochs, total, drop, extra)
                ours = build_sample_index(sizes, di, seq, epochs, total, drop, extra)
                assert ours.dtype == ref.dtype and np.array_equal(ref, ours), (epochs, extra, drop)


def test_sample_index_at_half_a_million_samples(helpers):
    """One corpus of the benchmark's shape, smaller: 50k sequences of 1..4095 tokens, 5 epochs."""
    sizes = np.random.default_rng(5).integers(1, 4096, 50_000).astype(np.int32)
    total, seq = int(sizes.sum()), 1024
    di = build_document_index(np.arange(len(sizes), dtype=np.int32), 5,
                              np.random.RandomState(1234), False)
    ref = helpers.build_sample_idx_int32(sizes, di, seq, 5, total, True, 1)
    assert len(ref) > 450_000 and np.array_equal(ref, build_sample_index(sizes, di, seq, 5, total))


def test_blending_is_identical_to_helpers_cpp(helpers):
    rng = np.random.default_rng(1)
    for _ in range(100):
        n, size = int(rng.integers(1, 10)), int(rng.integers(1, 3000))
        w = rng.random(n) ** 3 + 1e-4
        w /= w.sum()
        di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(di, dsi, w, n, size, False)
        ours = build_blending_indices(w.tolist(), size)
        assert np.array_equal(ours[0], di) and np.array_equal(ours[1], dsi)
        sizes = rng.integers(1, 200, n).astype(np.int64)
        di, dsi = np.zeros(int(sizes.sum()), np.int16), np.zeros(int(sizes.sum()), np.int64)
        helpers.build_exhaustive_blending_indices(di, dsi, sizes, n)
        ours = build_exhaustive_blending_indices(sizes.tolist())
        assert np.array_equal(ours[0], di) and np.array_equal(ours[1], dsi)

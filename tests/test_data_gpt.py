"""Chapter 04 · GPTDataset: index tables equal Megatron's algorithm, samples, epochs, cache."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from tinytron.data._reference import reference_sample_idx, reference_sample_tokens
from tinytron.data.gpt_dataset import (GPTDataset, GPTDatasetConfig, Split,
                                       convert_split_vector_to_split_matrix,
                                       parse_and_normalize_split, split_indices)
from tinytron.data.gpt_indices import (build_document_index, build_document_sample_shuffle_indices,
                                       build_sample_index, build_sample_index_loop, get_num_epochs,
                                       needs_separate_final_epoch, shuffle_index_dtype)
from tinytron.data.indexed import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path


def megatron_tables(sizes, documents, num_samples, seq, seed, extra=1, drop_last=True):
    """Straight transcription of gpt_dataset.py:453-542 (mgrid tiling, loops), with the loop sample index."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, num_tokens = 1, tokens_per_epoch
    if num_samples is not None:
        while num_tokens < num_samples * seq + extra:
            num_epochs += 1
            num_tokens += tokens_per_epoch
    separate = False
    if num_epochs > 1:
        before = ((num_epochs - 1) * tokens_per_epoch - extra) // seq
        last = num_samples - before
        per_epoch = (tokens_per_epoch - extra) // seq
        separate = last < int(0.80 * per_epoch)
    rs = np.random.RandomState(seed)

    def doc_index(epochs, sep):
        if not sep or epochs == 1:
            di = np.mgrid[0:epochs, 0:len(documents)][1]
            di[:] = documents
            di = di.reshape(-1).astype(np.int32)
            rs.shuffle(di)
            return di
        return np.concatenate((doc_index(epochs - 1, False), doc_index(1, False)))

    di = doc_index(num_epochs, separate)
    si = reference_sample_idx(sizes, di, seq, num_epochs, tokens_per_epoch, drop_last, extra)
    n = si.shape[0] - 1
    first = np.arange(before if separate else n, dtype=np.uint32)
    rs.shuffle(first)
    if separate:
        rest = np.arange(before, n, dtype=np.uint32)
        rs.shuffle(rest)
        first = np.concatenate((first, rest))
    return di, si, first


@pytest.mark.parametrize("trial", range(12))
def test_tables_equal_megatron_algorithm(trial):
    rng = np.random.default_rng(trial)
    sizes = rng.integers(0 if trial % 3 == 0 else 1, 40, rng.integers(3, 60)).astype(np.int32)
    sizes[0] = max(sizes[0], 2)
    docs = np.arange(rng.integers(0, 2), len(sizes), dtype=np.int32)
    seq = int(rng.integers(2, 30))
    tokens = int(sizes[docs].sum())
    num_samples = None if trial == 0 else int(rng.integers(1, 3 * tokens // seq + 2))
    extra = 0 if trial % 4 == 1 else 1
    drop = trial % 5 != 2
    ours = build_document_sample_shuffle_indices(sizes, docs, num_samples, seq, 1234 + trial, extra, drop)
    ref = megatron_tables(sizes, docs, num_samples, seq, 1234 + trial, extra, drop)
    for a, b, name in zip(ours, ref, ("document", "sample", "shuffle")):
        assert np.array_equal(a, b), f"{name} index differs (trial {trial})"
    assert ours[0].dtype == np.int32 and ours[1].dtype == np.int32 and ours[2].dtype == np.uint32


def test_sample_index_int64_when_large():
    sizes = np.array([5, 7], dtype=np.int32)
    di = np.array([0, 1], dtype=np.int32)
    assert build_sample_index(sizes, di, 3, 1, 12).dtype == np.int32
    assert shuffle_index_dtype(2**32 - 3) == np.uint32 and shuffle_index_dtype(2**32 - 2) == np.int64


def _edge_corpora():
    """(name, sizes, seq): the corners of the sample-index walk."""
    yield "one sequence", [17], 4
    yield "ends exactly at sequence ends", [6, 3, 9, 3], 3  # every boundary on a document end
    yield "shorter than a sample", [1, 2, 1, 1, 2, 1, 1], 5  # several documents per boundary
    yield "empty sequences", [0, 0, 5, 0, 0, 0, 4, 0, 3, 0], 2
    yield "empty first and last", [0, 7, 2, 0], 3
    yield "one long, many short", [50, 1, 1, 1, 1, 1, 1], 7


@pytest.mark.parametrize("case", list(_edge_corpora()), ids=lambda c: c[0])
def test_sample_index_equals_the_loop_at_the_corners(case):
    _, sizes, seq = case
    sizes = np.array(sizes, dtype=np.int32)
    total = int(sizes.sum())
    for epochs in (1, 2, 5):
        for extra in (0, 1):
            for drop in (True, False):
                di = build_document_index(np.arange(len(sizes), dtype=np.int32), epochs,
                                          np.random.RandomState(epochs), False)
                fast = build_sample_index(sizes, di, seq, epochs, total, drop, extra)
                loop = build_sample_index_loop(sizes, di, seq, epochs, total, drop, extra)
                ref = reference_sample_idx(sizes, di, seq, epochs, total, drop, extra)
                where = f"epochs={epochs} extra={extra} drop={drop}"
                assert fast.dtype == np.int32 and fast.shape == loop.shape, where
                assert np.array_equal(fast, loop) and np.array_equal(loop, ref), where


def test_sample_index_equals_the_loop_on_random_corpora():
    rng = np.random.default_rng(7)
    for trial in range(300):
        sizes = rng.integers(0 if trial % 2 else 1, rng.integers(2, 200),
                             rng.integers(1, 40)).astype(np.int32)
        sizes[0] += 2
        total, seq = int(sizes.sum()), int(rng.integers(2, 50))
        extra, drop = trial % 3 != 0, trial % 4 != 1
        epochs = get_num_epochs(total, int(rng.integers(1, 3 * total // seq + 2)), seq, int(extra))
        di = build_document_index(np.arange(len(sizes), dtype=np.int32), epochs,
                                  np.random.RandomState(trial), False)
        args = (sizes, di, seq, epochs, total, drop, int(extra))
        assert np.array_equal(build_sample_index(*args), build_sample_index_loop(*args)), trial


def test_sample_index_int64_path_equals_the_loop():
    """Sequences longer than int32 take the two separate int64 sums instead of the packed one."""
    sizes = np.array([2**31 + 5, 7, 0, 2**30 + 3], dtype=np.int64)
    di = np.array([0, 1, 2, 3, 1, 0], dtype=np.int32)
    total = int(sizes[di].sum())
    for extra in (0, 1):
        for drop in (True, False):
            fast = build_sample_index(sizes, di, 2**29 + 7, 1, total, drop, extra)
            loop = build_sample_index_loop(sizes, di, 2**29 + 7, 1, total, drop, extra)
            assert fast.dtype == np.int64 and np.array_equal(fast, loop), (extra, drop)
    assert fast[-1].tolist() == [5, 2**31 + 5 - 1]  # the kept partial sample's last row


def test_epochs_and_the_80_percent_rule():
    assert get_num_epochs(100, 12, 10) == 2 and get_num_epochs(100, 9, 10) == 1
    assert get_num_epochs(100, None, 10) == 1 and get_num_epochs(100, 10, 10) == 2  # 101 > 100
    # T=100, L=10: 9 samples per epoch. S=12 -> 3 from the last epoch < int(0.8*9)=7: separate.
    assert needs_separate_final_epoch(2, 100, 12, 10) == (True, 9)
    # S=17 -> 8 from the last epoch >= 7: shuffled together.
    assert needs_separate_final_epoch(2, 100, 17, 10)[0] is False
    assert needs_separate_final_epoch(2, 100, 16, 10)[0] is False  # 7 == threshold: not below
    assert needs_separate_final_epoch(2, 100, 15, 10)[0] is True
    with pytest.raises(ValueError, match="split is empty"):
        get_num_epochs(0, 5, 10, what="dataset 'x' split 'valid'")


def test_split_matrix():
    assert parse_and_normalize_split("99,1,0") == pytest.approx([0.99, 0.01, 0.0])
    m = convert_split_vector_to_split_matrix(parse_and_normalize_split("98,2"))
    assert m[0] == pytest.approx((0, 0.98)) and m[1] == pytest.approx((0.98, 1.0)) and m[2] is None
    assert split_indices(m[1], 100).tolist() == [98, 99]
    with pytest.raises(ValueError, match="split"):
        parse_and_normalize_split("a,b")


@pytest.fixture()
def corpus(tmp_path):
    rng = np.random.default_rng(3)
    p = str(tmp_path / "corpus")
    b = IndexedDatasetBuilder(get_bin_path(p), dtype=np.uint16)
    for d in range(60):
        b.add_item(np.concatenate([rng.integers(1, 500, rng.integers(1, 30)), [0]]))  # EOD = 0
        b.end_document()
    b.finalize(get_idx_path(p))
    return p


def _dataset(prefix, cache, num_samples=200, seq=16, split=Split.train, **kw):
    cfg = GPTDatasetConfig(sequence_length=seq, split="100,0,0", path_to_cache=cache, eod_id=0, **kw)
    ix = IndexedDataset(prefix)
    return GPTDataset(ix, prefix, np.arange(len(ix), dtype=np.int32), num_samples, split, cfg), ix


def test_samples_overlap_by_one_and_cover_the_stream(corpus, tmp_path):
    ds, ix = _dataset(corpus, str(tmp_path / "c"), num_samples=None)
    seq = 16
    T = int(ix.sequence_lengths.sum())
    assert len(ds) == (T - 1) // seq
    inverse = np.argsort(np.asarray(ds.shuffle_index))
    windows = [ds.query_tokens(int(inverse[j])) for j in range(len(ds))]  # in stream order
    assert all(len(w) == seq + 1 for w in windows)
    assert all(windows[j][-1] == windows[j + 1][0] for j in range(len(windows) - 1))
    stream = np.concatenate([ix[int(s)] for s in ds.document_index]).astype(np.int64)
    covered = np.concatenate([windows[0]] + [w[1:] for w in windows[1:]])
    assert np.array_equal(covered, stream[:len(covered)]) and len(stream) - len(covered) < seq
    for i in range(len(ds)):
        assert np.array_equal(ds.query_tokens(i), reference_sample_tokens(
            ix, ds.document_index, ds.sample_index, ds.shuffle_index, i, seq))


def test_getitem_follows_chapter_00_rules(corpus, tmp_path):
    ds, _ = _dataset(corpus, str(tmp_path / "c"), eod_mask_loss=True, reset_position_ids=True)
    s = ds[3]
    text = torch.from_numpy(ds.query_tokens(3))
    assert torch.equal(s["tokens"], text[:-1]) and torch.equal(s["labels"], text[1:])
    assert s["attention_mask"].dtype == torch.bool and s["attention_mask"].shape == (1, 16, 16)
    assert s["attention_mask"][0, 0, 1] and not s["attention_mask"][0, 1, 0]  # True = masked
    eod = s["tokens"] == 0
    assert (s["loss_mask"][eod] == 0).all() and (s["loss_mask"][~eod] == 1).all()
    assert ds[None]["loss_mask"].sum() == 0
    plain, _ = _dataset(corpus, str(tmp_path / "c2"), create_attention_mask=False)
    a, b = plain[1], plain[2]
    assert "attention_mask" not in a and torch.equal(a["position_ids"], torch.arange(16))
    a["loss_mask"][0] = 5.0  # the cached mask must not leak between samples
    assert b["loss_mask"][0] == 1.0 and plain[3]["loss_mask"][0] == 1.0


def test_partial_validation_sample_is_padded(corpus, tmp_path):
    ds, ix = _dataset(corpus, str(tmp_path / "c"), num_samples=None, split=Split.valid,
                      drop_last_partial_validation_sequence=False, pad_id=-1)
    T = int(ix.sequence_lengths.sum())
    assert len(ds) == math.ceil((T - 1) / 16)
    last = int(np.flatnonzero(np.asarray(ds.shuffle_index) == len(ds) - 1)[0])
    sample = ds[last]
    n_real = (T - 1) - 16 * (len(ds) - 1) + 1
    assert (sample["loss_mask"][n_real - 1:] == 0).all() and (sample["labels"][n_real - 1:] == 0).all()


def test_deterministic_and_cache_hit(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    a, _ = _dataset(corpus, cache)
    b, _ = _dataset(corpus, cache)
    assert not a.cache_hit and b.cache_hit
    for x, y in zip((a.document_index, a.sample_index, a.shuffle_index),
                    (b.document_index, b.sample_index, b.shuffle_index)):
        assert np.array_equal(x, y) and x.dtype == y.dtype
    assert len(os.listdir(cache)) == 4
    c, _ = _dataset(corpus, cache, num_samples=201)  # another request, another key
    assert not c.cache_hit
    default, _ = _dataset(corpus, None)  # Megatron's default location: <prefix>/cache/...
    assert os.path.isdir(os.path.join(corpus, "cache", "GPTDataset_indices"))


def test_cache_invalidated_when_data_changes(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    a, _ = _dataset(corpus, cache)
    b = IndexedDatasetBuilder(get_bin_path(corpus), dtype=np.uint16)  # rewrite the same prefix
    for n in range(60):
        b.add_item(np.arange(1, 3 + n % 7))
        b.end_document()
    b.finalize(get_idx_path(corpus))
    c, ix = _dataset(corpus, cache)
    assert not c.cache_hit
    assert len(c) != len(a) and len(os.listdir(cache)) == 8
    os.utime(get_bin_path(corpus), (0, 0))  # a touched or copied file keeps its cache
    assert _dataset(corpus, cache)[0].cache_hit
    for i in range(len(c)):
        assert np.array_equal(c.query_tokens(i), reference_sample_tokens(
            ix, c.document_index, c.sample_index, c.shuffle_index, i, 16))


def test_empty_split_asked_for_samples_names_dataset_and_split(tmp_path):
    p = str(tmp_path / "tiny")
    b = IndexedDatasetBuilder(get_bin_path(p), dtype=np.uint16)
    b.add_item([1, 2, 3])
    b.end_document()
    b.finalize(get_idx_path(p))
    cfg = GPTDatasetConfig(sequence_length=4, split="100,0,0", path_to_cache=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"tiny.*'valid'.*empty"):
        GPTDataset(IndexedDataset(p), p, np.zeros(0, dtype=np.int32), 10, Split.valid, cfg)


def test_pickles_without_copying_the_token_file(corpus, tmp_path):
    """Spawned DataLoader workers receive the dataset pickled: it must re-open, not copy, the .bin."""
    import pickle

    ds, ix = _dataset(corpus, str(tmp_path / "c"))
    blob = pickle.dumps(ds)
    assert len(pickle.dumps(ix)) < 200 and len(blob) < ix.token_array.nbytes + 40_000
    again = pickle.loads(blob)
    assert all(np.array_equal(again.query_tokens(i), ds.query_tokens(i)) for i in range(len(ds)))

"""Chapter 04 · samplers: DP slicing, exact resume at any consumed_samples, epochs, loader."""

from __future__ import annotations

import itertools

import pytest
import torch

from tinytron.data.samplers import (MegatronPretrainingRandomSampler, MegatronPretrainingSampler,
                                    build_pretraining_data_loader, cyclic_iter)


def _steps(make, dp, consumed, n, cyclic=False):
    """n micro-batches per DP rank starting at consumed_samples."""
    out = []
    for r in range(dp):
        s = make(consumed, r)
        it = cyclic_iter(s) if cyclic else iter(s)
        out.append(list(itertools.islice(it, n)))
    return out


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("mbs", [1, 3])
def test_sequential_sampler_slices_and_resumes(dp, mbs):
    total = 97
    make = lambda c, r: MegatronPretrainingSampler(total, c, mbs, r, dp)  # noqa: E731
    n = total // (mbs * dp)
    full = _steps(make, dp, 0, n)
    for m in range(n):  # rank r, micro-batch m, row j -> m*mbs*dp + r*mbs + j
        assert all(full[r][m] == [m * mbs * dp + r * mbs + j for j in range(mbs)] for r in range(dp))
    for stop in range(n):
        resumed = _steps(make, dp, stop * mbs * dp, n - stop)
        assert all(full[r][stop:] == resumed[r] for r in range(dp))
    start = 5  # a run that itself began at an odd consumed_samples resumes exactly too
    m = (total - start) // (mbs * dp)
    from_odd = _steps(make, dp, start, m)
    for stop in range(m):
        assert all(from_odd[r][stop:] == _steps(make, dp, start + stop * mbs * dp, m - stop)[r]
                   for r in range(dp))
    assert all(len(full[r]) == n for r in range(dp))  # the last partial chunk is dropped
    tail = list(MegatronPretrainingSampler(10, 8, 2, 1, 2, drop_last=False))
    assert tail == [[]]  # Megatron yields rank 1's empty slice of the partial chunk too
    assert list(MegatronPretrainingSampler(10, 8, 2, 0, 2, drop_last=False)) == [[8, 9]]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("sharding", [True, False])
def test_random_sampler_resumes_exactly_across_epochs(dp, sharding):
    total, mbs = 45, 2
    make = lambda c, r: MegatronPretrainingRandomSampler(None, total, c, mbs, r, dp, sharding)  # noqa: E731
    per_epoch = (total - total % (mbs * dp)) // (mbs * dp)
    n = 2 * per_epoch + 3
    full = _steps(make, dp, 0, n, cyclic=True)
    for stop in range(1, n):
        resumed = _steps(make, dp, stop * mbs * dp, n - stop, cyclic=True)
        assert all(full[r][stop:] == resumed[r] for r in range(dp)), stop
    for e in range(2):  # within an epoch the global step batches are disjoint, and epochs differ
        seen = [i for m in range(e * per_epoch, (e + 1) * per_epoch) for r in range(dp) for i in full[r][m]]
        assert len(seen) == len(set(seen)) == per_epoch * mbs * dp
    first = [full[0][m] for m in range(per_epoch)]
    second = [full[0][m] for m in range(per_epoch, 2 * per_epoch)]
    assert first != second


def test_random_sampler_epoch_offset_rules():
    s = MegatronPretrainingRandomSampler(None, 45, 3 * 44 + 8, 2, 0, 2)  # active = 44
    it = iter(s)
    next(it)
    assert s.epoch == 3 and s.consumed_samples == 3 * 44 + 12
    g = torch.Generator()
    g.manual_seed(3)
    bucket = (45 // 4) * 2
    assert next(iter(MegatronPretrainingRandomSampler(None, 45, 3 * 44, 2, 0, 2))) == \
        torch.randperm(bucket, generator=g).tolist()[:2]
    with pytest.raises(ValueError, match="whole number of steps"):
        next(iter(MegatronPretrainingRandomSampler(None, 45, 6, 2, 0, 2)))


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match="no samples left"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="total_samples=0"):
        MegatronPretrainingRandomSampler(None, 0, 0, 1, 0, 1)


def test_loader_collates_micro_batches():
    data = [{"tokens": torch.full((4,), i)} for i in range(20)]
    loader = build_pretraining_data_loader(data, consumed_samples=4, micro_batch_size=2,
                                           data_parallel_rank=1, data_parallel_size=2)
    batches = [b["tokens"][:, 0].tolist() for b in loader]
    assert batches[:2] == [[6, 7], [10, 11]] and len(batches) == 4
    with pytest.raises(ValueError, match="dataloader_type"):
        build_pretraining_data_loader(data, 0, 1, 0, 1, dataloader_type="external")

"""The book's naive variants train exactly like the real mechanisms they introduce.

Chapter 05's per-parameter all-reduce DDP against the bucketed DistributedDataParallel, and
chapter 02's whole-parameter ZeRO-1 against the bucket-range DistributedOptimizer, on two real
gloo ranks (one world for both).
"""

from __future__ import annotations

import pytest

from tinytron.launch import run_on_ranks
from tinytron.optimizer.zero1 import owners_by_size


def both_naive_variants() -> dict:
    """On every rank: the chapter 05 and the chapter 02 comparisons, one after the other."""
    from tinytron.buffers._naive import naive_vs_ddp
    from tinytron.optimizer._naive import naive_zero1_vs_distopt

    return {"ddp": naive_vs_ddp(steps=2, num_micro=3), "zero1": naive_zero1_vs_distopt(steps=5)}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(both_naive_variants, 2, timeout=300)


def test_naive_ddp_gives_the_bucketed_grads(results):
    for r in results:
        d = r["ddp"]
        assert d["max_abs_diff"] < 1e-6, d
        assert d["ranks_agree"], "the naive DDP left the ranks with different grads"


def test_naive_ddp_issues_one_collective_per_parameter(results):
    for r in results:
        d = r["ddp"]
        # the shared weight is used twice per forward and still costs one call
        assert d["naive_collectives"] == d["num_params"]
        assert 1 < d["ddp_collectives"] < d["num_params"]


def test_whole_parameter_zero1_trains_like_the_distributed_optimizer(results):
    zero1 = [r["zero1"] for r in results]
    assert all(z["max_param_diff"] < 1e-6 for z in zero1), zero1
    # each parameter's state lives on exactly one rank, in both
    assert sum(z["naive_owned"] for z in zero1) == zero1[0]["total"]
    assert sum(z["real_owned"] for z in zero1) == zero1[0]["total"]


def test_owners_by_size_packs_largest_first():
    assert owners_by_size([512, 32, 32, 32, 256, 8], 2) == [0, 1, 1, 1, 1, 1]
    owner = owners_by_size([5, 5, 5, 5], 4)
    assert sorted(owner) == [0, 1, 2, 3]
    assert owners_by_size([3, 1], 1) == [0, 0]

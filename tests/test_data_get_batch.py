"""Chapter 04 · get_batch over TP/CP/PP in real gloo worlds, and dataset build on rank 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinytron.data._workers import get_batch_suite
from tinytron.data.distribute import thd_partitioned_indices
from tinytron.data.indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path
from tinytron.launch import run_on_ranks

PRETRAIN_KEYS = {  # (first, last) -> keys present, as pretrain_gpt.py:76 / utils.py:1979
    (True, True): {"tokens", "labels", "loss_mask", "attention_mask", "position_ids"},
    (True, False): {"tokens", "attention_mask", "position_ids"},
    (False, True): {"labels", "loss_mask", "attention_mask"},
    (False, False): set(),
}
DTYPES = {"max_seqlen": "torch.int32", "tokens": "torch.int64", "labels": "torch.int64", "loss_mask": "torch.float32",
          "position_ids": "torch.int64", "attention_mask": "torch.bool", "cu_seqlens": "torch.int32"}


def test_thd_partitioned_indices_worked_example():
    cu = torch.tensor([0, 8, 12])
    assert thd_partitioned_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert thd_partitioned_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match=r"segment \[8, 13\) has 5 tokens"):
        thd_partitioned_indices(torch.tensor([0, 8, 13]), 2, 0)


def _check(result, pp, cp):
    stage = (result["pp"] == 0, result["pp"] == pp - 1)
    pre, sft = result["pretrain"], result["sft"]
    assert {k for k, v in pre["present"].items() if v} == PRETRAIN_KEYS[stage]
    sft_keys = {k for k, v in sft["present"].items() if v}
    assert sft_keys == PRETRAIN_KEYS[stage] | {"cu_seqlens", "max_seqlen"}  # on every stage
    assert sft["max_seqlen"] == 8
    for r in (pre, sft):
        assert r["reads"] == (1 if r["tp"] == 0 and (any(stage) or r is sft) else 0)
        assert r["matches_reference"] and r["tp_agree"]
        assert all(DTYPES[k] == d for k, d in r["dtypes"].items())
    if stage[0]:
        assert pre["shapes"]["tokens"] == (2, 16 // cp)
        assert pre["shapes"]["attention_mask"] == (2, 1, 16 // cp, 16)  # query dim sliced only
    assert sft["shapes"]["cu_seqlens"] == (1, 4)


def test_get_batch_over_tp_cp_pp_and_rank0_build(tmp_path):
    """One 4-rank world: TP2 x CP2 (broadcast, zig-zag, THD) and PP4 (first/middle/last stages)."""
    prefix = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    b = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for _ in range(50):
        b.add_item(rng.integers(1, 500, rng.integers(5, 40)))
        b.end_document()
    b.finalize(get_idx_path(prefix))
    results = run_on_ranks(get_batch_suite, 4, prefix, str(tmp_path / "cache"), timeout=240)
    for r in results:
        _check(r["tp2cp2"], pp=1, cp=2)
        _check(r["pp4"], pp=4, cp=1)
    built = [r["build"] for r in results if r["build"]["built"]]
    # TP rank 0 of each CP slot: 2 ranks; global rank 0 builds, the other one hits the cache
    assert len(built) == 2 and built[0]["rank"] == 0
    assert all(built[1]["cache_hit"]) and not any(built[0]["cache_hit"])
    assert built[1]["sample"] == built[0]["sample"]


@pytest.mark.gpu
def test_get_batch_on_cuda_with_nccl():
    from tinytron.data._workers import get_batch_cuda_check

    world = min(2, torch.cuda.device_count())
    for r in run_on_ranks(get_batch_cuda_check, world, backend="nccl", timeout=180):
        assert r["devices"] == ["cuda"] and r["equal"]


def test_get_batch_single_process_and_missing_keys():
    from tinytron.data._workers import CountingIterator, make_pretrain_batch
    from tinytron.data.distribute import get_batch
    from tinytron.parallel.grid import ParallelGrid

    grid = ParallelGrid.single()
    full = make_pretrain_batch(2, 8)
    out = get_batch(CountingIterator(full), grid, micro_batch_size=2, seq_length=8,
                    create_attention_mask=False)
    assert out["attention_mask"] is None and torch.equal(out["tokens"], full["tokens"])
    no_labels = {k: v for k, v in full.items() if k != "labels"}
    with pytest.raises(ValueError, match="no 'labels'"):
        get_batch(CountingIterator(no_labels), grid, micro_batch_size=2, seq_length=8)
    with pytest.raises(ValueError, match="needs a data iterator"):
        get_batch(None, grid, micro_batch_size=2, seq_length=8)

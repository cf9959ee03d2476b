"""Rank functions for chapter 04's multi-process demos and tests (spawned ranks import them by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinytron.parallel.grid import ParallelGrid


class CountingIterator:
    """Yields the same micro-batch forever and counts how often it was read."""

    def __init__(self, batch: dict):
        self.batch, self.reads = batch, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.reads += 1
        return {k: v.clone() for k, v in self.batch.items()}


def make_pretrain_batch(mbs: int, seq: int, seed: int = 0) -> dict:
    """A micro-batch whose position_ids are the global positions and tokens are random."""
    from tinytron.overview.batch import get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (mbs, seq), generator=g)
    mask, loss_mask, pos = get_ltor_masks_and_position_ids(tokens, eod_token=0)
    return {"tokens": tokens, "labels": torch.randint(0, 100, (mbs, seq), generator=g),
            "loss_mask": loss_mask, "position_ids": pos, "attention_mask": mask}


def make_sft_batch(seq: int, cu: list[int]) -> dict:
    """One packed row (mbs 1) with the given segment boundaries and per-segment positions."""
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    tokens = torch.arange(seq).unsqueeze(0) + 1000
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(1, seq),
            "position_ids": pos.unsqueeze(0), "attention_mask": torch.ones(1, 1, seq, seq, dtype=torch.bool),
            "cu_seqlens": torch.tensor([cu], dtype=torch.int32)}


def _tp_peers_equal(t: torch.Tensor, grid: ParallelGrid) -> bool:
    """True when every TP rank holds the same tensor."""
    if grid.size("tp") == 1:
        return True
    parts = [torch.empty_like(t) for _ in range(grid.size("tp"))]
    dist.all_gather(parts, t.contiguous(), group=grid.group("tp"))
    return all(torch.equal(p, parts[0]) for p in parts)


def get_batch_demo(tp: int, cp: int, pp: int, seq: int) -> dict:
    """Run get_batch on this rank's grid; report positions received and TP agreement."""
    from tinytron.data.distribute import get_batch

    grid = ParallelGrid(tp=tp, cp=cp, pp=pp)
    it = CountingIterator(make_pretrain_batch(2, seq)) if grid.rank("tp") == 0 else None
    batch = get_batch(it, grid, micro_batch_size=2, seq_length=seq)
    return {"rank": grid.global_rank, "tp": grid.rank("tp"), "cp": grid.rank("cp"),
            "positions": batch["position_ids"][0].tolist(),
            "tokens_equal_tp_peer": _tp_peers_equal(batch["tokens"], grid)}


def get_batch_check(grid: ParallelGrid, seq: int, sft_cu=None) -> dict:
    """Everything a test wants to know about this rank's get_batch result."""
    from tinytron.data.distribute import get_batch

    cp = grid.size("cp")
    full = make_sft_batch(seq, sft_cu) if sft_cu else make_pretrain_batch(2, seq)
    it = CountingIterator(full)  # handed to every rank: only TP rank 0 may read it
    mbs = 1 if sft_cu else 2
    batch = get_batch(it, grid, micro_batch_size=mbs, seq_length=seq, is_sft=bool(sft_cu))
    present = {k: v is not None for k, v in batch.items()}
    out = {"rank": grid.global_rank, "tp": grid.rank("tp"), "cp": grid.rank("cp"),
           "pp": grid.rank("pp"), "reads": it.reads, "present": present,
           "dtypes": {k: str(v.dtype) for k, v in batch.items() if v is not None},
           "shapes": {k: tuple(v.shape) for k, v in batch.items() if v is not None}}
    ref = next(CountingIterator(full))
    from tinytron.data.distribute import thd_partitioned_indices

    if sft_cu:
        index = thd_partitioned_indices(ref["cu_seqlens"], cp, grid.rank("cp"))
    else:
        from tinytron.parallel.context_parallel import cp_positions

        index = cp_positions(seq, cp, grid.rank("cp")) if cp > 1 else torch.arange(seq)
    expect = {k: (v.index_select(2 if k == "attention_mask" else 1, index) if k != "cu_seqlens" else v)
              for k, v in ref.items()}
    out["matches_reference"] = all(torch.equal(batch[k], expect[k].to(batch[k].dtype))
                                   for k in batch if batch[k] is not None and k != "max_seqlen")
    if sft_cu:
        out["max_seqlen"] = int(batch["max_seqlen"])
    agree = [(_tp_peers_equal(batch[k].float(), grid)) for k in sorted(batch) if batch[k] is not None]
    out["tp_agree"] = all(agree)
    return out


def build_on_rank0_check(grid: ParallelGrid, prefix: str, cache: str) -> dict:
    """Build train/valid datasets where Megatron would (TP rank 0 of first/last stage)."""
    from tinytron.data.blended import BlendedMegatronDatasetBuilder
    from tinytron.data.gpt_dataset import GPTDataset, GPTDatasetConfig

    on_rank = lambda: grid.rank("tp") == 0 and (grid.is_first_stage() or grid.is_last_stage())  # noqa: E731
    cfg = GPTDatasetConfig(sequence_length=16, blend=([prefix, prefix], [0.25, 0.75]), split="90,10,0",
                           path_to_cache=cache)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [64, 8, None], on_rank, cfg).build()
    return {"rank": grid.global_rank, "built": train is not None,
            "cache_hit": None if train is None else [d.cache_hit for d in train.datasets],
            "sample": None if train is None else train[5]["tokens"].tolist()}


def get_batch_suite(prefix: str = None, cache: str = None) -> dict:
    """One 4-rank world, two grids: TP2 x CP2 (+ the dataset build) and PP4 (first/middle/last)."""
    out = {}
    for name, sizes in (("tp2cp2", dict(tp=2, cp=2)), ("pp4", dict(pp=4))):
        grid = ParallelGrid(**sizes)  # one grid per layout: every new_group is a collective
        out[name] = {"pp": grid.rank("pp"), "pretrain": get_batch_check(grid, 16),
                     "sft": get_batch_check(grid, 16, sft_cu=[0, 8, 12, 16])}
    if prefix is not None:
        out["build"] = build_on_rank0_check(ParallelGrid(tp=2, cp=2), prefix, cache)
    return out


def get_batch_cuda_check(seq: int = 16) -> dict:
    """On a CUDA/NCCL world: the batch lands on the GPU with Megatron's dtypes and values."""
    grid = ParallelGrid(tp=torch.distributed.get_world_size())
    from tinytron.data.distribute import get_batch

    full = make_pretrain_batch(2, seq)
    it = CountingIterator(full) if grid.rank("tp") == 0 else None
    batch = get_batch(it, grid, micro_batch_size=2, seq_length=seq)
    return {"devices": sorted({str(v.device.type) for v in batch.values() if v is not None}),
            "equal": all(torch.equal(batch[k].cpu(), full[k]) for k in full)}


def pipeline_demo(data_path: list, cache: str, seq: int = 64, mbs: int = 4) -> dict:
    """The page's whole pipeline on this rank, once at TP 2 and once at CP 2 (one world, two grids)."""
    from tinytron.data.distribute import get_batch
    from tinytron.data.pipeline import (DataConfig, build_data_iterators,
                                        build_train_valid_test_datasets, is_dataset_built_on_rank)
    from tinytron.overview.batch import ByteTokenizer

    tok, out = ByteTokenizer(), {}
    cfg = DataConfig(data_path=data_path, split="90,10,0", num_workers=0, data_cache_path=cache)
    for name, sizes in (("tp2", dict(tp=2)), ("cp2", dict(cp=2))):
        grid = ParallelGrid(**sizes)  # every rank creates every group, in the same order
        built = is_dataset_built_on_rank(grid)
        splits = build_train_valid_test_datasets(cfg, seq, [8 * mbs, mbs, None], lambda: built,
                                                 eod_id=tok.eod, pad_id=tok.pad)
        train_it = build_data_iterators(cfg, splits, [0, 0, 0], mbs, grid)[0]
        batch = get_batch(train_it, grid, micro_batch_size=mbs, seq_length=seq,
                          vocab_size=tok.vocab_size)
        first = splits[0][0]["tokens"] if built else None  # sample 0, read where it was built
        out[name] = {"rank": grid.global_rank, "built": built, "has_iterator": train_it is not None,
                     "tokens": tuple(batch["tokens"].shape),
                     "positions": batch["position_ids"][0].tolist(),
                     "row0": batch["tokens"][0].tolist(),
                     "sample0": None if first is None else first.tolist(),
                     "tp_agree": _tp_peers_equal(batch["tokens"], grid)}
    return out

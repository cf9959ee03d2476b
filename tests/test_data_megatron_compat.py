"""Chapter 04: same files and same samples as Megatron's own dataset classes.

By default the oracle is the installed megatron-core 0.16.1 (a test dependency; its wheel ships
the compiled helpers). Its dataset classes agree with e03878b5f on everything checked here.
The opt-in check against the commit itself: TINYTRON_MEGATRON_SRC names a Megatron-LM checkout
(e03878b5f) whose `megatron.core.datasets` imports, with `helpers_cpp` built next to helpers.cpp
(see test_data_megatron_helpers.py). Without Megatron's full dependency set (Transformer
Engine, triton, ...) a scratch copy whose `megatron/core/__init__.py` is emptied imports fine.
"""

from __future__ import annotations

import filecmp
import importlib
import os
import sys

import numpy as np
import pytest
import torch

from tinytron.data.blended import BlendedMegatronDatasetBuilder
from tinytron.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from tinytron.data.indexed import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path

SRC = os.environ.get("TINYTRON_MEGATRON_SRC")
MODULES = ("indexed_dataset", "gpt_dataset", "blended_megatron_dataset_builder")


@pytest.fixture(scope="module")
def meg(tmp_path_factory):
    """Megatron's dataset modules, with the one-rank gloo group its blend builder asks for."""
    if not SRC:
        pytest.importorskip("megatron.core", reason="megatron-core (a test dependency) is not installed")
    else:
        sys.path.insert(0, SRC)
    try:
        importlib.import_module("megatron.core.parallel_state")  # settles an import cycle
        modules = {name: importlib.import_module(f"megatron.core.datasets.{name}") for name in MODULES}
    finally:
        if SRC:
            sys.path.remove(SRC)
    own_group = not torch.distributed.is_initialized()
    if own_group:
        store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield modules
    if own_group:
        torch.distributed.destroy_process_group()


class _Tok:
    vocab_size, eod, pad = 60001, 0, 60000
    special_tokens_dict: dict = {}
    unique_identifiers = {"class": "Tok"}


def _write(builder_cls, prefix, docs):
    b = builder_cls(get_bin_path(prefix), dtype=np.uint16)
    for doc in docs:
        for seq in doc:
            b.add_item(torch.from_numpy(seq.astype(np.int64)))
        b.end_document()
    b.finalize(get_idx_path(prefix))


@pytest.fixture(scope="module")
def docs():
    rng = np.random.default_rng(0)
    return [[rng.integers(0, 60000, rng.integers(1, 300)) for _ in range(rng.integers(1, 3))]
            for _ in range(300)]


def test_builders_write_identical_files(meg, docs, tmp_path):
    _write(IndexedDatasetBuilder, str(tmp_path / "ours"), docs)
    _write(meg["indexed_dataset"].IndexedDatasetBuilder, str(tmp_path / "meg"), docs)
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(str(tmp_path / "ours") + ext, str(tmp_path / "meg") + ext, shallow=False)
    theirs, ours = meg["indexed_dataset"].IndexedDataset(str(tmp_path / "ours")), IndexedDataset(str(tmp_path / "meg"))
    assert all(np.array_equal(theirs[i], ours[i]) for i in range(len(ours)))


# megatron-core loops forever when samples are requested from an empty split: bound the time
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["one_prefix", "blend_0.999_0.001", "one_epoch"])
def test_same_samples_as_megatron(meg, docs, tmp_path, case):
    _write(IndexedDatasetBuilder, str(tmp_path / "a"), docs)
    _write(IndexedDatasetBuilder, str(tmp_path / "b"), docs[::-1])
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    blend, sizes, split, seq = {
        "one_prefix": (([a], None), [2000, 150, 40], "90,8,2", 128),
        "blend_0.999_0.001": (([a, b], [0.999, 0.001]), [1500, 80, 0], "98,2,0", 128),
        "one_epoch": (([a], None), [None, None, None], "100,0,0", 64)}[case]
    mcfg = meg["gpt_dataset"].GPTDatasetConfig(
        random_seed=1234, sequence_length=seq, blend=blend, split=split, tokenizer=_Tok(),
        path_to_cache=str(tmp_path / "m"), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False)
    theirs = meg["blended_megatron_dataset_builder"].BlendedMegatronDatasetBuilder(
        meg["gpt_dataset"].GPTDataset, sizes, lambda: True, mcfg).build()
    cfg = GPTDatasetConfig(sequence_length=seq, blend=blend, split=split, eod_id=0, pad_id=60000,
                           path_to_cache=str(tmp_path / "t"))
    ours = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    for x, y in zip(theirs, ours):
        assert (x is None) == (y is None)
        if x is not None:
            assert len(x) == len(y)
            for i in range(len(x)):
                for k in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
                    assert torch.equal(x[i][k], y[i][k]), (i, k)

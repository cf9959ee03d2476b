"""Chapter 04 · SFTDataset: chat JSONL -> one packed row per record, CP padding."""

from __future__ import annotations

import json

import pytest
import torch

from tinytron.data.sft import SFTDataset, pad_segments_for_context_parallel, read_chat_jsonl
from tinytron.overview.sft import pack_conversations, split_conversations

CHATS = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "system", "content": ""},
                  {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"messages": [{"role": "user", "content": "ok?"}, {"role": "assistant", "content": "sure"}]},
    {"messages": [{"role": "user", "content": "x" * 50}, {"role": "assistant", "content": "y"}]},
]


@pytest.fixture()
def path(tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text("\n".join(json.dumps(c) for c in CHATS) + "\n")
    return str(p)


def test_one_record_is_one_row_from_chapter_00(path):
    ds = SFTDataset(path, seq_length=64, num_samples=7)
    assert len(ds) == 7
    for i in range(7):
        row = ds[i]
        expect = pack_conversations(split_conversations(CHATS[i % 3]["messages"]), 64)
        assert len(expect) == 1
        for k in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "attention_mask"):
            assert torch.equal(row[k], expect[0][k]), k
    cu = ds[0]["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 64
    assert set(ds[0]["loss_mask"].unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_padding_makes_segments_divisible_and_trains_the_same_tokens(path, cp):
    plain = SFTDataset(path, seq_length=64)
    padded = SFTDataset(path, seq_length=64, context_parallel_size=cp)
    for i in range(3):
        a, b = plain[i], padded[i]
        lengths = (b["cu_seqlens"][1:] - b["cu_seqlens"][:-1]).tolist()
        assert all(n % (2 * cp) == 0 for n in lengths) and b["cu_seqlens"][-1] == 64
        assert torch.equal(a["labels"][a["loss_mask"] > 0], b["labels"][b["loss_mask"] > 0])
        assert b["tokens"].shape == (64,) and b["attention_mask"].shape == (1, 64, 64)
    row = plain[0]
    assert pad_segments_for_context_parallel(row, 1, 64) is row  # cp = 1: nothing to pad
    with pytest.raises(ValueError, match="seq_length 60 must be a multiple of 2\\*cp = 8"):
        pad_segments_for_context_parallel(row, 8, 60)


def test_too_long_record_and_bad_lines(path, tmp_path):
    with pytest.raises(ValueError, match="SFT record 0 needs 2 rows"):
        SFTDataset(path, seq_length=24)[0]
    with pytest.raises(ValueError, match="SFT record 2: conversation 0 has 55 tokens"):
        SFTDataset(path, seq_length=40)[2]
    first_only = SFTDataset(path, seq_length=24, truncate=True)[0]  # whole conversations dropped
    assert first_only["cu_seqlens"].tolist() == [0, 19, 24]
    assert SFTDataset(path, seq_length=40, truncate=True)[2]["tokens"].shape == (40,)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CHATS[0]) + "\n" + '{"text": "no messages"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*messages"):
        read_chat_jsonl(str(bad))
    with pytest.raises(ValueError, match="seq_length 30 must be a multiple"):
        SFTDataset(path, seq_length=30, context_parallel_size=2)[1]


def test_sft_rows_flow_through_the_loader_and_get_batch(path):
    from tinytron.data.distribute import get_batch
    from tinytron.data.samplers import build_pretraining_data_loader
    from tinytron.parallel.grid import ParallelGrid

    ds = SFTDataset(path, seq_length=64)
    loader = build_pretraining_data_loader(ds, 0, 1, 0, 1)
    batch = get_batch(iter(loader), ParallelGrid.single(), micro_batch_size=1, seq_length=64,
                      is_sft=True)
    assert batch["cu_seqlens"].shape == (1, 4) and int(batch["max_seqlen"]) == 35  # [0, 19, 29, 64]: the pad tail is longest
    assert batch["attention_mask"].shape == (1, 1, 64, 64)
    assert torch.equal(batch["tokens"][0], ds[0]["tokens"])

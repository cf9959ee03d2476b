"""Chapter 04 · tinytron-preprocess: inputs, tokenizers, workers, partitions, merging."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tinytron.data.indexed import IndexedDataset, get_bin_path
from tinytron.data.preprocess import (TokenizerSpec, build_tokenizer, main, run, stdlib_corpus,
                                      train_bpe_tokenizer)

TEXTS = ["hello world", "", "ünïcode ✓ text", "a" * 300, "line one\nline two", "x"]


@pytest.fixture()
def jsonl(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)) + "\n\n")
    return str(p)


def _run(*args):
    return run([*args, "--no-progress"])


def test_jsonl_byte_tokenizer_with_eod(jsonl, tmp_path):
    prefix = _run("--input", jsonl, "--output-prefix", str(tmp_path / "o"), "--workers", "1")
    assert prefix.endswith("o_text_document")
    ds = IndexedDataset(prefix)
    # the empty text is an empty document: no sequence, no EOD (as Megatron's tool writes it)
    assert ds.dtype == np.uint16 and len(ds) == len(TEXTS) - 1 and ds.document_count == len(TEXTS)
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3, 4, 5]
    for i, t in enumerate(t for t in TEXTS if t):
        assert ds[i].tolist() == list(t.encode()) + [256]
    no_eod = IndexedDataset(_run("--input", jsonl, "--output-prefix", str(tmp_path / "n"),
                                 "--no-append-eod", "--workers", "1"))
    assert no_eod[0].tolist() == list(b"hello world") and len(no_eod) == len(TEXTS) - 1


def test_workers_and_partitions_give_identical_files(jsonl, tmp_path):
    files = stdlib_corpus(12)
    one = _run("--input", jsonl, *files, "--output-prefix", str(tmp_path / "a"), "--workers", "1")
    many = _run("--input", jsonl, *files, "--output-prefix", str(tmp_path / "b"), "--workers", "2",
                "--partitions", "3")
    for ext in (".bin", ".idx"):
        assert Path(one + ext).read_bytes() == Path(many + ext).read_bytes()
    assert not list(tmp_path.glob("b_text_document.part*"))  # partitions are removed after merging


def test_plain_text_files_and_merge(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file")
    b.write_text("second")
    pa = _run("--input", str(a), "--output-prefix", str(tmp_path / "pa"), "--workers", "1")
    pb = _run("--input", str(b), "--output-prefix", str(tmp_path / "pb"), "--workers", "1")
    merged = _run("--merge", pa, pb, "--output-prefix", str(tmp_path / "m"))
    ds = IndexedDataset(merged)
    assert [ds[i].tolist() for i in range(2)] == [list(b"first file") + [256], list(b"second") + [256]]
    assert ds.document_indices.tolist() == [0, 1, 2]


def test_default_corpus_is_the_stdlib(tmp_path):
    files = stdlib_corpus(3)
    assert all(f.endswith(".py") and "site-packages" not in f for f in files)
    ds = IndexedDataset(_run("--output-prefix", str(tmp_path / "s"), "--max-files", "3", "--workers", "1"))
    assert len(ds) == 3
    assert bytes(ds[0][:-1].astype(np.uint8)) == Path(files[0]).read_bytes()


def test_hf_tokenizer_file_and_bpe_training(jsonl, tmp_path):
    tok_path = train_bpe_tokenizer(iter(TEXTS * 20), 300, str(tmp_path / "tok.json"))
    tok = build_tokenizer(TokenizerSpec("hf", tok_path))
    assert tok.vocab_size <= 300 and tok.eod == 0
    ds = IndexedDataset(_run("--input", jsonl, "--output-prefix", str(tmp_path / "h"),
                             "--tokenizer-type", "hf", "--tokenizer-file", tok_path, "--workers", "2"))
    for i, t in enumerate(t for t in TEXTS if t):
        assert ds[i].tolist() == tok.encode(t) + [tok.eod]
        assert tok.decode(ds[i][:-1]) == t
    trained = _run("--input", jsonl, "--output-prefix", str(tmp_path / "t"),
                   "--tokenizer-type", "bpe", "--vocab-size", "280", "--workers", "1")
    assert Path(str(tmp_path / "t") + "_tokenizer.json").is_file()
    assert IndexedDataset(trained).sequence_lengths.sum() < sum(len(t.encode()) + 1 for t in TEXTS)


def test_bad_inputs_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        _run("--input", str(bad), "--output-prefix", str(tmp_path / "x"), "--workers", "1")
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"content": "ok"}\n')
    with pytest.raises(ValueError, match=r"nokey.jsonl:1: no string field 'text'"):
        _run("--input", str(nokey), "--output-prefix", str(tmp_path / "x"), "--workers", "1")
    good = tmp_path / "good.txt"
    good.write_text("fine")
    with pytest.raises(ValueError, match="not found"):
        _run("--input", str(good), "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "hf",
             "--tokenizer-file", str(tmp_path / "missing.json"))
    assert not Path(get_bin_path(str(tmp_path / "x_text_document"))).exists()


def test_console_entry_point_exits_zero(tmp_path, capsys):
    """pip's console script does sys.exit(main()): main must return 0, not the prefix."""
    (tmp_path / "t.txt").write_text("abc")
    assert main(["--input", str(tmp_path / "t.txt"), "--output-prefix", str(tmp_path / "o"),
                 "--workers", "1", "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "error: input" in capsys.readouterr().err


# -- the tokenizer sidecar and bytes that are not UTF-8 ---------------------------------------
def test_every_dataset_gets_a_sidecar_naming_its_tokenizer(jsonl, tmp_path):
    import hashlib

    from tinytron.data._sidecar import read_sidecar

    byte = _run("--input", jsonl, "--output-prefix", str(tmp_path / "b"), "--workers", "1")
    assert sorted(p.name for p in tmp_path.glob("b_*")) == [
        "b_text_document.bin", "b_text_document.idx", "b_text_document.tokenizer_info.json"]
    info = read_sidecar(byte)
    assert {k: info[k] for k in ("tokenizer_type", "tokenizer_file", "vocab_size", "eod", "pad")} \
        == {"tokenizer_type": "byte", "tokenizer_file": None, "vocab_size": 262, "eod": 256,
            "pad": 257}
    bpe = _run("--input", jsonl, "--output-prefix", str(tmp_path / "t"), "--tokenizer-type", "bpe",
               "--vocab-size", "280", "--workers", "2", "--partitions", "2")
    info = read_sidecar(bpe)
    tok_file = Path(str(tmp_path / "t") + "_tokenizer.json")
    assert info["tokenizer_type"] == "hf" and info["tokenizer_file"] == str(tok_file.resolve())
    assert info["tokenizer_sha256"] == hashlib.sha256(tok_file.read_bytes()).hexdigest()
    assert (info["eod"], info["pad"]) == (0, 1) and not list(tmp_path.glob("t_*part*"))
    # a merge keeps one shared sidecar, and refuses datasets tokenized differently
    again = _run("--input", jsonl, "--output-prefix", str(tmp_path / "b2"), "--workers", "1")
    merged = _run("--merge", byte, again, "--output-prefix", str(tmp_path / "m"))
    assert read_sidecar(merged) == read_sidecar(byte)
    with pytest.raises(ValueError, match=r"tokenized differently.*eod 0 \(data\) vs 256"):
        _run("--merge", byte, bpe, "--output-prefix", str(tmp_path / "mixed"))
    assert not Path(get_bin_path(str(tmp_path / "mixed"))).exists()


def test_text_that_is_not_utf8_stops_naming_file_and_offset(tmp_path, capsys):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café au lait".encode("utf-8") + b" na\xefve")  # 0xef: Latin-1 'ï'
    out = str(tmp_path / "o")
    for workers in ("1", "2"):
        assert main(["--input", str(latin), "--output-prefix", out, "--workers", workers,
                     "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{latin}: not valid UTF-8 at byte 16 (0xef)" in err[0], err
        assert "--encoding-errors replace" in err[0]
    assert not Path(get_bin_path(out + "_text_document")).exists()
    ds = IndexedDataset(_run("--input", str(latin), "--output-prefix", out, "--workers", "1",
                             "--encoding-errors", "replace"))
    assert bytes(ds[0][:-1].astype(np.uint8)).decode() == "café au lait na\ufffdve"
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert main(["--input", str(bad), "--output-prefix", out, "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: not valid UTF-8 (byte 28 of the file is 0xe9)" in err, err

"""Chapter 04 · the .bin/.idx format: byte-exact writer, reader checks, crash-safe builder."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tinytron.data.indexed import (DType, IndexedDataset, IndexedDatasetBuilder,
                                   IndexedDatasetError, get_bin_path, get_idx_path, optimal_dtype)


def _build(prefix, docs, dtype=np.uint16):
    """docs: list of documents, each a list of sequences."""
    b = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(np.array(seq))
        b.end_document()
    b.finalize(get_idx_path(prefix))
    return IndexedDataset(prefix)


def test_idx_is_byte_exact_for_a_hand_built_example(tmp_path):
    p = str(tmp_path / "x")
    _build(p, [[[5, 6, 7], [8, 9]], [[3]]], dtype=np.int32)
    expected = (b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([4])
                + (3).to_bytes(8, "little") + (3).to_bytes(8, "little")
                + b"".join(n.to_bytes(4, "little") for n in (3, 2, 1))
                + b"".join(n.to_bytes(8, "little") for n in (0, 12, 20))  # int32: 4 bytes/token
                + b"".join(n.to_bytes(8, "little") for n in (0, 2, 3)))
    assert open(get_idx_path(p), "rb").read() == expected
    assert open(get_bin_path(p), "rb").read() == np.array([5, 6, 7, 8, 9, 3], "<i4").tobytes()


def test_dtype_codes_and_optimal_dtype():
    assert {c: np.dtype(t).name for c, t in DType.codes.items()} == {
        1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
        8: "uint16"}
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32
    with pytest.raises(ValueError, match="no MMIDIDX code"):
        DType.code_from_dtype(np.uint32)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
def test_round_trip_and_mmap_equals_file_reader(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 100, rng.integers(0, 20)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(30)]
    p = str(tmp_path / "d")
    ds = _build(p, docs, dtype)
    flat = [s for d in docs for s in d]
    fr = IndexedDataset(p, mmap=False)
    assert len(ds) == len(flat) and ds.document_indices[0] == 0 and ds.document_indices[-1] == len(flat)
    itemsize = np.dtype(dtype).itemsize
    assert ds.sequence_pointers.tolist() == (np.cumsum([0] + [len(s) for s in flat[:-1]]) * itemsize).tolist()
    for i, s in enumerate(flat):
        assert ds[i].tolist() == s and fr[i].tolist() == s and ds[i].dtype == dtype
        if len(s) > 2:
            assert ds.get(i, 1, 2).tolist() == s[1:3] == fr.get(i, 1, 2).tolist()


def test_add_index_merges_and_offsets_documents(tmp_path):
    a = _build(str(tmp_path / "a"), [[[1, 2]], [[3], [4, 5]]])
    b = _build(str(tmp_path / "b"), [[[6]], [[7, 8, 9]]])
    m = IndexedDatasetBuilder(get_bin_path(str(tmp_path / "m")), dtype=np.uint16)
    m.add_index(str(tmp_path / "a"))
    m.add_index(str(tmp_path / "b"))
    m.finalize(get_idx_path(str(tmp_path / "m")))
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4, 5], [6], [7, 8, 9]]
    assert ds.document_indices.tolist() == [0, 1, 3, 4, 5]
    assert len(a) + len(b) == len(ds)
    wrong = IndexedDatasetBuilder(get_bin_path(str(tmp_path / "w")), dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match="dtype"):
        wrong.add_index(str(tmp_path / "a"))


def _corrupt_cases():
    def patch(offset, data):
        def f(idx, bin_):
            raw = bytearray(open(idx, "rb").read())
            raw[offset:offset + len(data)] = data
            open(idx, "wb").write(bytes(raw))
        return f

    def truncate(path_kind, n):
        def f(idx, bin_):
            path = idx if path_kind == "idx" else bin_
            with open(path, "r+b") as fh:
                fh.truncate(os.path.getsize(path) - n)
        return f

    def append(path_kind, data):
        def f(idx, bin_):
            with open(idx if path_kind == "idx" else bin_, "ab") as fh:
                fh.write(data)
        return f

    return {
        "bad magic": (patch(0, b"XXIDIDX"), "bad magic"),
        "bad version": (patch(9, struct.pack("<Q", 2)), "unsupported version 2"),
        "bad dtype code": (patch(17, bytes([99])), "unknown dtype code 99"),
        "truncated idx": (truncate("idx", 8), "truncated index"),
        "tiny idx": (truncate("idx", 80), "truncated index"),
        "oversized idx": (append("idx", b"\0" * 8), "oversized index"),
        "doc index end": (patch(34 + 12 * 3 + 16, struct.pack("<q", 2)), "inconsistent document indices"),
        "doc index start": (patch(34 + 12 * 3, struct.pack("<q", 1)), "inconsistent document indices"),
        "pointer": (patch(34 + 12 + 8, struct.pack("<q", 7)), "inconsistent pointer for sequence 1"),
        "negative length": (patch(34, struct.pack("<i", -1)), "negative sequence length"),
        "short bin": (truncate("bin", 2), "shorter than"),
        "long bin": (append("bin", b"\0\0"), "longer than"),
    }


@pytest.mark.parametrize("case", list(_corrupt_cases()))
def test_corrupt_files_raise_an_error_naming_file_and_problem(tmp_path, case):
    p = str(tmp_path / "c")
    _build(p, [[[5, 6, 7], [8, 9]], [[3]]])
    damage, message = _corrupt_cases()[case]
    damage(get_idx_path(p), get_bin_path(p))
    with pytest.raises(IndexedDatasetError) as err:
        IndexedDataset(p)
    assert message in str(err.value)
    assert "c.idx" in str(err.value) or "c.bin" in str(err.value)


def test_dtype_mismatch_and_missing_file(tmp_path):
    p = str(tmp_path / "c")
    _build(p, [[[1, 2]]])
    with pytest.raises(IndexedDatasetError, match="dtype mismatch.*uint16"):
        IndexedDataset(p, dtype_code=4)
    assert len(IndexedDataset(p, dtype_code=8)) == 1
    os.remove(get_bin_path(p))
    with pytest.raises(FileNotFoundError, match="c.bin"):
        IndexedDataset(p)


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from tinytron.data.indexed import IndexedDatasetBuilder, get_bin_path, get_idx_path
    prefix = sys.argv[1]
    b = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    chunk = np.arange(4096, dtype=np.uint16)
    for i in range(10**9):
        b.add_item(chunk)
        b.end_document()
        if i == 50:
            print("writing", flush=True)
""")


def test_killed_builder_never_leaves_a_prefix_that_opens(tmp_path):
    """Kill a writer mid-stream, over an existing complete dataset: the old pair survives."""
    p = str(tmp_path / "k")
    _build(p, [[[1, 2, 3]]])
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, p], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert os.path.getsize(get_bin_path(p) + ".partial") >= 50 * 4096 * 2  # it was mid-write
    ds = IndexedDataset(p)  # still the old, complete dataset
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3]]


def test_crash_between_renames_does_not_open(tmp_path, monkeypatch):
    """If finalize dies after moving the .bin but before the .idx, the prefix must not open."""
    p = str(tmp_path / "r")
    _build(p, [[[1, 2, 3]]])
    b = IndexedDatasetBuilder(get_bin_path(p), dtype=np.uint16)
    b.add_item(np.arange(10))
    b.end_document()
    real_replace = os.replace

    def dying_replace(src, dst):
        if dst.endswith(".idx"):
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        b.finalize(get_idx_path(p))
    monkeypatch.setattr(os, "replace", real_replace)
    with pytest.raises(FileNotFoundError, match="r.idx"):
        IndexedDataset(p)


def test_pointer_check_works_across_blocks(tmp_path, monkeypatch):
    import tinytron.data.indexed as indexed

    monkeypatch.setattr(indexed, "_CHECK_BLOCK", 3)
    p = str(tmp_path / "b")
    _build(p, [[[1] * (i + 1)] for i in range(10)])
    assert len(IndexedDataset(p)) == 10
    raw = bytearray(open(get_idx_path(p), "rb").read())
    raw[34 + 40 + 8 * 7: 34 + 40 + 8 * 8] = struct.pack("<q", 999)
    open(get_idx_path(p), "wb").write(bytes(raw))
    with pytest.raises(IndexedDatasetError, match="pointer for sequence 7: 999 bytes, lengths say 56"):
        IndexedDataset(p)


def test_add_document_takes_token_ids_written_as_text(tmp_path):
    """megatron-core's builder converts with np.array(tokens, dtype=...), which parses "12" as
    12: the same list gives the same file here; text that is not an id is one ValueError."""
    p = str(tmp_path / "t")
    b = IndexedDatasetBuilder(get_bin_path(p), dtype=np.int32)
    b.add_document(["12", "34", "56"], [3])
    b.add_document(np.array(["7", "8"]), [1, 1])
    with pytest.raises(ValueError, match="^tokens: not integer token ids"):
        b.add_document(["12", "x"], [2])
    small = IndexedDatasetBuilder(get_bin_path(str(tmp_path / "u")), dtype=np.uint16)
    with pytest.raises(ValueError, match="does not fit"):   # parsed, then range-checked
        small.add_document(["70000"], [1])
    b.finalize(get_idx_path(p))
    ds = IndexedDataset(p)
    assert [ds[i].tolist() for i in range(len(ds))] == [[12, 34, 56], [7], [8]]
    assert ds.document_indices.tolist() == [0, 1, 3]

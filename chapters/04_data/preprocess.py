# %% [markdown]
# # 04 · Data: preprocessing text into `.bin` / `.idx`
#
# The `tinytron-preprocess` command: read JSONL or plain text, tokenize in parallel worker
# processes with a progress bar, append an end-of-document token, and write Megatron's indexed
# format — optionally in several partitions that are merged at the end. With no input at all it
# tokenizes the Python standard library's own source files found on this machine, so a new user
# can train on real text without downloading anything.
#
# Why a separate step at all: training reads tokens, never text. A training step that had to
# tokenize its own batch would spend CPU on every step of every run, on every data-parallel
# rank, and would have to agree with itself after a restart about where in the text it was.
# Tokenizing once, ahead of time, turns the corpus into two flat files that any rank can
# memory-map and index by sample number ([the indexed format](indexed.py)); after that, what a
# sample is becomes plain arithmetic on integers ([GPTDataset](gpt_dataset.py)).
#
# ### A corpus of three lines, by hand
#
# `c.jsonl` holds three documents, `{"text": "hi"}`, `{"text": ""}` and `{"text": "abc"}`.
# With the byte tokenizer (`h`=104, `i`=105, `a`=97, `b`=98, `c`=99, EOD=256) and
# `--append-eod` on, the command writes:
#
# | document | text    | sequence written        | length |
# |----------|---------|-------------------------|--------|
# | 0        | `hi`    | `[104, 105, 256]`       | 3      |
# | 1        | (empty) | none, and no EOD        | -      |
# | 2        | `abc`   | `[97, 98, 99, 256]`     | 4      |
#
# So `sequence_lengths = [3, 4]` and `document_indices = [0, 1, 1, 2]`: document *d* owns the
# sequences from `document_indices[d]` to `document_indices[d+1]`, and the empty document owns
# none (1 to 1). The vocabulary has 262 ids, under 65500, so the tokens are `uint16`
# (`megatron/core/datasets/indexed_dataset.py:116-117`) and `c_text_document.bin` is 7 × 2 = 14
# bytes. `c_text_document.idx` is 90 bytes: 34 of header (magic 9, version 8, dtype code 1, and
# the sequence and document counts, 8 each; `indexed_dataset.py:147-198`), then 2 × 4 bytes of
# int32 lengths, 2 × 8 of int64 byte pointers and 4 × 8 of int64 document indices
# (`indexed_dataset.py:201-207`).

# %%
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from tinytron.data._preprocess_cli import UsageError, main, run
from tinytron.data._sidecar import describe_tokenizer, read_sidecar, sidecar_mismatch, write_sidecar
from tinytron.data.indexed import (IndexedDataset, IndexedDatasetBuilder, get_bin_path,
                                   get_idx_path, optimal_dtype)

__all__ = [
    "TokenizerSpec", "build_tokenizer", "train_bpe_tokenizer", "stdlib_corpus", "iter_documents",
    "preprocess", "merge_datasets", "main", "run", "UsageError",
]

# %% [markdown]
# ## Tokenizers
#
# Three kinds, all behind the same two attributes the rest of the chapter needs — `encode(text)`
# and `eod` — plus `vocab_size`, which picks the token dtype (uint16 below 65500 ids, else int32,
# `indexed_dataset.py:107`):
#
# * `byte`: [chapter 00's](../00_overview/batch.py) byte tokenizer (ids 0..255 plus specials; EOD = 256), no training;
# * `hf`: any Hugging Face `tokenizers` file (`tokenizer.json`), EOD looked up by name;
# * `bpe`: a byte-level BPE of a chosen vocabulary size, trained on the input itself and saved
#   as `tokenizer.json` next to the output.
#
# Worker processes receive a small picklable `TokenizerSpec` and build their own tokenizer once
# (`Encoder.initializer` in `tools/preprocess_data.py` does the same).
#
# Why three: `byte` needs nothing and cannot fail, so the first hour works offline; `hf` reads
# the tokenizer a real model was trained with, which is what a fine-tune or a comparison with a
# published checkpoint needs; `bpe` sits between, a real subword vocabulary with no download,
# at the price of one pass over the text before tokenizing starts.
#
# The whole command, from files to one `.bin/.idx` pair per JSON key:
#
# ```mermaid
# flowchart TB
#   I["inputs: JSONL lines<br/>or text files"] --> D["documents, in order"]
#   D --> W1["worker 1: encode + EOD"]
#   D --> W2["worker 2: encode + EOD"]
#   W1 --> P["parent: write in input order<br/>(IndexedDatasetBuilder)"]
#   W2 --> P
#   P --> A["part 0 .bin/.idx"]
#   P --> B["part 1 .bin/.idx"]
#   A --> M["merge (add_index)"]
#   B --> M
#   M --> F["prefix_text_document.bin/.idx"]
# ```

# %%
@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to rebuild the tokenizer: its kind and file."""

    kind: str = "byte"
    path: Optional[str] = None
    eod_token: str = "<|endoftext|>"
    pad_token: Optional[str] = None


EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")


# %% [markdown]
# A Hugging Face tokenizer file gets the three attributes the rest of the chapter reads: `eod`
# and `pad` found by name among the candidates above, and `vocab_size`. A missing EOD is an
# error that names the flag to pass.

# %%
class _HFTokenizer:
    """A `tokenizers.Tokenizer` with Megatron's `eod`, `pad` and `vocab_size` attributes."""

    def __init__(self, path: str, eod_token: str, pad_token: Optional[str] = None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception with a serde message
            raise ValueError(f"{path}: not a tokenizers JSON file ({err})") from None
        eod = self._tok.token_to_id(eod_token)
        if eod is None:
            has = [t for t in EOD_CANDIDATES if self._tok.token_to_id(t) is not None]
            raise ValueError(f"{path}: the tokenizer has no end-of-document token {eod_token!r}; "
                             "name its own with --eod-token (tinytron-preprocess) or "
                             "tokenizer.eod_token (tinytron-train)"
                             + (f", e.g. {has[0]!r}" if has else ""))
        self.eod, self.vocab_size = eod, self._tok.get_vocab_size()
        pads = (pad_token,) if pad_token else PAD_CANDIDATES
        found = [i for i in (self._tok.token_to_id(t) for t in pads) if i is not None]
        if pad_token and not found:
            raise ValueError(f"{path}: the tokenizer has no padding token {pad_token!r} "
                             "(tokenizer.pad_token)")
        self.pad = found[0] if found else -1  # -1: none (the datasets then pad with EOD)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


# %% [markdown]
# The end-of-document token is not the same in every family: `<|endoftext|>` in GPT-2 and in
# the BPEs trained here, `</s>` in Llama-2 and Mistral, `<|end_of_text|>` in Llama-3. It is
# named, never guessed: `--eod-token` here, recorded by id in the sidecar, and the trainer reads
# it back from there (or from `[tokenizer] eod_token`). When the token is missing, the error
# names the flag and a candidate the tokenizer does hold, so a Llama user sees `--eod-token`
# and `'</s>'` in one line. The pad token, which only the datasets' padding uses, is looked up
# among the usual names (`<|pad|>`, `<pad>`, `[PAD]`); a tokenizer with none records pad -1 and
# the datasets pad with EOD, whose loss is masked anyway.
#
# A spec becomes a tokenizer; a BPE is trained once, in the parent, and then read back as an
# `hf` tokenizer file by every worker.

# %%
def build_tokenizer(spec: TokenizerSpec):
    """The tokenizer a spec describes."""
    if spec.kind == "byte":
        from tinytron.overview.batch import ByteTokenizer

        return ByteTokenizer()
    if spec.kind == "hf":
        if not spec.path or not os.path.isfile(spec.path):
            raise ValueError(f"tokenizer file {spec.path!r} not found (--tokenizer-file)")
        return _HFTokenizer(spec.path, spec.eod_token, spec.pad_token)
    raise ValueError(f"unknown tokenizer kind {spec.kind!r}; expected 'byte', 'hf' or 'bpe'")


def train_bpe_tokenizer(texts: Iterator[str], vocab_size: int, out_path: str,
                        eod_token: str = "<|endoftext|>") -> str:
    """Train a byte-level BPE of `vocab_size` ids on `texts`; save tokenizer.json; return its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + 2:
        raise ValueError(f"vocab_size {vocab_size} must exceed the 256 byte symbols + 2 specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eod_token, "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_path))
    return str(out_path)

# %% [markdown]
# ## Inputs
#
# A JSONL line is one document (the text under `--json-keys`, default `text`); a plain text file
# is one document. Each document is one sequence, followed by EOD with `--append-eod`; an empty
# text becomes an empty document (no sequence, no EOD), exactly as `tools/preprocess_data.py`
# writes it, so the same tokenizer gives byte-identical files.
#
# With no `--input`, the corpus is every `.py` file of the running Python's
# standard library (`sysconfig.get_paths()["stdlib"]`, skipping `site-packages`): about 1,800
# files and 30 MB of real, varied text on any machine with Python.
#
# Text must be UTF-8. A byte that is not stops the command with the file and the byte offset
# (for JSONL: the file, the line and the offset), because replacing it silently changes the
# data; `--encoding-errors replace` turns such bytes into U+FFFD when that is what you want.
# The built-in stdlib corpus replaces by default: four of its test files are deliberately
# Latin-1 or KOI8-R.
#
# <details><summary>Megatron detail: a bare decode error</summary>
#
# Megatron's tool reads JSONL
# with Python's default decoding and fails with a bare `UnicodeDecodeError`.
#
# </details>

# %%
def stdlib_corpus(max_files: Optional[int] = None) -> list[str]:
    """Paths of the standard library's .py files, sorted, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise ValueError(f"no .py files under {root}: pass --input")
    return files[:max_files] if max_files else files


def iter_documents(inputs: Sequence[str], json_key: str = "text") -> Iterator[tuple[str, str]]:
    """(kind, payload) per document: ('file', path) for text files, ('text', str) for JSONL lines."""
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"input {path!r} is not a file")
        if path.endswith((".jsonl", ".json")):
            with open(path, "rb") as f:
                offset = 0
                for n, raw in enumerate(f, 1):
                    line = _decode_line(raw, path, n, offset)
                    offset += len(raw)
                    if line.strip():
                        yield "text", _json_text(line, json_key, path, n)
        else:
            yield "file", path


# %% [markdown]
# The two checks of a JSONL line, each with an error that names the file and the line: the
# bytes must be UTF-8, and the line must be a JSON object with a string under the key. A list
# there is most likely a chat, which the SFT dataset reads instead.

# %%
def _decode_line(raw: bytes, path: str, lineno: int, offset: int) -> str:
    """One JSONL line as text, or a ValueError naming the file, line and byte offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte {offset + err.start} of the "
                         f"file is {raw[err.start]:#04x})") from None


def _json_text(line: str, key: str, path: str, lineno: int) -> str:
    """The text under `key` of one JSONL line, or a ValueError naming file and line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
        chat = isinstance(obj, dict) and isinstance(obj.get(key), list)
        raise ValueError(f"{path}:{lineno}: no string field {key!r}" + (
            " (it holds a list: a chat? SFT reads the JSONL itself: tinytron-train "
            "--data.sft true --data.data_path FILE.jsonl)" if chat else ""))
    return obj[key]

# %% [markdown]
# A text file is read as bytes and decoded here, not by `open(..., encoding=...)`, so the
# error can name the byte offset; `newline=""` semantics (no translation) keep `\r\n` as
# written, so the tokens are those of the file on disk.

# %%
def _encode_text(doc: tuple[str, str], errors: str = "strict") -> str:
    kind, payload = doc
    return _read_file(payload, errors) if kind == "file" else payload


def _read_file(path: str, errors: str = "strict") -> str:
    """A text file exactly as stored (newline="" keeps \r\n); bytes that are not UTF-8 are an
    error naming the file and byte offset, or U+FFFD with errors="replace"."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 at byte {err.start} ({raw[err.start]:#04x}); "
                         "pass --encoding-errors replace to turn such bytes into U+FFFD") from None
    return text

# %% [markdown]
# ## Tokenizing in worker processes
#
# Each worker tokenizes one document at a time and returns its ids as a numpy array (one
# pickled buffer, not a list of Python ints); the parent writes them in input order, so the
# output does not depend on the number of workers. The progress bar counts input bytes.
#
# In-order is a choice: `pool.imap` returns results in the order the documents went in, where
# `imap_unordered` would return them as workers finish and so write a different `.bin` for each
# worker count. Megatron's tool makes the same choice (`pool.imap(encoder.encode, fin, 32)`,
# `tools/preprocess_data.py:160`), with chunks of 32 JSON lines; tinytron sends 8 documents
# per chunk, because a document here may be a whole source file rather than one line. The
# parent is the only writer, so the builder never sees two documents interleaved. The demo
# below checks the claim: one worker and two workers give byte-identical files.

# %%
_WORKER: dict = {}


def _init_worker(spec: TokenizerSpec, append_eod: bool, dtype, errors: str = "strict") -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker
    _WORKER.update(tok=build_tokenizer(spec), append_eod=append_eod, dtype=dtype, errors=errors)


def _encode(doc: tuple[str, str]) -> tuple[np.ndarray, int]:
    """(token ids, input bytes) of one document."""
    kind, payload = doc
    text = _read_file(payload, _WORKER["errors"]) if kind == "file" else payload
    ids = _WORKER["tok"].encode(text)
    if _WORKER["append_eod"] and len(ids):  # as tools/preprocess_data.py: no EOD for empty text
        ids = list(ids) + [_WORKER["tok"].eod]
    return np.asarray(ids, dtype=_WORKER["dtype"]), len(text.encode("utf-8"))


# %% [markdown]
# One partition is one builder. With several workers the documents go to a pool and come back
# through `imap` in input order; with one, the same `_encode` runs in this process. Either way
# the parent alone appends.

# %%
def _write_partition(docs: Sequence, prefix: str, spec, append_eod, dtype, workers: int,
                     progress, errors: str = "strict") -> int:
    """Tokenize docs into prefix.bin/.idx; return the number of documents written."""
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    written = 0
    if workers > 1:
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        pool = ctx.Pool(workers, initializer=_init_worker,
                        initargs=(spec, append_eod, dtype, errors))
        results = pool.imap(_encode, docs, chunksize=8)
    else:
        pool = None
        _init_worker(spec, append_eod, dtype, errors)
        results = map(_encode, docs)
    try:
        for ids, nbytes in results:
            if ids.size:  # an empty text is an empty document: no sequence (like Megatron's tool)
                builder.add_item(ids)
            builder.end_document()
            written += 1
            if progress is not None:
                progress.update(nbytes)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    builder.finalize(get_idx_path(prefix))
    return written

# %% [markdown]
# ## The tokenizer sidecar
#
# A `.bin/.idx` pair holds token ids and nothing about the tokenizer that made them: the
# `.idx` starts with a magic string, a version and the dtype code, then the sizes
# (`megatron/core/datasets/indexed_dataset.py:147-151`). Data made with a BPE whose EOD is 0
# and pad is 1 then trains without complaint under the byte tokenizer, whose EOD is 256:
# documents are never split, and a real token is masked as padding. So beside the pair, whose
# bytes stay exactly Megatron's, the command writes `<prefix>.tokenizer_info.json` (the
# tokenizer's type, the SHA-256 of its file, the vocabulary size, EOD and pad), and the trainer
# compares it with its `[tokenizer]` before any process group exists. Data without a sidecar
# (made by Megatron's tool) still loads.
#
# <details><summary>Megatron detail: no sidecar</summary>
#
# The sidecar is tinytron's addition:
# Megatron relies on the training run's tokenizer flags matching the ones given to
# `tools/preprocess_data.py`.
#
# </details>

# %% [markdown]
# ## Partitions and merging
#
# Large corpora are processed in `--partitions` parts (each its own `.bin/.idx`, so a crash
# loses one part, not the whole run) and concatenated at the end with the builder's
# `add_index`, which offsets the document indices (`tools/merge_datasets.py` in Megatron).
# Datasets made with different tokenizers (their sidecars disagree) are not merged; a merge of
# datasets that share one sidecar gets that sidecar.
#
# The three-line corpus with `--partitions 2` splits at `linspace(0, 3, 3)` = documents
# [0 | 1, 2]. Part 0 has `sequence_lengths = [3]`, `document_indices = [0, 1]`; part 1 has
# `[4]` and `[0, 0, 1]` (the empty document first). Merging appends part 1's lengths and its
# document indices shifted by the one sequence already written, dropping the leading 0:
# `[0, 1] + [1, 2]` = `[0, 1, 1, 2]`, the same index the single partition wrote
# (`add_index`, `indexed_dataset.py:1003-1015`).

# %%
def merge_datasets(prefixes: Sequence[str], output_prefix: str) -> IndexedDataset:
    """Concatenate finished datasets (same dtype, same tokenizer) into output_prefix."""
    if not prefixes:
        raise ValueError("nothing to merge")
    sidecars = [read_sidecar(p) for p in prefixes]
    known = [(p, s) for p, s in zip(prefixes, sidecars) if s is not None]
    for p, s in known[1:]:
        if s != known[0][1]:
            raise ValueError(f"{p} and {known[0][0]} were tokenized differently "
                             f"({'; '.join(sidecar_mismatch(s, known[0][1]))}): not merged")
    dtype = IndexedDataset(prefixes[0]).dtype
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dtype)
    for p in prefixes:
        builder.add_index(p)
    builder.finalize(get_idx_path(output_prefix))
    if known and len(known) == len(prefixes):  # one tokenizer for all: the merge inherits it
        write_sidecar(output_prefix, known[0][1])
    return IndexedDataset(output_prefix)


# %% [markdown]
# The progress bar counts input bytes, not documents: a text file and a JSONL line differ by
# orders of magnitude in size, and bytes are what the workers' time follows.

# %%
def _progress_bar(docs):
    """A tqdm bar over input bytes (tqdm is in the `data` extra)."""
    from tqdm import tqdm

    total = sum(os.path.getsize(p) if kind == "file" else len(p.encode("utf-8")) for kind, p in docs)
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)


# %% [markdown]
# `preprocess` is one dataset from start to end: documents, the tokenizer and its dtype,
# one or several partitions, and the sidecar last, after the `.idx`, so a sidecar never
# describes a dataset that was not finished.

# %%
def preprocess(inputs: Optional[Sequence[str]], output_prefix: str, spec: TokenizerSpec,
               json_key: str = "text", append_eod: bool = True, workers: int = 1,
               partitions: int = 1, progress: bool = True, encoding_errors: str = "strict") -> str:
    """Tokenize inputs into `{output_prefix}_{json_key}_document` (+ its tokenizer sidecar).

    `encoding_errors` is for text files: "strict" (a ValueError naming the file and the byte
    offset of the first byte that is not UTF-8) or "replace" (such bytes become U+FFFD).
    """
    if encoding_errors not in ("strict", "replace"):
        raise ValueError(f"encoding_errors must be 'strict' or 'replace', got {encoding_errors!r}")
    docs = list(iter_documents(inputs or stdlib_corpus(), json_key))
    if not docs:
        raise ValueError(f"no documents found in {inputs}")
    tok = build_tokenizer(spec)
    dtype = optimal_dtype(tok.vocab_size)
    final = f"{output_prefix}_{json_key}_document"
    os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    bar = _progress_bar(docs) if progress else None
    parts = max(1, min(partitions, len(docs)))
    if parts == 1:
        _write_partition(docs, final, spec, append_eod, dtype, workers, bar, encoding_errors)
    else:
        bounds = np.linspace(0, len(docs), parts + 1).astype(int)
        names = [f"{final}.part{i}" for i in range(parts)]
        for i, name in enumerate(names):
            _write_partition(docs[bounds[i]:bounds[i + 1]], name, spec, append_eod, dtype, workers,
                             bar, encoding_errors)
        merge_datasets(names, final)
        for name in names:
            os.remove(get_bin_path(name))
            os.remove(get_idx_path(name))
    if bar is not None:
        bar.close()
    write_sidecar(final, describe_tokenizer(spec.kind, spec.path, tok))
    return final

# %% [markdown]
# ## The command line
#
# Flag names follow `tools/preprocess_data.py` (`--input`, `--json-keys`, `--output-prefix`,
# `--append-eod`, `--workers`, `--partitions`); the tokenizer flags are tinytron's own. As in
# Megatron, `--json-keys` takes several fields and writes one dataset per field. The command is
# also `python -m tinytron.data.preprocess ARGS` (Megatron's habit is `python tools/...py`); with
# no arguments that runs this page's demo instead. `--help` shows every default, the last line
# names the vocabulary size and the EOD and pad ids that training needs (`eod_id`, `pad_id`),
# and every bad input — a flag out of range, flags that contradict each other, a file that is
# not a tokenizer — is one `tinytron-preprocess: error: ...` line with exit status 2.
#
# The flags, their checks and that exit status live in `tinytron.data._preprocess_cli`, which
# this page imports `main`, `run` and `UsageError` from. Why exit status 2 and one line: a
# script that calls the command can tell "you asked for something impossible" (2, as argparse
# itself uses) from "it crashed" (1, with a traceback), and the one line names the flag or the
# file, so the fix is on the screen. Contradictions are refused rather than ignored:
# `--tokenizer-file` with `--tokenizer-type byte` would otherwise tokenize with bytes while the
# user believes their tokenizer was used, and every later number would be about the wrong data.
#
# ```
# tinytron-preprocess --output-prefix data/stdlib                       # stdlib, byte tokenizer
# tinytron-preprocess --input corpus.jsonl --output-prefix data/c --tokenizer-type bpe --vocab-size 4096
# tinytron-preprocess --input qa.jsonl --json-keys question answer --output-prefix data/qa
# tinytron-preprocess --merge data/a_text_document data/b_text_document --output-prefix data/ab
# ```

# %% [markdown]
# ## Demo: 40 stdlib files, two workers, two partitions, then a BPE

# %%
def _called_with_arguments() -> bool:
    """True for `python -m tinytron.data.preprocess ARGS` (a kernel's argv names ipykernel)."""
    return len(sys.argv) > 1 and Path(sys.argv[0]).name == "preprocess.py"


if __name__ == "__main__":
    if _called_with_arguments():  # the command line, not the demo
        sys.exit(main())
    import tempfile

    tmp = tempfile.mkdtemp()
    files = stdlib_corpus(40)
    one = run(["--input", *files, "--output-prefix", f"{tmp}/one", "--workers", "1", "--no-progress"])
    two = run(["--input", *files, "--output-prefix", f"{tmp}/two", "--workers", "2",
                "--partitions", "2", "--no-progress"])
    a, b = IndexedDataset(one), IndexedDataset(two)
    print("first document starts:", repr(bytes(a[0][:60].astype(np.uint8)).decode()))
    assert a.document_indices.tolist() == b.document_indices.tolist()
    assert Path(get_bin_path(one)).read_bytes() == Path(get_bin_path(two)).read_bytes()
    assert int(a[0][-1]) == 256  # EOD appended
    bpe = run(["--input", *files[:10], "--output-prefix", f"{tmp}/bpe", "--tokenizer-type", "bpe",
                "--vocab-size", "600", "--workers", "1", "--no-progress"])
    c = IndexedDataset(bpe)
    ratio = int(a.sequence_lengths[:len(c)].sum()) / int(c.sequence_lengths.sum())
    print(f"BPE(600) compresses the first 10 files {ratio:.2f}x vs bytes")
    assert ratio > 1.3

# %% [markdown]
# ## Summary
#
# * One JSON line or one text file is one document; EOD is appended by default.
# * Workers tokenize, the parent writes in input order: identical output for any worker count.
# * Partitions are merged with `add_index`; every write goes through the crash-safe builder.
#
# ## How production does it
#
# * Megatron: `tools/preprocess_data.py` (Encoder, partitions, `--append-eod`), and
#   `tools/merge_datasets.py`; the builder in `megatron/core/datasets/indexed_dataset.py:937`.
# * NeMo-Curator and datatrove do the cleaning and deduplication that should come before this.
#
# ## Exercises
#
# 1. Time the stdlib corpus with 1 and 2 workers. Where does the time go?
#    <details><summary>Hint</summary>
#
#    Profile `_encode` (reading, decoding, `tok.encode`) against
#    the parent's `builder.add_item` and the pickling of each returned array. Only `_encode`
#    runs in parallel; the parent's writes and the pool's start-up do not shrink with workers.
#
#    </details>
#
# 2. Train BPEs of 1k, 4k and 16k ids and plot tokens per byte.
#    <details><summary>Hint</summary>
#
#    Call `run` with `--tokenizer-type bpe --vocab-size V` as
#    the demo does for 600, and divide `sequence_lengths.sum()` by the input bytes. The byte
#    tokenizer is 1 token per byte; each larger vocabulary lowers the ratio, by less each time.
#
#    </details>
#
# 3. Kill a run mid-way (Ctrl-C): which files are left, and does the prefix open?
#    <details><summary>Hint</summary>
#
#    See `move_pair_into_place` on the
#    [indexed page](indexed.py): before `finalize` only `….bin.partial` exists (plus finished
#    `.partN` pairs with several partitions), so `IndexedDataset(prefix)` raises
#    `FileNotFoundError` for the `.idx`, and no sidecar was written.
#
#    </details>

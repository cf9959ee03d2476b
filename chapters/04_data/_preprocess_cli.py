"""The `tinytron-preprocess` command line: flags, their checks, exit status 2 on bad input.

The mechanism (tokenizers, inputs, workers, partitions, the sidecar) is the page
`chapters/04_data/preprocess.py`; this module is only how the shell reaches it. `main`, `run`
and `UsageError` are re-exported there, where the console script points.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import numpy as np

from tinytron.data._sidecar import sidecar_path
from tinytron.data.indexed import IndexedDataset

__all__ = ["UsageError", "main", "run"]


class UsageError(ValueError):
    """A bad command line: printed as one `error:` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised (one line, exit 2 from main) instead of printed."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tinytron-preprocess", description="Tokenize text into Megatron .bin/.idx files.")
    p.add_argument("--input", nargs="*", default=None,
                   help="JSONL (.jsonl/.json) or plain text files (default: the Python stdlib's .py files)")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="the JSONL field(s) holding the text, one output per key (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    p.add_argument("--tokenizer-type", choices=["byte", "hf", "bpe"], default="byte",
                   help="byte: UTF-8 bytes; hf: --tokenizer-file; bpe: trained on the input "
                        "(default: %(default)s)")
    p.add_argument("--tokenizer-file", default=None, help="tokenizer.json for --tokenizer-type hf")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="BPE vocabulary for --tokenizer-type bpe (default: %(default)s)")
    p.add_argument("--eod-token", default="<|endoftext|>",
                   help="end-of-document token of hf/bpe (default: %(default)s)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end every document with the EOD token (default: on)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokenizing processes (default: CPUs - 1 = %(default)s)")
    p.add_argument("--partitions", type=int, default=1,
                   help="parts written separately, then merged (default: %(default)s)")
    p.add_argument("--max-files", type=int, default=None, help="limit the default stdlib corpus")
    p.add_argument("--merge", nargs="+", default=None, metavar="PREFIX",
                   help="only merge these finished datasets into --output-prefix")
    p.add_argument("--encoding-errors", choices=["strict", "replace"], default=None,
                   help="text files that are not UTF-8: strict = stop, naming the file and byte "
                        "offset; replace = U+FFFD (default: strict for --input, replace for the "
                        "built-in stdlib corpus, a few of whose test files are Latin-1 or KOI8-R)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `tinytron-preprocess`: exit status 0, or 2 with a one-line error.

    Example (the shell command, or the same list from Python)::

        tinytron-preprocess --input corpus.jsonl --output-prefix data/corpus --workers 4
        main(["--input", "corpus.jsonl", "--output-prefix", "data/corpus"])   # -> 0
    """
    try:
        run(argv)
    except (ValueError, OSError) as err:  # bad input: say what, without a traceback
        print(f"tinytron-preprocess: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


def _check_args(args) -> None:
    """UsageError naming the flag when the flags contradict each other or are out of range."""
    for flag, value in (("--workers", args.workers), ("--partitions", args.partitions)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.tokenizer_file is not None and args.tokenizer_type != "hf":
        raise UsageError(f"--tokenizer-file is read only with --tokenizer-type hf, "
                         f"not {args.tokenizer_type} (it would be ignored)")
    if args.tokenizer_type == "hf" and args.tokenizer_file is None:
        raise UsageError("--tokenizer-type hf needs --tokenizer-file")
    if args.tokenizer_type == "bpe" and args.vocab_size < 258:
        raise UsageError(f"--vocab-size must be >= 258 for a BPE (256 byte symbols + EOD + pad), "
                         f"got {args.vocab_size}")


def run(argv: Optional[Sequence[str]] = None):
    """The command line's work, callable from Python; the written prefix (a list for several keys)."""
    from tinytron.data.preprocess import (TokenizerSpec, build_tokenizer, merge_datasets,
                                          preprocess, stdlib_corpus)

    args = _parser().parse_args(argv)
    _check_args(args)
    if args.merge:
        out = merge_datasets(args.merge, args.output_prefix)
        print(f"merged {len(args.merge)} datasets -> {args.output_prefix} ({len(out)} sequences)")
        return args.output_prefix
    inputs = args.input or stdlib_corpus(args.max_files)
    errors = args.encoding_errors or ("strict" if args.input else "replace")
    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_file, args.eod_token)
    if args.tokenizer_type == "bpe":
        spec = _train_bpe(args, inputs, errors)
    tok = build_tokenizer(spec)
    prefixes = [preprocess(inputs, args.output_prefix, spec, key, args.append_eod, args.workers,
                           args.partitions, not args.no_progress, errors)
                for key in args.json_keys]
    for prefix in prefixes:
        ds = IndexedDataset(prefix)
        print(f"wrote {prefix}.bin/.idx: {ds.document_count} documents, "
              f"{int(ds.sequence_lengths.sum()):,} tokens, dtype {np.dtype(ds.dtype).name}, "
              f"vocab {tok.vocab_size}, eod {tok.eod}, pad {tok.pad}"
              + (f", tokenizer {spec.path}" if spec.path else "")
              + f"; tokenizer recorded in {sidecar_path(prefix)}")
    return prefixes[0] if len(prefixes) == 1 else prefixes


def _train_bpe(args, inputs, errors: str = "strict") -> TokenizerSpec:
    """Train the BPE on every key's text; warn when it came out smaller than asked."""
    from tinytron.data.preprocess import (TokenizerSpec, _encode_text, build_tokenizer,
                                          iter_documents, train_bpe_tokenizer)

    path = f"{args.output_prefix}_tokenizer.json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    texts = (_encode_text(d, errors) for key in args.json_keys
             for d in iter_documents(inputs, key))
    spec = TokenizerSpec("hf", train_bpe_tokenizer(texts, args.vocab_size, path, args.eod_token),
                         args.eod_token)
    size = build_tokenizer(spec).vocab_size
    if size < args.vocab_size:
        print(f"tinytron-preprocess: warning: the BPE vocabulary has {size} ids, fewer than the "
              f"{args.vocab_size} asked (the input is too small to learn more merges)",
              file=sys.stderr)
    return spec

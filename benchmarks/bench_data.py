"""Index build and random access of GPTDataset vs a per-sample Python loop of Megatron's algorithm.

Corpus: 100M uint16 tokens in synthetic documents (lengths drawn like Megatron's MockGPTDataset,
1..4095 tokens); 1M training samples of 1024 tokens. Measures, side by side:
  * the whole index build (document, sample and shuffle index) with tinytron's vectorized numpy
    vs the straightforward per-sample loop transcription of helpers.cpp build_sample_idx (the loop
    is timed on a prefix of the samples and extrapolated linearly; the JSON says so);
  * the same whole build against megatron-core's own code (its numpy `_build_document_index` and
    `_build_shuffle_index`, its compiled `build_sample_idx`, its separate-final-epoch rule), in
    alternating rounds, CPU time and wall time, the three arrays checked equal
    (`whole_build_vs_megatron`); each of the three indexes alone against megatron-core's
    (`parts_vs_megatron`, same alternation); and the sample index alone against the compiled
    helper, best of nine alternating runs in CPU time; and the whole build once per fresh
    process, as a training run builds it (`cold_build_vs_megatron`);
  * random-access samples/s on a warm page cache: GPTDataset.query_tokens (the token window) and
    __getitem__ (the full sample dict), vs the per-sample reference lookup (per-token Python) and
    a Megatron-style lookup (IndexedDataset.get per part + one concatenate);
  * the blending index for 1M samples over two datasets (greedy rule).
Writes benchmarks/results/data.json.

    python benchmarks/bench_data.py [--tokens 100000000] [--samples 1000000] [--rounds 7]
        [--cold-rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tinytron.data._reference import (reference_blending_indices, reference_sample_idx,
                                      reference_sample_tokens)
from tinytron.data.blended import build_blending_indices
from tinytron.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split
from tinytron.data.gpt_indices import (build_document_sample_shuffle_indices, build_document_index,
                                       build_sample_index, build_shuffle_index,
                                       get_num_epochs, needs_separate_final_epoch)
from tinytron.data.indexed import IndexedDataset, get_bin_path, get_idx_path, write_index_bytes


def make_corpus(prefix: str, num_tokens: int, seed: int = 0) -> None:
    """Synthetic uint16 corpus of ~num_tokens tokens with MockGPTDataset-like document lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4096, size=num_tokens // 2048 + 16).astype(np.int64)
    cum = np.cumsum(lengths)
    lengths = lengths[: int(np.searchsorted(cum, num_tokens)) + 1]
    lengths[-1] -= int(lengths.sum() - num_tokens)
    tokens = rng.integers(0, 50000, size=num_tokens, dtype=np.uint16)
    tokens.tofile(get_bin_path(prefix))
    Path(get_idx_path(prefix)).write_bytes(
        write_index_bytes(np.uint16, lengths, np.arange(len(lengths) + 1)))


def time_it(fn, repeat: int = 3):
    """Best wall time of fn() over `repeat` runs, and its last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_build(ix: IndexedDataset, num_samples: int, seq_length: int, loop_fraction: float,
                rounds: int = 7):
    """Vectorized build vs the per-sample loop (loop on a prefix, extrapolated)."""
    docs = np.arange(len(ix), dtype=np.int32)
    sizes = np.array(ix.sequence_lengths)
    t_fast, (doc_idx, sample_idx, shuffle_idx) = time_it(
        lambda: build_document_sample_shuffle_indices(sizes, docs, num_samples, seq_length))
    # The loop version shares the document and shuffle shuffles (numpy calls in Megatron too);
    # only the sample index is a loop there. Time the loop on a prefix of the samples.
    tokens = int(sizes.sum())
    epochs = get_num_epochs(tokens, num_samples, seq_length)
    rng = np.random.RandomState(1234)
    t_doc, _ = time_it(lambda: build_document_index(docs, epochs, rng, False))
    t_shuf, _ = time_it(lambda: build_shuffle_index(num_samples, num_samples, rng))
    part = max(1000, int(num_samples * loop_fraction))
    part_tokens = part * seq_length + 1
    t0 = time.perf_counter()
    ref = reference_sample_idx(sizes, doc_idx, seq_length, 1, part_tokens)  # a prefix of the walk
    t_loop_part = time.perf_counter() - t0
    assert np.array_equal(ref[:part + 1], sample_idx[:part + 1]), "vectorized != loop"
    t_loop = t_loop_part * (num_samples / part) + t_doc + t_shuf  # the numpy shuffles are shared
    cpp = _time_megatron_cpp(sizes, doc_idx, seq_length, epochs, tokens, sample_idx, t_doc, t_shuf,
                             t_fast)
    cpp.update(bench_whole_build(sizes, docs, num_samples, seq_length, rounds))
    cpp.update(bench_parts(sizes, docs, num_samples, seq_length, rounds))
    return {"samples": int(len(sample_idx) - 1), "epochs": epochs, **cpp,
            "vectorized_build_s": t_fast, "loop_sample_index_s_measured": t_loop_part,
            "loop_samples_measured": part, "loop_build_s_extrapolated": t_loop,
            "build_speedup_vs_extrapolated_loop": t_loop / t_fast}, (doc_idx, sample_idx, shuffle_idx)


def _megatron_helpers():
    """Megatron's compiled helpers: a build named by TINYTRON_MEGATRON_HELPERS (e03878b5f), else
    the extension the megatron-core wheel ships (a test dependency), else None."""
    import importlib
    import sys

    folder = os.environ.get("TINYTRON_MEGATRON_HELPERS")
    if folder:
        sys.path.insert(0, folder)
        return importlib.import_module("helpers_cpp"), "TINYTRON_MEGATRON_HELPERS build"
    try:
        return importlib.import_module("megatron.core.datasets.helpers_cpp"), "megatron-core wheel"
    except ImportError:
        return None, None


def _time_megatron_cpp(sizes, doc_idx, seq_length, epochs, tokens, ours, t_doc, t_shuf,
                       t_ours_whole) -> dict:
    """Megatron's compiled build_sample_idx side by side with ours (the sample index alone)."""
    helpers, source = _megatron_helpers()
    if helpers is None:
        return {}
    def cpu(fn):
        c0 = time.process_time()
        out = fn()
        return time.process_time() - c0, out

    runs = {"cpp": [], "numpy": []}
    for _ in range(9):  # alternating, best of nine each, CPU time (wall is the machine's load)
        t, ref = cpu(lambda: helpers.build_sample_idx_int32(sizes, doc_idx, seq_length, epochs,
                                                            tokens, True, 1))
        runs["cpp"].append(t)
        runs["numpy"].append(cpu(lambda: build_sample_index(sizes, doc_idx, seq_length, epochs,
                                                            tokens))[0])
    assert np.array_equal(ref, ours), "numpy sample index != Megatron's helpers.cpp"
    t, t_np = min(runs["cpp"]), min(runs["numpy"])
    return {"megatron_helpers": source, "megatron_cpp_sample_index_s": t,
            "numpy_sample_index_s": t_np, "sample_index_vs_megatron_cpp": t_np / t}


def megatron_whole_build(sizes, docs, num_samples: int, seq_length: int, helpers, seed=1234):
    """Megatron's three tables with megatron-core's own code: its numpy document shuffle
    (`_build_document_index`), the compiled `build_sample_idx`, its numpy sample shuffle
    (`_build_shuffle_index`), in its RNG order, with its separate-final-epoch rule
    (`GPTDataset._build_document_sample_shuffle_indices`: the last epoch is kept apart when it
    contributes fewer than 80% of an epoch's samples; add_extra_token = 1)."""
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    tokens = int(sizes[docs].sum(dtype=np.int64))
    epochs = get_num_epochs(tokens, num_samples, seq_length)
    separate, sans_final = False, 0
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens - 1) // seq_length
        separate = num_samples - sans_final < int(0.80 * ((tokens - 1) // seq_length))
    rng = np.random.RandomState(seed)
    doc_idx = _build_document_index(docs, epochs, rng, separate)
    sample_idx = helpers.build_sample_idx_int32(sizes, doc_idx, seq_length, epochs, tokens,
                                                True, 1)
    n = sample_idx.shape[0] - 1
    shuffle_idx = _build_shuffle_index(sans_final if separate else n, n, rng)
    return doc_idx, sample_idx, shuffle_idx


def bench_whole_build(sizes, docs, num_samples: int, seq_length: int, rounds: int) -> dict:
    """Ours vs megatron-core's whole index build, alternating round by round (and which of the
    two goes first), both clocks.

    The ratio is the median of per-round ratios (ours / Megatron); the arrays must be equal.
    """
    helpers, source = _megatron_helpers()
    if helpers is None:
        return {}
    ours = build_document_sample_shuffle_indices(sizes, docs, num_samples, seq_length)
    theirs = megatron_whole_build(sizes, docs, num_samples, seq_length, helpers)
    for name, a, b in zip(("document", "sample", "shuffle"), ours, theirs):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{name} index differs from Megatron's"
    times = {c: {"ours": [], "megatron": []} for c in ("wall", "cpu")}
    sides = {"ours": lambda: build_document_sample_shuffle_indices(sizes, docs, num_samples,
                                                                   seq_length),
             "megatron": lambda: megatron_whole_build(sizes, docs, num_samples, seq_length,
                                                      helpers)}
    for r in range(rounds):  # who goes first alternates too: the second runs on a warmer heap
        for name, fn in list(sides.items())[::1 if r % 2 == 0 else -1]:
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            times["wall"][name].append(time.perf_counter() - w0)
            times["cpu"][name].append(time.process_time() - c0)
    ratio = {c: statistics.median(a / b for a, b in zip(t["ours"], t["megatron"]))
             for c, t in times.items()}
    return {"megatron_helpers": source, "whole_build_rounds": rounds,
            "whole_build_s_median": {c: {k: statistics.median(v) for k, v in t.items()}
                                     for c, t in times.items()},
            "whole_build_vs_megatron": ratio, "whole_build_per_round": times,
            "whole_build_arrays_identical": True}


def build_in_parts(sizes, docs, num_samples: int, seq_length: int, helpers=None,
                   seed: int = 1234) -> dict:
    """CPU seconds of the document, sample and shuffle index, one after the other in the RNG
    order: tinytron's builders, or (helpers given) megatron-core's `_build_document_index`,
    compiled `build_sample_idx` and `_build_shuffle_index`."""
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    tokens = int(sizes[docs].sum(dtype=np.int64))
    epochs = get_num_epochs(tokens, num_samples, seq_length)
    separate, before_last = needs_separate_final_epoch(epochs, tokens, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    c0 = time.process_time()
    doc_idx = (build_document_index if helpers is None else _build_document_index)(
        docs, epochs, rng, separate)
    c1 = time.process_time()
    if helpers is None:
        sample_idx = build_sample_index(sizes, doc_idx, seq_length, epochs, tokens)
    else:
        sample_idx = helpers.build_sample_idx_int32(sizes, doc_idx, seq_length, epochs, tokens,
                                                    True, 1)
    c2 = time.process_time()
    n = sample_idx.shape[0] - 1
    (build_shuffle_index if helpers is None else _build_shuffle_index)(
        before_last if separate else n, n, rng)
    c3 = time.process_time()
    return {"document": c1 - c0, "sample": c2 - c1, "shuffle": c3 - c2}


def bench_parts(sizes, docs, num_samples: int, seq_length: int, rounds: int) -> dict:
    """Where the whole build's time goes: each index alone, ours vs megatron-core's, alternating
    round by round (CPU time; the ratio is the median of per-round ratios)."""
    helpers, _ = _megatron_helpers()
    if helpers is None:
        return {}
    times = {side: {part: [] for part in ("document", "sample", "shuffle")}
             for side in ("ours", "megatron")}
    for r in range(rounds):
        for side, h in (("ours", None), ("megatron", helpers))[::1 if r % 2 == 0 else -1]:
            for part, t in build_in_parts(sizes, docs, num_samples, seq_length, h).items():
                times[side][part].append(t)
    return {"parts_cpu_s_median": {side: {p: statistics.median(v) for p, v in t.items()}
                                   for side, t in times.items()},
            "parts_vs_megatron": {p: statistics.median(a / b for a, b in zip(
                times["ours"][p], times["megatron"][p])) for p in times["ours"]}}


def _cold_build(prefix: str, side: str, num_samples: int, seq_length: int) -> None:
    """One whole build in this fresh process, ours or megatron-core's; prints its CPU seconds."""
    ix = IndexedDataset(prefix)
    sizes, docs = np.array(ix.sequence_lengths), np.arange(len(ix), dtype=np.int32)
    helpers, _ = _megatron_helpers()
    import megatron.core.datasets.gpt_dataset  # noqa: F401  (imported before the clock starts)

    c0 = time.process_time()
    if side == "ours":
        build_document_sample_shuffle_indices(sizes, docs, num_samples, seq_length)
    else:
        megatron_whole_build(sizes, docs, num_samples, seq_length, helpers)
    print(json.dumps({"cpu_s": time.process_time() - c0}))


def bench_cold_build(prefix: str, num_samples: int, seq_length: int, rounds: int) -> dict:
    """The whole build once per fresh process, as a training run builds it: every array on
    memory the process never touched before (its page faults included), the two sides
    alternating process by process and in which goes first; CPU time of the build alone."""
    if _megatron_helpers()[0] is None:
        return {}
    times = {"ours": [], "megatron": []}
    for r in range(rounds):
        for side in ("ours", "megatron")[::1 if r % 2 == 0 else -1]:
            out = subprocess.run([sys.executable, __file__, "--cold-side", side, "--cold-prefix",
                                  prefix, "--samples", str(num_samples), "--seq-length",
                                  str(seq_length)], check=True, capture_output=True, text=True)
            times[side].append(json.loads(out.stdout.strip().splitlines()[-1])["cpu_s"])
    return {"cold_build_cpu_s_median": {k: statistics.median(v) for k, v in times.items()},
            "cold_build_vs_megatron": statistics.median(
                a / b for a, b in zip(times["ours"], times["megatron"])),
            "cold_build_per_round": times}


def megatron_style_lookup(ix, doc_idx, sample_idx, shuffle_idx, idx: int, extra: int = 1):
    """Megatron's lookup as written there: IndexedDataset.get per part, then one concatenate."""
    j = shuffle_idx[idx]
    d0, o0 = sample_idx[j]
    d1, o1 = sample_idx[j + 1]
    if d0 == d1:
        parts = [ix.get(doc_idx[d0], offset=int(o0), length=int(o1 - o0 + extra))]
    else:
        parts = [ix.get(doc_idx[i], offset=int(o0) if i == d0 else 0,
                        length=None if i < d1 else int(o1 + extra)) for i in range(d0, d1 + 1)]
    return np.concatenate(parts, dtype=np.int64)


def bench_access(ix: IndexedDataset, prefix: str, tables, num_samples: int, seq_length: int,
                 n_fast: int, n_loop: int, cache: str):
    """Random samples/s: query_tokens, full __getitem__, and the reference lookup."""
    cfg = GPTDatasetConfig(sequence_length=seq_length, split="100,0,0", path_to_cache=cache,
                           create_attention_mask=False)
    ds = GPTDataset(ix, prefix, np.arange(len(ix), dtype=np.int32), num_samples, Split.train, cfg)
    rng = np.random.default_rng(1)
    order = rng.integers(0, len(ds), size=n_fast).tolist()
    for i in order:  # warm the page cache once so every reader below sees the same warm file
        ds.query_tokens(i)
    t_q, _ = time_it(lambda: [ds.query_tokens(int(i)) for i in order], repeat=3)
    t_item, _ = time_it(lambda: [ds[int(i)] for i in order[: n_fast // 2]], repeat=3)
    doc_idx, sample_idx, shuffle_idx = ds.document_index, ds.sample_index, ds.shuffle_index
    t_ref, _ = time_it(lambda: [reference_sample_tokens(ix, doc_idx, sample_idx, shuffle_idx, int(i),
                                                        seq_length) for i in order[:n_loop]], repeat=1)
    t_meg, _ = time_it(lambda: [megatron_style_lookup(ix, doc_idx, sample_idx, shuffle_idx, int(i))
                                for i in order[: n_fast // 2]], repeat=3)
    for i in order[:20]:
        assert np.array_equal(ds.query_tokens(int(i)), reference_sample_tokens(
            ix, doc_idx, sample_idx, shuffle_idx, int(i), seq_length))
    return {"query_tokens_samples_per_s": n_fast / t_q,
            "getitem_samples_per_s": (n_fast // 2) / t_item,
            "loop_lookup_samples_per_s": n_loop / t_ref,
            "megatron_style_lookup_samples_per_s": (n_fast // 2) / t_meg,
            "access_speedup": (n_fast / t_q) / (n_loop / t_ref)}


def bench_blend(size: int, loop_size: int):
    """Greedy blending index for two datasets, 0.3/0.7."""
    w = [0.3, 0.7]
    t_fast, (di, dsi) = time_it(lambda: build_blending_indices(w, size), repeat=1)
    t0 = time.perf_counter()
    ref_di, ref_dsi = reference_blending_indices(w, loop_size)
    t_loop = (time.perf_counter() - t0) * size / loop_size
    assert np.array_equal(ref_di, di[:loop_size]) and np.array_equal(ref_dsi, dsi[:loop_size])
    return {"blend_size": size, "blend_build_s": t_fast, "loop_blend_s_extrapolated": t_loop,
            "blend_speedup_vs_extrapolated_loop": t_loop / t_fast}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--loop-fraction", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=7,
                    help="alternating rounds of the whole-build comparison with megatron-core")
    ap.add_argument("--cold-rounds", type=int, default=5,
                    help="alternating pairs of fresh processes, one whole build each (~10 s a "
                         "process: each imports torch and megatron-core)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "data.json"))
    ap.add_argument("--cold-side", choices=("ours", "megatron"), help=argparse.SUPPRESS)
    ap.add_argument("--cold-prefix", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cold_side:  # one build in a fresh process, for bench_cold_build
        return _cold_build(args.cold_prefix, args.cold_side, args.samples, args.seq_length)
    load_start = list(os.getloadavg())  # other jobs on the machine slow every number down
    tmp = tempfile.mkdtemp()
    prefix = os.path.join(tmp, "corpus")
    t0 = time.perf_counter()
    make_corpus(prefix, args.tokens)
    ix = IndexedDataset(prefix)
    print(f"corpus: {args.tokens:,} tokens, {len(ix):,} documents ({time.perf_counter() - t0:.1f} s)")
    build, tables = bench_build(ix, args.samples, args.seq_length, args.loop_fraction,
                                args.rounds)
    build.update(bench_cold_build(prefix, args.samples, args.seq_length, args.cold_rounds))
    access = bench_access(ix, prefix, tables, args.samples, args.seq_length, 20000, 2000,
                          os.path.join(tmp, "cache"))
    blend = bench_blend(args.samples, args.samples // 20)
    env = ("TINYTRON_MEGATRON_HELPERS=<helpers.cpp build> "
           if os.environ.get("TINYTRON_MEGATRON_HELPERS") else "")
    if os.environ.get("OMP_NUM_THREADS"):
        env = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " + env
    result = {"command": env + "python benchmarks/bench_data.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k not in ("out", "cold_side", "cold_prefix")),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "load_average_at_start": load_start, "load_average_at_end": list(os.getloadavg()),
        "tokens": args.tokens, "documents": len(ix), "seq_length": args.seq_length,
        "note": "loop timings measured on a prefix (loop_samples_measured / blend size/20) and "
                "extrapolated linearly; the document/shuffle numpy shuffles are shared; "
                "whole_build and parts: one process, rounds alternating; cold_build: one fresh "
                "process per build",
        **build, **access, **blend}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"index build: vectorized {build['vectorized_build_s']:.3f} s vs a per-sample loop "
          f"extrapolated from {build['loop_samples_measured']:,} samples to "
          f"{build['loop_build_s_extrapolated']:.1f} s -> {build['build_speedup_vs_extrapolated_loop']:.0f}x "
          f"(against an extrapolated loop, not a measured one)")
    if "megatron_cpp_sample_index_s" in build:
        print(f"sample index alone (CPU time, best of 9): numpy "
              f"{build['numpy_sample_index_s']:.4f} s vs Megatron's compiled helpers.cpp "
              f"({build['megatron_helpers']}) {build['megatron_cpp_sample_index_s']:.4f} s -> "
              f"{build['sample_index_vs_megatron_cpp']:.2f}x its time (identical arrays)")
    if "whole_build_vs_megatron" in build:
        med, r = build["whole_build_s_median"], build["whole_build_vs_megatron"]
        print(f"whole index build (document shuffle + sample index + sample shuffle), "
              f"{build['whole_build_rounds']} alternating rounds: ours {med['wall']['ours']:.3f} s "
              f"vs megatron-core {med['wall']['megatron']:.3f} s (wall) -> {r['cpu']:.2f}x "
              f"(CPU time), {r['wall']:.2f}x (wall); identical arrays")
    if "parts_vs_megatron" in build:
        med, r = build["parts_cpu_s_median"], build["parts_vs_megatron"]
        print("each index alone (CPU time, median of the same rounds): " + "; ".join(
            f"{p} {1e3 * med['ours'][p]:.1f} ms vs {1e3 * med['megatron'][p]:.1f} ms -> {r[p]:.2f}x"
            for p in r))
    if "cold_build_vs_megatron" in build:
        med = build["cold_build_cpu_s_median"]
        print(f"whole build once per fresh process ({args.cold_rounds} alternating pairs, CPU "
              f"time): "
              f"ours {1e3 * med['ours']:.1f} ms vs megatron-core {1e3 * med['megatron']:.1f} ms -> "
              f"{build['cold_build_vs_megatron']:.2f}x")
    print(f"random access: query_tokens {access['query_tokens_samples_per_s']:,.0f}/s, "
          f"__getitem__ {access['getitem_samples_per_s']:,.0f}/s vs loop lookup "
          f"{access['loop_lookup_samples_per_s']:,.0f}/s -> {access['access_speedup']:.1f}x; "
          f"Megatron-style lookup (IndexedDataset.get + concatenate) "
          f"{access['megatron_style_lookup_samples_per_s']:,.0f}/s")
    print(f"blend index ({args.samples:,}): {blend['blend_build_s']:.3f} s vs loop "
          f"{blend['loop_blend_s_extrapolated']:.2f} s (extrapolated from a twentieth) -> "
          f"{blend['blend_speedup_vs_extrapolated_loop']:.1f}x")
    print(f"load average at start/end: {load_start[0]:.1f} / {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cpus; wrote {args.out}")


if __name__ == "__main__":
    main()

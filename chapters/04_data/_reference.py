"""Straightforward per-sample Python loops of Megatron's index helpers, for parity tests and benchmarks.

Each function transcribes the control flow of the C++ in `megatron/core/datasets/helpers.cpp`
(at e03878b5f) one step at a time, with no vectorization, so the fast numpy versions in
`tinytron.data.gpt_indices` and `tinytron.data.blended` can be checked against it:
`build_sample_idx` (`helpers.cpp:145`), `build_blending_indices` (`:77`),
`build_exhaustive_blending_indices` (`:22`), and a per-sample token lookup (`gpt_dataset.py:298`).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["reference_sample_idx", "reference_blending_indices",
           "reference_exhaustive_blending_indices", "reference_sample_tokens"]


def reference_sample_idx(sizes, document_index, seq_length: int, num_epochs: int,
                         tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                         add_extra_token: int = 1) -> np.ndarray:
    """Walk the documents token budget by token budget, recording (doc position, offset) per sample."""
    total = num_epochs * tokens_per_epoch - add_extra_token
    if drop_last_partial_sequence:
        num_samples = total // seq_length
    else:
        num_samples = math.ceil(float(np.float32(total)) / seq_length)
    out = [(0, 0)]
    doc_pos, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + add_extra_token
        while remaining != 0:
            doc_len = int(sizes[document_index[doc_pos]]) - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - add_extra_token
                remaining = 0
            else:
                if doc_pos == len(document_index) - 1:
                    assert len(out) == num_samples
                    offset = int(sizes[document_index[doc_pos]]) - add_extra_token
                    break
                doc_pos += 1
                offset = 0
        out.append((doc_pos, offset))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def reference_blending_indices(weights, size: int):
    """For each position, the dataset with the largest w_i * max(k, 1) - count_i (first on ties)."""
    counts = [0] * len(weights)
    dataset_index, dataset_sample_index = [], []
    for k in range(size):
        kk = max(float(k), 1.0)
        best, best_err = 0, weights[0] * kk - counts[0]
        for i in range(1, len(weights)):
            err = weights[i] * kk - counts[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index.append(best)
        dataset_sample_index.append(counts[best])
        counts[best] += 1
    return np.array(dataset_index, dtype=np.int16), np.array(dataset_sample_index, dtype=np.int64)


def reference_exhaustive_blending_indices(sizes):
    """Use dataset i exactly sizes[i] times, same greedy rule over the datasets not yet used up."""
    total = sum(sizes)
    weights = [s / total for s in sizes]
    counts = [0] * len(sizes)
    unspent = sorted(i for i in range(len(sizes)) if sizes[i] > 0)
    dataset_index, dataset_sample_index = [], []
    k = 0
    while unspent:
        kk = max(float(k), 1.0)
        best, best_err = -1, -math.inf
        for i in unspent:
            err = weights[i] * kk - counts[i]
            if err > best_err:
                best, best_err = i, err
        dataset_index.append(best)
        dataset_sample_index.append(counts[best])
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
        k += 1
    return np.array(dataset_index, dtype=np.int16), np.array(dataset_sample_index, dtype=np.int64)


def reference_sample_tokens(indexed, document_index, sample_index, shuffle_index, idx: int,
                            seq_length: int, add_extra_token: int = 1, pad_id: int = -1):
    """The tokens of sample idx, read sequence part by sequence part as Megatron's lookup does."""
    j = int(shuffle_index[idx])
    d0, o0 = (int(v) for v in sample_index[j])
    d1, o1 = (int(v) for v in sample_index[j + 1])
    parts = []
    if d0 == d1:
        parts.append(indexed.get(int(document_index[d0]), o0, o1 - o0 + add_extra_token))
    else:
        for i in range(d0, d1 + 1):
            off = o0 if i == d0 else 0
            length = None if i < d1 else o1 + add_extra_token
            parts.append(indexed.get(int(document_index[i]), off, length))
    tokens = [int(t) for part in parts for t in part]
    tokens += [pad_id] * (seq_length + add_extra_token - len(tokens))
    return np.array(tokens, dtype=np.int64)

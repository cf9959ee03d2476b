"""Numbers the book's prose states, against what the code computes (the learner's hand checks):
07.5's peak activations, 06's s^2 share of a layer, 05's collective counts on the running
example, and 05's golden-count rationale (a hook fires once per accumulating backward pass)."""

from __future__ import annotations

import re

import torch

from tests.conftest import ROOT

CHAPTERS = ROOT / "chapters"


def _text(page: str) -> str:
    return (CHAPTERS / page).read_text()


def test_ledger_prose_states_the_computed_peak_activations():
    from tinytron.memory.ledger import MemoryConfig, stage_ledgers
    from tinytron.model.config import llama_7b_config

    example = MemoryConfig(llama_7b_config(sequence_parallel=True,
                                           recompute_granularity="selective"),
                           tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                           data_parallel_size=64, micro_batch_size=2, num_microbatches=8,
                           use_distributed_optimizer=True)
    got = [f"{led.device['activations'] / 2**30:.2f}" for led in stage_ledgers(example)]
    row = re.search(r"\| activations at the peak \| ([\d.]+) GiB[^|]*\| ([\d.]+) GiB",
                    _text("07_memory/ledger.py"))
    assert row and list(row.groups()) == got


def test_recompute_prose_states_the_s_squared_share():
    from tinytron.model.config import llama_7b_config
    from tinytron.recompute.activation_memory import layer_activation_terms

    terms = layer_activation_terms(llama_7b_config(dropout=0.1, sequence_parallel=True), tp=2,
                                   micro_batch_size=2)
    core = terms["core_attn"]
    square = sum(n * b for k, (n, b) in core.items() if k not in ("q", "k", "v")) / 2**30
    stated = re.search(r"\$s\^2\$ tensors \([^)]*\) are\s*#?\s*([\d.]+) of",
                       _text("06_recompute_offload/activation_memory.py"))
    assert stated and float(stated.group(1)) == round(square, 2)


def test_naive_ddp_prose_counts_are_the_running_examples():
    text = _text("05_buffers/naive_ddp.py")
    assert "Llama" not in text and "291" not in text
    calls = re.search(r"\$(\d+) \\cdot 2 \\cdot 63 = ([\d{},]+)\$.*?\$(\d+) \\cdot 126 = ([\d{},]+)\$",
                      text, flags=re.S)
    assert calls
    naive, naive_steps, buckets, bucket_steps = calls.groups()
    assert (int(naive), int(buckets)) == (97, 17)
    assert int(naive_steps.replace("{,}", "")) == 97 * 2 * 63
    assert int(bucket_steps.replace("{,}", "")) == 17 * 126


def test_a_weight_used_twice_fires_its_hook_once_unless_recomputed_reentrantly():
    from torch.utils.checkpoint import checkpoint

    w = torch.nn.Linear(4, 4, bias=False)
    calls = []
    w.weight.register_post_accumulate_grad_hook(calls.append)
    x = torch.randn(2, 4)
    w(torch.tanh(w(x))).sum().backward()
    assert len(calls) == 1
    w(torch.tanh(checkpoint(w, x.requires_grad_(), use_reentrant=True))).sum().backward()
    assert len(calls) == 3
    text = _text("05_buffers/distributed_data_parallel.py")
    assert not re.search(r"shared weight\) and then fires twice", text)

"""The host-read recorder of chapter 01's host-syncs page: it counts by site, restores torch,
and on a GPU the model asks the device for nothing."""

from __future__ import annotations

import pytest
import torch

from tinytron.main_loop._host_reads import READS, record_host_reads
from tinytron.model._checks import check_ids


def test_reads_are_counted_by_the_tinytron_function_and_torch_is_restored():
    before = {name: torch.Tensor.__dict__.get(name) for name in READS}
    tokens = torch.tensor([[1, 5, 7]])
    float(tokens.sum())                                   # outside the block: not counted
    with record_host_reads() as reads:
        check_ids(tokens, "input_ids", 8)                 # the model's host check: min and max
        bool(tokens.sum() > 0)                            # this test is not tinytron code
    # called from this test, check_ids has no tinytron caller in another file to name
    assert reads == {("model/_checks.py:<genexpr>", "__int__"): 2, ("outside tinytron", "__bool__"): 1}
    assert {name: torch.Tensor.__dict__.get(name) for name in READS} == before
    with record_host_reads() as again:
        pass
    assert not again and bool(torch.tensor(1)) and float(torch.tensor(2.5)) == 2.5


def test_a_failing_block_still_restores_torch():
    before = {name: torch.Tensor.__dict__.get(name) for name in READS}
    with pytest.raises(ValueError, match="input_ids"):
        with record_host_reads():
            check_ids(torch.tensor([[9]]), "input_ids", 8)
    assert {name: torch.Tensor.__dict__.get(name) for name in READS} == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_model_reads_nothing_from_the_device():
    from tinytron.model import GPTModel
    from tinytron.model.config import tiny_config

    cfg = tiny_config()
    model = GPTModel(cfg, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device="cuda")
    model(tokens, labels=tokens)                          # builds the RoPE tables once
    with record_host_reads() as reads:
        model(tokens, labels=tokens).mean().backward()
    assert not reads, dict(reads)

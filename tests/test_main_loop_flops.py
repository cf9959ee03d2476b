"""Chapter 01's FLOP count and log line: a counter on real runs, a hand count, Megatron, peaks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from tinytron.main_loop.training_log import (LogState, flops_terms, format_log_line,
                                             gpu_peak_flops, measured_matmul_peak,
                                             megatron_flops_terms,
                                             megatron_num_floating_point_operations,
                                             num_floating_point_operations, peak_flops_per_device,
                                             training_log)
from tinytron.model import GPTModel, llama_7b_config, tiny_config

CFG = tiny_config()   # h 64, L 2, 4 heads in 2 KV groups (GQA), f 128, V 512, s 64


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _counted(model, batch: int = 2, early_stop: bool = False) -> tuple[int, int]:
    """(forward, backward) FLOPs counted on one real step, math attention (dense s^2 matmuls)."""
    x = torch.randint(0, CFG.vocab_size, (batch, CFG.seq_length),
                      generator=torch.Generator().manual_seed(0))
    # a recomputed region re-runs whole, as Megatron's checkpoint does (PyTorch's non-reentrant
    # checkpoint would otherwise stop before the region's last matmul, whose output no one saved)
    with sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(early_stop):
        with FlopCounterMode(display=False) as fwd:
            loss = model(x, labels=x).mean()
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("tie", [True, False])
def test_formula_equals_the_flop_counter_on_a_real_forward_and_backward(tie):
    cfg = CFG.replace(tie_embeddings=tie)
    fwd, bwd = _counted(GPTModel(cfg))
    assert bwd == 2 * fwd
    assert fwd + bwd == num_floating_point_operations(cfg, 2, attention="dense")


def test_formula_equals_a_hand_count_of_the_matmuls():
    """Every matmul of one training step of the tiny model, listed by shape and counted by hand."""
    h, L, a, g, d, f, V, s, B = 64, 2, 4, 2, 16, 128, 512, 64, 2
    T = B * s
    per_layer = [(T, h, (a + 2 * g) * d),    # fused QKV: 4 query heads + 2 K + 2 V heads of 16
                 (T, a * d, h),              # attention output projection
                 (T, h, 2 * f),              # SwiGLU gate and up, stacked
                 (T, f, h)]                  # down projection
    attention = [(s, d, s), (s, s, d)]       # q k^T and p v, per sequence and query head
    forward = sum(2 * n * k * m for n, k, m in per_layer) * L
    forward += sum(2 * n * k * m for n, k, m in attention) * B * a * L
    forward += 2 * T * h * V                 # logits; the input embedding is a lookup
    assert 3 * forward == num_floating_point_operations(CFG, B, attention="dense") == 94_371_840
    causal_pairs, dense_pairs = s * (s + 1) // 2, s * s
    diff = 3 * 2 * 2 * a * d * L * B * (dense_pairs - causal_pairs)
    assert num_floating_point_operations(CFG, B) == 3 * forward - diff


def _checkpointed(model: GPTModel, granularity: str) -> GPTModel:
    """Recompute each layer ('full') or each core attention ('selective') in backward."""
    for layer in model.decoder.layers:
        target = layer if granularity == "full" else layer.self_attention
        name = "forward" if granularity == "full" else "_attend"
        original = getattr(target, name)
        setattr(target, name, lambda *a, _f=original: checkpoint(_f, *a, use_reentrant=False))
    return model


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_term_equals_the_counted_recomputation(granularity):
    fwd, bwd = _counted(_checkpointed(GPTModel(CFG), granularity))
    assert fwd + bwd == num_floating_point_operations(CFG, 2, attention="dense",
                                                      recompute=granularity)
    assert flops_terms(CFG, 2, attention="dense", recompute=granularity)["recompute"] == \
        bwd - 2 * fwd                    # backward = its own 2x forward + the re-run forward
    if granularity == "full":            # PyTorch's early stop skips each layer's down projection
        _, bwd_early = _counted(_checkpointed(GPTModel(CFG), granularity), early_stop=True)
        assert bwd - bwd_early == 2 * (2 * CFG.seq_length) * CFG.ffn_hidden_size * 64 * 2


def test_running_example_and_megatron_formula():
    cfg, gbs = llama_7b_config(), 1024
    ours, meg = num_floating_point_operations(cfg, gbs), megatron_num_floating_point_operations(cfg, gbs)
    # Megatron's number: its num_floating_point_operations (megatron/training/training.py:411 at
    # e03878b5f) run on args h 4096, L 32, 32 heads, 8 groups, kv_channels 128, ffn 14336,
    # swiglu, padded vocab 128256, seq 4096, batch 1024 -> 2.0237171216193946e+17
    assert meg == 202_371_712_161_939_456
    assert ours == 202_375_010_696_822_784
    assert ours - meg == 6 * 4096 * 4096 * 32 * gbs       # the causal diagonal, s/2 pairs a row
    terms, mterms = flops_terms(cfg, gbs), megatron_flops_terms(cfg, gbs)
    assert terms["qkv"] + terms["attention_output"] == mterms["attention_projections"]
    assert (terms["mlp"], terms["logits"]) == (mterms["mlp"], mterms["logits"])
    # Megatron's tiny-config number the same way: 88080384
    assert megatron_num_floating_point_operations(CFG, 2) == 88_080_384
    per_token_8k = num_floating_point_operations(cfg, 1, seq_length=8192) / 8192
    assert abs(per_token_8k / 1e9 - 51.5) < 0.05              # NeMo's 744 TFLOP/s / 14451 tok/s
    assert num_floating_point_operations(cfg.replace(tie_embeddings=False), gbs) == ours
    with pytest.raises(ValueError, match="recompute must be None, 'full' or 'selective'"):
        flops_terms(cfg, 1, recompute="block")


def test_peak_table_and_measured_peak():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("NVIDIA GB200") == 2500e12 and gpu_peak_flops("NVIDIA B200") == 2250e12
    assert gpu_peak_flops("NVIDIA L40S") == 362e12 and gpu_peak_flops("NVIDIA L4") == 121e12
    assert gpu_peak_flops("Tesla V100-SXM2-32GB") is None       # no bf16: no MFU, not a guess
    assert measured_matmul_peak("cpu", n=256, repeats=2) > 1e8


def test_training_log_averages_advanced_iterations_and_counts_skips():
    state = LogState(last_time=0.0)
    kw = dict(train_iters=5, learning_rate=1e-3, loss_scale=1.0, grad_norm=0.5,
              num_zeros_in_grad=None, skipped_train_samples=0, batch_size=8, seq_length=64,
              flops=10 ** 12, world_size=2, peak_flops=1e12, log_interval=2)
    steps = [({"lm loss": torch.tensor(2.0)}, 0), ({"lm loss": torch.tensor(4.0)}, 0),
             ({"lm loss": torch.tensor(math.inf)}, 1), ({"lm loss": torch.tensor(6.0)}, 0)]
    records = []
    for i, (loss, skipped) in enumerate(steps, start=1):
        r = training_log(loss, state, iteration=i, skipped_iter=skipped,
                         consumed_train_samples=8 * i, now=float(i), **kw)
        records.append(r)
    first, second, none, fourth = records
    assert none is None
    assert first["losses"]["lm loss"] == 2.0                    # printed, not reset
    assert second["losses"]["lm loss"] == 3.0                   # iterations 1 and 2
    assert (second["ms_per_iteration"], second["tokens_per_second"]) == (1000.0, 512.0)
    assert fourth["losses"]["lm loss"] == 6.0                   # the inf iteration is left out
    assert (fourth["skipped_iterations"], fourth["nan_iterations"]) == (1, 1)
    assert fourth["tflops_per_device"] == 0.5 and fourth["mfu"] == 0.5  # 2e12 / 2 s / 2 devices
    # a first line on an interval boundary (log_interval 1, or a resume at a multiple of it)
    # resets, so the next line does not count that iteration again
    state = LogState(last_time=0.0)
    one = dict(kw, log_interval=1)
    lines = [training_log({"lm loss": torch.tensor(v)}, state, iteration=i, skipped_iter=0,
                          consumed_train_samples=8 * i, now=float(i), **one)
             for i, v in ((5, 2.0), (6, 4.0))]
    assert [r["losses"]["lm loss"] for r in lines] == [2.0, 4.0]
    line = format_log_line(fourth)
    assert "number of skipped iterations:   1" in line and "MFU: 50.0%" in line


@pytest.mark.gpu
def test_gpu_peak_is_known_and_counter_agrees_on_cuda():
    assert peak_flops_per_device("cuda") is not None, torch.cuda.get_device_name()
    model = GPTModel(CFG, device="cuda")
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length), device="cuda")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, labels=x).mean().backward()
    assert counter.get_total_flops() == num_floating_point_operations(CFG, 2, attention="dense")

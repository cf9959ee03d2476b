"""Appendix C on CUDA: the Triton kernels compiled, at the shapes of a ~1B model (Llama-3.2-1B:
h 2048, 32 query / 8 key-value heads of 64, f 8192, V 128256; one sequence of 2048 tokens) and
with the running example's head size 128, against the same torch references as the CPU tests.
Skipped without a GPU (and under the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from tinytron.kernels import (HAS_TRITON, INTERPRET, FlatAdamW, attention_reference, cross_entropy,
                              flash_attention, rms_norm, rms_norm_forward_bound,
                              rms_norm_reference, swiglu,
                              swiglu_reference, vocab_parallel_cross_entropy_reference)
from tinytron.parallel import ParallelGrid

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
              pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1: kernels are not compiled")]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, TOKENS = 2048, 32, 8, 64, 8192, 128256, 2048
BF16_TOL = 2 ** -6


def rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def both(fns, inputs, grad_out):
    """[output, grads...] of each fn on fresh leaves of the same inputs."""
    out = []
    for fn in fns:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.backward(grad_out)
        out.append([y] + [t.grad for t in leaves])
    return out


def test_rmsnorm_compiled():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).bfloat16()
    dy = torch.randn_like(x)
    kernel, ref = both([rms_norm, rms_norm_reference], [x, w], dy)
    # Not bitwise: the kernel sums the squares in another order and takes 1/sqrt with PTX's
    # sqrt.approx/div.full. Page C.1 derives the bound: each output within |w| (rho |n| + one
    # bf16 step of the normalized value n) + one step of y, rho = (h + 16) 2^-24, and at most
    # (h + 16) / 2^16 of the outputs moved at all.
    gap = (kernel[0].float() - ref[0].float()).abs()
    bound = rms_norm_forward_bound(x, w)
    assert bool((gap <= bound).all()), (gap / bound).max().item()
    assert int((gap > 0).sum()) <= x.numel() * (HIDDEN + 16) / 2 ** 16
    assert rel_gap(kernel[1], ref[1]) < BF16_TOL and rel_gap(kernel[2], ref[2]) < BF16_TOL


def test_swiglu_compiled():
    x = (2 * torch.randn(TOKENS, 2 * FFN, device="cuda")).bfloat16()
    dy = torch.randn(TOKENS, FFN, device="cuda").bfloat16()
    kernel, ref = both([swiglu, swiglu_reference], [x], dy)
    assert rel_gap(kernel[0], ref[0]) < BF16_TOL and rel_gap(kernel[1], ref[1]) < BF16_TOL


def test_cross_entropy_compiled_at_a_full_vocabulary():
    logits = (4 * torch.randn(TOKENS, VOCAB, device="cuda")).bfloat16()
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    dloss = torch.rand(TOKENS, device="cuda")
    out = []
    for fused in (True, False):
        z = logits.clone().requires_grad_()
        loss = (cross_entropy(z, labels) if fused else
                vocab_parallel_cross_entropy_reference(z.float(), labels, ParallelGrid.single()))
        loss.backward(dloss)
        out.append((loss, z.grad))
    assert rel_gap(out[0][0], out[1][0]) < 1e-5 and rel_gap(out[0][1], out[1][1]) < BF16_TOL


@pytest.mark.parametrize("heads,kv_heads,seq,head_dim,causal", [
    (HEADS, KV_HEADS, TOKENS, HEAD_DIM, True),   # the ~1B model's attention
    (16, 4, 1000, 128, True),                    # the running example's TP rank, ragged length
    (4, 1, 4096, 128, True),                     # 7B: 32/8 heads of 128 at TP 8, s = 4096
    (8, 2, 777, 128, False),                     # head size 128, grouped, not causal
    (4, 4, 300, 64, False),
])
def test_flash_attention_compiled(heads, kv_heads, seq, head_dim, causal):
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q, do = (torch.randn(1, heads, seq, head_dim, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, seq, head_dim, device="cuda", generator=gen) for _ in range(2))
    truth = both([lambda *t: attention_reference(*t, causal=causal)], [q, k, v], do)[0]
    bf16 = both([lambda *t: flash_attention(*t, causal=causal)],
                [t.bfloat16() for t in (q, k, v)], do.bfloat16())[0]
    for name, a, b in zip(("o", "dq", "dk", "dv"), bf16, truth):
        assert rel_gap(a, b) < BF16_TOL, (name, rel_gap(a, b))


def test_flash_attention_fp32_compiled_is_the_sdpa_call():
    """No fp32 tiles fit sm_80 without spills: compiled fp32 runs the SDPA call it replaces."""
    q = torch.randn(1, 8, 512, 128, device="cuda")
    k, v = torch.randn(1, 2, 512, 128, device="cuda"), torch.randn(1, 2, 512, 128, device="cuda")
    assert torch.equal(flash_attention(q, k, v), attention_reference(q, k, v))


@pytest.mark.parametrize("hidden", [4096, 8192])  # the 7B row, and the widest a program holds
def test_rmsnorm_compiled_at_wide_rows(hidden):
    x = torch.randn(512, hidden, device="cuda").bfloat16()
    w = torch.rand(hidden, device="cuda").bfloat16()
    dy = torch.randn_like(x)
    kernel, ref = both([rms_norm, rms_norm_reference], [x, w], dy)
    for a, b in zip(kernel, ref):
        assert rel_gap(a, b) < BF16_TOL


def test_fused_adamw_compiled_equals_chapter_02():
    from tinytron.optimizer.algorithms import AdamW

    numel = 10_000_000
    master = torch.nn.Parameter(torch.randn(numel, device="cuda"))
    plain = torch.nn.Parameter(master.detach().clone())
    grad_buffer = torch.zeros(numel + 1024, device="cuda")
    param_buffer = torch.zeros(numel + 1024, dtype=torch.bfloat16, device="cuda")
    inner, ref = AdamW([master], lr=1e-3, weight_decay=0.1), AdamW([plain], lr=1e-3, weight_decay=0.1)
    flat = FlatAdamW(inner.param_groups, inner.state, [(master, grad_buffer, param_buffer, 512)])
    for _ in range(3):
        grad_buffer.normal_()
        master.grad = grad_buffer[512:512 + numel]
        plain.grad = master.grad.clone()
        flat.step()
        ref.step()
    assert rel_gap(master, plain) < 1e-6
    assert torch.equal(param_buffer[512:512 + numel], master.detach().bfloat16())
    assert not param_buffer[:512].any() and not param_buffer[512 + numel:].any()


@pytest.mark.parametrize("dtype,tol,hidden", [(torch.float32, 1e-4, 256), (torch.bfloat16, 2e-2, 256),
                                              (torch.bfloat16, 2e-2, 512)])  # head size 64, 128
def test_model_with_triton_kernels_on_cuda(dtype, tol, hidden):
    from tinytron.model import GPTModel, tiny_config

    losses = {}
    for kernels in ("torch", "triton"):
        cfg = tiny_config(kernels=kernels, hidden_size=hidden, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=2 * hidden, seq_length=128)
        model = GPTModel(cfg, device="cuda", dtype=dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, cfg.vocab_size, (2, 129), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(0))
        losses[kernels] = []
        for _ in range(3):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[kernels].append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses["torch"], losses["triton"])) < tol, losses

"""The model's hand-written autograd paths against the plain expressions they replace.

SwiGLU's product and the QKV split feed the same ops as autograd's own formulas, so outputs and
gradients must be equal bit for bit; the single-rank cross-entropy takes another summation
order than the three-step chain, so it must agree to fp32 rounding and keep the chain's value
for a label outside the vocabulary.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinytron.model import GPTModel, ModelConfig
from tinytron.model.layers import apply_rope


def _layer(dtype):
    cfg = ModelConfig(hidden_size=64, num_layers=1, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=128, seq_length=32)
    model = GPTModel(cfg, dtype=dtype)
    return cfg, model, model.decoder.layers[0]


def _grads(fn, tensors, grad_out):
    for t in tensors:
        t.grad = None
    out = fn()
    out.backward(grad_out)
    return out.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_product_equals_autograd_bit_for_bit(dtype):
    _, _, layer = _layer(dtype)
    mlp = layer.mlp
    x = torch.randn(32, 3, 64, dtype=dtype, requires_grad=True)
    g = torch.randn(32, 3, 64, dtype=dtype)
    tensors = [x, mlp.linear_fc1.weight, mlp.linear_fc2.weight]

    def plain():
        gate, up = mlp.linear_fc1(x).chunk(2, dim=-1)
        return mlp.linear_fc2(F.silu(gate) * up)

    out, grads = _grads(lambda: mlp(x), tensors, g)
    ref, ref_grads = _grads(plain, tensors, g)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token_tables", [False, True])
def test_qkv_split_equals_slicing_bit_for_bit(dtype, per_token_tables):
    cfg, model, layer = _layer(dtype)
    attn = layer.self_attention
    cos, sin = model._cached_rope_tables(32, torch.device("cpu"), dtype)
    if per_token_tables:  # explicit position_ids give [s, b, d] tables
        cos, sin = (t.expand(32, 3, t.shape[-1]).contiguous() for t in (cos, sin))
    x = torch.randn(32, 3, 64, dtype=dtype, requires_grad=True)
    g = torch.randn(32, 3, 64, dtype=dtype)
    tensors = [x, attn.linear_qkv.weight, attn.linear_proj.weight]

    def sliced():
        qkv = attn.linear_qkv(x)
        s, b = qkv.shape[:2]
        per, d = attn.heads_per_group, cfg.head_dim
        qkv = qkv.view(s, b, attn.local_groups, per + 2, d)
        q = qkv[:, :, :, :per].reshape(s, b, attn.local_groups * per, d)
        k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return attn.linear_proj(attn._attend(q, k, v, None))

    out, grads = _grads(lambda: attn(x, cos, sin), tensors, g)
    ref, ref_grads = _grads(sliced, tensors, g)
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def _chain_loss(logits, labels):
    """The vocab-parallel chain at one rank: max, shift, exp, sum; a label outside gets lse."""
    z = logits.float() - logits.float().amax(-1, keepdim=True)
    outside = (labels < 0) | (labels >= logits.shape[-1])
    target = z.gather(-1, labels.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return z.exp().sum(-1).log() - target.masked_fill(outside, 0.0)


def test_single_rank_cross_entropy_matches_the_chain_and_autograd():
    from tinytron.parallel import ParallelGrid, vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 7, 50, generator=g)).requires_grad_(True)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, 0], labels[2, 3] = 50, -1  # outside the vocabulary: the chain's log-sum-exp
    loss = vocab_parallel_cross_entropy(logits, labels, ParallelGrid.single())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, _chain_loss(logits.detach(), labels), rtol=1e-6, atol=1e-6)
    weights = torch.rand(3, 7, generator=g)
    (loss * weights).sum().backward()
    inside = (labels >= 0) & (labels < 50)
    ref = logits.detach().clone().requires_grad_(True)
    per_token = F.cross_entropy(ref.transpose(1, 2), labels.clamp(0, 49), reduction="none")
    lse = torch.logsumexp(ref, -1) - ref.amax(-1).detach()  # outside: only the softmax term
    (torch.where(inside, per_token, lse) * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-7)

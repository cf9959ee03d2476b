"""Appendix C on CPU: every Triton kernel (under the interpreter) equals its torch reference, forward
and backward, at ragged sizes; bad inputs are refused by name; the fused AdamW equals chapter 02's.

The kernels run under TRITON_INTERPRET=1 (set by tinytron.kernels when there is no CUDA), so the
shapes are tiny. On a CUDA machine the same checks run compiled in test_kernels_gpu.py.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tinytron.kernels import (HAS_TRITON, INTERPRET, FlatAdamW, attention_reference, cross_entropy,
                              flash_attention, resolve_kernels, rms_norm, rms_norm_reference,
                              swiglu, swiglu_reference, vocab_parallel_cross_entropy,
                              vocab_parallel_cross_entropy_reference)
from tinytron.parallel import ParallelGrid

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the `kernels` extra)"),
              pytest.mark.skipif(not INTERPRET, reason="CPU tensors need Triton's interpreter "
                                 "(kernels were compiled for CUDA; see test_kernels_gpu.py)")]

FP32_TOL = 1e-5      # relative to the largest reference value
BF16_TOL = 2 ** -6   # a few bf16 roundings (8 significant bits)


def rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run_both(fns, inputs, grad_out, make_leaf=lambda t: t.clone().requires_grad_()):
    """[output, grads...] of each fn on fresh leaves of the same inputs."""
    out = []
    for fn in fns:
        leaves = [make_leaf(t) for t in inputs]
        y = fn(*leaves)
        y.backward(grad_out)
        out.append([y] + [t.grad for t in leaves])
    return out


# ---------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype,shape", [(torch.float32, (5, 3, 100)), (torch.float32, (7, 37)),
                                         (torch.bfloat16, (9, 100)), (torch.float16, (4, 64))])
def test_rmsnorm_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    dy = torch.randn(tuple(reversed(shape)), generator=gen).to(dtype).permute(
        *reversed(range(len(shape))))  # a non-contiguous upstream gradient
    kernel, ref = run_both([lambda a, b: rms_norm(a, b, 1e-5),
                            lambda a, b: rms_norm_reference(a, b, 1e-5)], [x, w], dy)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for name, a, b in zip(("y", "dx", "dw"), kernel, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_gap(a, b) < tol, (name, rel_gap(a, b))


def test_rmsnorm_bf16_forward_is_bit_exact():
    """Statistics in fp32, cast before the weight, round-to-nearest: the reference's exact bits."""
    x = torch.randn(16, 96).bfloat16()
    w = torch.rand(96).bfloat16()
    assert torch.equal(rms_norm(x, w), rms_norm_reference(x, w))


def test_rmsnorm_bound_admits_another_summation_order_and_nothing_coarser():
    """Page C.1's bound for the compiled forward, checked against an emulated summation order.

    Compiled, the kernel sums the squares in another order than torch (and takes 1/sqrt), so
    bf16 outputs are not bitwise equal: each stays within |w| (rho |n| + one bf16 step of the
    normalized value) + one step of y, rho = (h + 16) 2^-24, and at most (h + 16) / 2^16 of
    them move. At the GPU test's shape the emulation moves some outputs (bitwise equality would
    fail), within the bound and near it; summing in bf16, rounding r to bf16 or casting after
    the weight each break it.
    """
    from tinytron.kernels import rms_norm_moved, rms_norm_other_order

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 2048, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(2048, generator=gen)).bfloat16()
    allowed = x.numel() * (2048 + 16) / 2 ** 16
    for threads in (256, 64):
        moved, worst = rms_norm_moved(rms_norm_other_order(x, w, threads=threads), x, w)
        assert 0 < moved <= allowed and 0.5 < worst <= 1, (threads, moved, worst)
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    for y in (rms_norm_other_order(x, w, acc_dtype=torch.bfloat16),
              w * (x32 * r.bfloat16().float()).bfloat16(), (x32 * r * w.float()).bfloat16()):
        moved, worst = rms_norm_moved(y, x, w)
        assert moved > allowed or worst > 1, (moved, worst)


@pytest.mark.parametrize("x,w,match", [
    (torch.randn(4, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), "dtype"),
    (torch.randn(8, 4).t(), torch.ones(8), "contiguous"),
    (torch.randn(4, 8), torch.ones(8, dtype=torch.bfloat16), "dtype"),
    (torch.randn(4, 8), torch.ones(6), "hidden size"),
    (torch.randn(1, 8193), torch.ones(8193), "hidden size 8193 > 8192"),  # 16 warps' registers
])
def test_rmsnorm_refuses_bad_input(x, w, match):
    with pytest.raises(ValueError, match=match):
        rms_norm(x, w)


# ---------------------------------------------------------------- SwiGLU

@pytest.mark.parametrize("dtype,shape", [(torch.float32, (3, 4, 200)), (torch.float32, (5, 74)),
                                         (torch.bfloat16, (6, 200))])
def test_swiglu_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(shape, generator=gen)).to(dtype)
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype)
    kernel, ref = run_both([swiglu, swiglu_reference], [x], dy)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for name, a, b in zip(("out", "dx"), kernel, ref):
        assert a.shape == b.shape and rel_gap(a, b) < tol, (name, rel_gap(a, b))


def test_swiglu_refuses_bad_input():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match="contiguous"):
        swiglu(torch.randn(8, 3).t())
    with pytest.raises(ValueError, match="dtype"):
        swiglu(torch.randn(3, 8, dtype=torch.float64))


# ---------------------------------------------------------------- cross-entropy

@pytest.mark.parametrize("dtype,shape,vocab", [(torch.float32, (4, 3), 200), (torch.float32, (7,), 67),
                                               (torch.bfloat16, (6,), 200)])
def test_cross_entropy_matches_appendix_a(dtype, shape, vocab):
    gen = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(*shape, vocab, generator=gen)).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels.view(-1)[0], labels.view(-1)[-1] = 0, vocab - 1
    dloss = torch.rand(shape, generator=gen)
    grid = ParallelGrid.single()
    out = []
    for fused in (True, False):
        z = logits.clone().requires_grad_()
        loss = (cross_entropy(z, labels) if fused else
                vocab_parallel_cross_entropy_reference(z.float(), labels, grid))
        loss.backward(dloss)
        out.append((loss, z.grad))
    (loss_k, grad_k), (loss_r, grad_r) = out
    assert loss_k.dtype == torch.float32 and loss_k.shape == labels.shape
    assert grad_k.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert rel_gap(loss_k, loss_r) < FP32_TOL  # the loss is fp32 whatever the logits' dtype
    assert rel_gap(grad_k, grad_r) < tol


def test_cross_entropy_int32_labels_and_bad_input():
    logits, labels = torch.randn(5, 40), torch.randint(0, 40, (5,))
    torch.testing.assert_close(cross_entropy(logits, labels.int()), cross_entropy(logits, labels))
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(logits, labels.float())
    with pytest.raises(ValueError, match="agree"):
        cross_entropy(logits, labels[:4])
    with pytest.raises(ValueError, match="contiguous"):
        cross_entropy(torch.randn(40, 5).t(), labels)
    with pytest.raises(ValueError, match="dtype"):
        vocab_parallel_cross_entropy(logits.double(), labels)


# ---------------------------------------------------------------- flash attention

ATTN_CASES = [  # (b, heads, kv_heads, s, d, causal): GQA 1, 2, 4; ragged s; causal and not
    (1, 2, 2, 24, 16, True), (1, 4, 2, 33, 32, True), (2, 4, 1, 20, 16, True),
    (1, 4, 1, 17, 16, False),
]


def _attention_inputs(b, heads, kv_heads, s, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(b, heads, s, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("case", ATTN_CASES)
def test_flash_attention_fp32_matches_sdpa(case):
    *shape, causal = case
    q, k, v, do = _attention_inputs(*shape)
    kernel, ref = run_both([lambda *t: flash_attention(*t, causal=causal),
                            lambda *t: attention_reference(*t, causal=causal)], [q, k, v], do)
    for name, a, b in zip(("o", "dq", "dk", "dv"), kernel, ref):
        assert a.shape == b.shape and rel_gap(a, b) < FP32_TOL, (name, rel_gap(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_half_within_rounding_of_fp32(dtype):
    """bf16/fp16 in, P and dS rounded for the tensor cores: within 2^-6 of the fp32 result."""
    q, k, v, do = _attention_inputs(1, 4, 2, 33, 16, seed=3)
    truth = run_both([attention_reference], [q, k, v], do)[0]
    half = run_both([flash_attention], [t.to(dtype) for t in (q, k, v)], do.to(dtype))[0]
    for name, a, b in zip(("o", "dq", "dk", "dv"), half, truth):
        assert a.dtype == dtype and rel_gap(a, b) < BF16_TOL, (name, rel_gap(a, b))


def test_flash_attention_causal_ignores_the_future():
    """Changing keys/values after position i leaves the outputs up to i unchanged."""
    q, k, v, _ = _attention_inputs(1, 2, 1, 20, 16, seed=4)
    out = flash_attention(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 12:] += 5.0
    v2[:, :, 12:] -= 3.0
    out2 = flash_attention(q, k2, v2)
    assert torch.equal(out[:, :, :12], out2[:, :, :12])
    assert not torch.allclose(out[:, :, 12:], out2[:, :, 12:])


@pytest.mark.parametrize("q,k,match", [
    (torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24), "head size 24"),
    (torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16), "multiple of key/value heads"),
    (torch.randn(1, 2, 16, 8).transpose(2, 3), torch.randn(1, 2, 8, 16), "contiguous"),
    (torch.randn(1, 2, 8, 16, dtype=torch.float64), torch.randn(1, 2, 8, 16), "dtype"),
    (torch.randn(2, 8, 16), torch.randn(2, 8, 16), "4 dims"),
    (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16), "matching query"),
])
def test_flash_attention_refuses_bad_input(q, k, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k.clone())


# ---------------------------------------------------------------- fused AdamW

def _flat_layout(shapes: dict, align: int = 64):
    """Reverse-order, aligned starts in a flat buffer (chapter 05's layout, in miniature)."""
    starts, end = {}, 0
    for name in reversed(list(shapes)):
        starts[name] = -(-end // align) * align
        end = starts[name] + torch.Size(shapes[name]).numel()
    return starts, -(-end // align) * align


def test_flat_adamw_equals_chapter_02_adamw_and_survives_a_state_reload():
    from tinytron.optimizer.algorithms import AdamW

    gen = torch.Generator().manual_seed(5)
    shapes = {"w": (30, 7), "b": (11,), "norm": (7,)}
    starts, numel = _flat_layout(shapes)
    grad_buffer = torch.zeros(numel)
    param_buffer = torch.zeros(numel, dtype=torch.bfloat16)
    fused = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in shapes.items()}
    plain = {n: torch.nn.Parameter(p.detach().clone()) for n, p in fused.items()}

    def groups(params):
        return [dict(params=[params["w"]], weight_decay=0.1),
                dict(params=[params["b"], params["norm"]], weight_decay=0.0)]

    ref = AdamW(groups(plain), lr=1e-2, betas=(0.9, 0.95))
    inner = AdamW(groups(fused), lr=1e-2, betas=(0.9, 0.95))
    flat = FlatAdamW(inner.param_groups, inner.state,
                     [(p, grad_buffer, param_buffer, starts[n]) for n, p in fused.items()], chunk=32)
    for step in range(1, 7):
        grad_buffer.normal_(generator=gen)
        for n, p in fused.items():
            p.grad = grad_buffer[starts[n]:starts[n] + p.numel()].view_as(p)
            plain[n].grad = p.grad.clone()
        for g in ref.param_groups + inner.param_groups:
            g["lr"] = 1e-2 / step
        ref.step()
        flat.step()
        if step == 3:  # a checkpoint load replaces the state tensors with fresh copies
            for p in fused.values():
                st = inner.state[p]
                inner.state[p] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
    for n, p in fused.items():
        assert rel_gap(p, plain[n]) < 1e-6, n
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_gap(inner.state[p][key], ref.state[plain[n]][key]) < 1e-6, (n, key)
        assert inner.state[p]["step"] == ref.state[plain[n]]["step"] == 6
        written = param_buffer[starts[n]:starts[n] + p.numel()]
        assert torch.equal(written, p.detach().reshape(-1).bfloat16()), n
        assert p.data_ptr() == flat.master.data_ptr() + 4 * flat.slices[list(fused).index(n)][0]


def test_flat_adamw_refuses_what_it_cannot_serve():
    from tinytron.optimizer.algorithms import Adam

    p = torch.nn.Parameter(torch.randn(10))
    opt = Adam([p], lr=1e-3, weight_decay=0.1, decoupled_weight_decay=False)
    with pytest.raises(ValueError, match="decoupled"):
        FlatAdamW(opt.param_groups, opt.state, [(p, torch.zeros(64), torch.zeros(64), 0)])
    opt = Adam([p], lr=1e-3, decoupled_weight_decay=True)
    with pytest.raises(ValueError, match="grad_reduce_in_fp32"):
        FlatAdamW(opt.param_groups, opt.state,
                  [(p, torch.zeros(64, dtype=torch.bfloat16), torch.zeros(64), 0)])
    with pytest.raises(ValueError, match="param buffer"):
        FlatAdamW(opt.param_groups, opt.state, [(p, torch.zeros(64), None, 0)])
    flat = FlatAdamW(opt.param_groups, opt.state, [(p, torch.zeros(64), torch.zeros(64), 0)])
    p.grad = torch.zeros(10)  # a copy, not the grad buffer's view: the kernel would miss it
    with pytest.raises(RuntimeError, match="grad buffer"):
        flat.step()


def test_kernel_choice_resolution():
    assert resolve_kernels("auto", "cpu") == "torch"
    assert resolve_kernels("triton", "cpu") == "triton"
    with pytest.raises(ValueError, match="kernels"):
        resolve_kernels("cuda", "cpu")


def test_flat_adamw_state_dict_round_trip_keeps_layout():
    """state holds views of the flat buffers; an explicit defaultdict state works too."""
    from tinytron.optimizer.algorithms import AdamW

    p = torch.nn.Parameter(torch.randn(40))
    grad, params = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    opt = AdamW([p], lr=1e-3)
    state = defaultdict(dict)
    flat = FlatAdamW(opt.param_groups, state, [(p, grad, params, 0)])
    p.grad = grad[:40]
    flat.step()
    assert state[p]["exp_avg"].data_ptr() == flat.exp_avg.data_ptr()
    assert state[p]["step"] == 1


# ---------------------------------------------------------------- wiring: optimizer and model

def _distopt_run(kernels: str, steps: int = 4):
    """Chapter 05's DDP + chapter 02's DistributedOptimizer (one process, bf16 params)."""
    from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
    from tinytron.optimizer import OptimizerConfig, get_megatron_optimizer
    from tinytron.optimizer._workers import batch, small_mlp

    model = small_mlp(torch.bfloat16)
    ddp = DistributedDataParallel(model, ParallelGrid.single(), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, bucket_size=300))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, clip_grad=0.5,
                                                 use_distributed_optimizer=True, kernels=kernels),
                                 model, ParallelGrid.single(), ddp=ddp)
    for step in range(steps):
        x, y = batch(step, 8)
        ddp.zero_grad_buffer()
        torch.nn.functional.mse_loss(ddp(x.bfloat16()).float(), y).backward()
        ddp.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok
    return model, opt


def test_distributed_optimizer_fused_adamw_equals_foreach():
    """kernels='triton' swaps the inner step for one launch; params and the state dict agree."""
    model_f, opt_f = _distopt_run("triton")
    model_t, opt_t = _distopt_run("torch")
    assert opt_f.fused_adamw is not None and opt_t.fused_adamw is None
    sd_f, sd_t = opt_f.state_dict(), opt_t.state_dict()
    for name, entry in sd_t["params"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                assert rel_gap(sd_f["params"][name][key], value) < 1e-6, (name, key)
            else:
                assert sd_f["params"][name][key] == value, (name, key)
    for (n, p), q in zip(model_f.named_parameters(), model_t.parameters()):
        assert p.dtype == torch.bfloat16
        assert (p.float() - q.float()).abs().max() <= 2 ** -7 * q.float().abs().max(), n


def test_optimizer_config_refuses_fused_adamw_where_it_cannot_apply():
    from tinytron.optimizer import OptimizerConfig

    with pytest.raises(ValueError, match="kernels"):
        OptimizerConfig(lr=1e-3, kernels="triton")  # no distributed optimizer
    with pytest.raises(ValueError, match="kernels"):
        OptimizerConfig(lr=1e-3, kernels="fast")
    OptimizerConfig(lr=1e-3, kernels="auto")  # falls back to torch where it cannot apply


def _train_tiny(kernels: str, steps: int = 2):
    """Losses and first-step grads of the tiny GPT trained with plain AdamW."""
    from tinytron.model import GPTModel, tiny_config

    cfg = tiny_config(seq_length=16, kernels=kernels)
    model = GPTModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    losses, grads = [], {}
    for step in range(steps):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return model, losses, grads


def test_model_with_triton_kernels_trains_like_torch():
    from tinytron.model.transformer_layer import KernelRMSNorm

    model_k, losses_k, grads_k = _train_tiny("triton")
    _, losses_t, grads_t = _train_tiny("torch")
    assert isinstance(model_k.decoder.final_layernorm, KernelRMSNorm)
    assert max(abs(a - b) for a, b in zip(losses_k, losses_t)) < 1e-5, (losses_k, losses_t)
    for name, g in grads_t.items():
        assert rel_gap(grads_k[name], g) < 1e-5, name


def test_model_config_kernels_field():
    from tinytron.model import tiny_config

    assert tiny_config().kernels == "torch"
    with pytest.raises(ValueError, match="kernels"):
        tiny_config(kernels="cuda")
    with pytest.raises(ValueError, match="head size"):  # h 96 / 4 heads = 24: no kernel for it
        tiny_config(hidden_size=96, kernels="triton")


# ---------------------------------------------------------------- fused AdamW: launches, steps


def _one_group_flat_adamw():
    from tinytron.optimizer.algorithms import AdamW

    shapes = {"w": (9, 5), "b": (5,)}
    starts, numel = _flat_layout(shapes)
    grad_buffer, param_buffer = torch.zeros(numel), torch.zeros(numel, dtype=torch.bfloat16)
    params = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    inner = AdamW(list(params.values()), lr=1e-2)
    flat = FlatAdamW(inner.param_groups, inner.state,
                     [(p, grad_buffer, param_buffer, starts[n]) for n, p in params.items()])
    for n, p in params.items():
        p.grad = grad_buffer[starts[n]:starts[n] + p.numel()].view_as(p)
    return flat, inner, params


def test_flat_adamw_step_builds_no_host_tensor(monkeypatch):
    """The hyperparameters go to the kernel as scalars: no tensor is built (and copied) per step."""
    flat, _, _ = _one_group_flat_adamw()
    flat.step()  # the first step may allocate nothing either, but let state adoption settle

    def no_host_tensor(*args, **kwargs):
        raise AssertionError("FlatAdamW.step built a tensor from host values")

    monkeypatch.setattr(torch, "tensor", no_host_tensor)
    flat.step()


def test_flat_adamw_refuses_pieces_of_one_group_at_different_steps():
    flat, inner, params = _one_group_flat_adamw()
    flat.step()
    inner.state[params["b"]]["step"] = 7  # a state dict that does not belong together
    with pytest.raises(RuntimeError, match="different steps"):
        flat.step()


# ---------------------------------------------------------------- ahead of time, for real GPUs


@pytest.mark.slow
def test_kernels_compile_for_sm80_and_sm90_at_every_config_size_without_spills():
    """Every kernel at every model size of configs/*.toml, compiled for an A100 and an H100.

    chapters/kernels/_compile.py lowers each kernel with the launch options its page uses and
    reports the shared memory a block needs and ptxas's registers and spill stores; no GPU is
    needed (Triton ships ptxas). The old tiles spilled at head size 128 with Triton 3.6.
    """
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia.compiler")
    import tinytron.kernels as kernels

    script = Path(kernels.__file__).with_name("_compile.py")
    sys.path.insert(0, str(script.parent))
    try:
        from _compile import SHARED_LIMIT, config_sizes
    finally:
        sys.path.remove(str(script.parent))
    sizes = config_sizes()
    assert {s["head_dim"] for s in sizes} == {32, 64, 128} and len(sizes) >= 4, sizes
    runs = {arch: subprocess.Popen([sys.executable, str(script), str(arch), "--configs"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for arch in (80, 90)}  # the two targets compile side by side
    for arch, proc in runs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [r["sizes"] for r in rows[::11]] == sizes and len(rows) == 11 * len(sizes)
        assert {r["kernel"] for r in rows} == {
            "rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd", "ce_fwd", "ce_bwd",
            "attn_fwd", "attn_bwd_delta", "attn_bwd_dkdv", "attn_bwd_dq", "adamw"}, rows
        for r in rows:
            assert r["shared"] <= SHARED_LIMIT[arch], r
            assert r["registers"] is not None and r["spill_bytes"] is not None, r  # ptxas spoke
            assert r["spill_bytes"] == 0, r
            # a block fits one SM's 65,536 registers, at most 255 per thread
            assert 0 < r["registers"] <= 255 and r["registers"] * 32 * r["num_warps"] <= 65536, r
            if r["kernel"] == "adamw":  # memory-bound: at least 4 blocks of 8 warps per SM
                assert r["registers"] <= 64 and r["num_warps"] == 8, r

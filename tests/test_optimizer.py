"""Chapter 02 single-process tests: update rules, Muon, QK-clip, groups, scheduler, scaler, clip, offload."""

import math

import pytest
import torch

from tinytron.optimizer.algorithms import SGD, Adam, AdamW, ChainedOptimizer, Lion, build_param_groups
from tinytron.optimizer.layer_wise import ping_pong_owners
from tinytron.optimizer.mixed_precision import (ConstantGradScaler, DynamicGradScaler,
                                                MixedPrecisionOptimizer, clip_grad_by_total_norm_fp32,
                                                get_grad_norm_fp32, grads_for_norm)
from tinytron.optimizer.muon import (Muon, attention_max_logits, build_muon_adamw, muon_scale_factor,
                                     newton_schulz, ns_coefficients, qk_clip_)
from tinytron.optimizer.offload import HybridDeviceOptimizer, split_by_fraction
from tinytron.optimizer.scheduler import OptimizerParamScheduler

SHAPES = [(5, 7), (7,), (3, 2, 4)]


def _twin_run(make_a, make_b, steps=5, seed=0, groups=False):
    """Params after `steps` identical-gradient steps of two optimizers."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(s, generator=gen) for s in SHAPES]
    b = [t.clone() for t in a]
    if groups:   # two groups with different lr / weight decay
        oa = make_a([{"params": a[:2]}, {"params": a[2:], "lr": 0.003, "weight_decay": 0.0}])
        ob = make_b([{"params": b[:2]}, {"params": b[2:], "lr": 0.003, "weight_decay": 0.0}])
    else:
        oa, ob = make_a(a), make_b(b)
    for _ in range(steps):
        for x, y in zip(a, b):
            g = torch.randn(x.shape, generator=gen)
            x.grad, y.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    return a, b


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("groups", [False, True])
def test_adamw_equals_torch(foreach, groups):
    kw = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    a, b = _twin_run(lambda p: AdamW(p, **kw), lambda p: torch.optim.AdamW(p, foreach=foreach, **kw),
                     steps=7, groups=groups)
    for x, y in zip(a, b):
        if foreach:
            assert torch.equal(x, y)   # same operations in the same order
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=1e-7)


def test_adam_l2_and_sgd_equal_torch():
    kw = dict(lr=0.01, weight_decay=0.1)
    pairs = [(lambda p: Adam(p, **kw), lambda p: torch.optim.Adam(p, foreach=True, **kw)),
             (lambda p: SGD(p, momentum=0.9, **kw), lambda p: torch.optim.SGD(p, momentum=0.9, **kw)),
             (lambda p: SGD(p, momentum=0.9, nesterov=True, **kw),
              lambda p: torch.optim.SGD(p, momentum=0.9, nesterov=True, **kw)),
             (lambda p: SGD(p, momentum=0.0, **kw), lambda p: torch.optim.SGD(p, momentum=0.0, **kw))]
    for ours, ref in pairs:
        a, b = _twin_run(ours, ref)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_adam_first_step_by_hand():
    p = torch.nn.Parameter(torch.tensor([1.0]))
    p.grad = torch.tensor([2.0])
    AdamW([p], lr=0.1, weight_decay=0.0).step()
    # m_hat = 2, v_hat = 4 -> step 0.1 * 2 / (2 + 1e-8)
    assert p.item() == pytest.approx(1 - 0.1 * 2 / (2 + 1e-8), abs=1e-7)


def test_adamw_decay_is_decoupled():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    p.grad, q.grad = torch.zeros(3), torch.zeros(3)
    AdamW([p], lr=0.1, weight_decay=0.5).step()
    Adam([q], lr=0.1, weight_decay=0.5).step()
    assert torch.allclose(p, torch.full((3,), 1 - 0.1 * 0.5))   # only the decay moved it
    assert torch.allclose(q, torch.full((3,), 1 - 0.1), atol=1e-6)   # L2 grad 0.5 -> Adam step ~lr


def test_lion_order_decay_sign_ema():
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0)
    opt.state[p]["exp_avg"] = torch.tensor([1.0, 1.0])
    p.grad = torch.tensor([-20.0, 5.0])
    opt.step()
    # interpolation 0.9*1 + 0.1*g = [-1.1, 1.4] -> signs [-1, 1]
    assert torch.allclose(p, torch.tensor([1.1, 0.9]))
    assert torch.allclose(opt.state[p]["exp_avg"], torch.tensor([0.99 - 0.2, 0.99 + 0.05]))
    q = torch.nn.Parameter(torch.tensor([2.0]))
    q.grad = torch.tensor([1.0])
    Lion([q], lr=0.1, weight_decay=0.5).step()
    assert q.item() == pytest.approx(2.0 * (1 - 0.05) - 0.1)


def test_lion_equals_emerging_optimizers_arithmetic_to_the_last_bit():
    """Megatron's Lion is emerging_optimizers' (megatron/core/optimizer/__init__.py:599-609),
    whose decoupled decay adds -lr*wd*theta to theta where tinytron multiplies theta by
    (1 - lr*wd): the same rule, rounded differently. Written out here from that arithmetic,
    three steps on 4,096 fp32 values: the momentum is bitwise equal, no update changes sign,
    and theta differs by at most 3 units in the last place of the larger of |theta| before and
    after (measured: up to 2.3 such units, at most 4.8e-7 in absolute terms at |theta| ~ 4)."""
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(4096, generator=g)
    grads = [torch.randn(4096, generator=g) for _ in range(3)]
    lr, wd, (b1, b2) = 1e-2, 0.1, (0.95, 0.98)
    p = torch.nn.Parameter(theta0.clone())
    ours = Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    theta, m = theta0.clone(), torch.zeros(4096)
    for grad in grads:
        p.grad = grad.clone()
        ours.step()
        theta.add_(theta, alpha=-wd * lr)                  # decoupled decay, as an add
        theta.add_(torch.sign(m.lerp(grad, 1 - b1)), alpha=-lr)
        m.lerp_(grad, 1 - b2)
    gap = (p.detach() - theta).abs()
    assert torch.equal(ours.state[p]["exp_avg"], m)
    scale = torch.maximum(theta0.abs(), theta.abs())   # a value may pass near 0 on the way
    assert bool((gap <= 3 * torch.finfo(torch.float32).eps * scale).all())
    assert gap.max() > 0   # not bitwise: the decay rounds differently


def test_bad_hyperparameters_raise():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="lr"):
        AdamW(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        Lion(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="nesterov"):
        SGD(p, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="2-D"):
        Muon(p)
    with pytest.raises(ValueError, match="coefficient_type"):
        ns_coefficients("cubic", 5)
    with pytest.raises(ValueError, match="scale_mode"):
        muon_scale_factor(4, 4, "rms")


# ---------------------------------------------------------------- Muon
def test_ns_coefficient_sequences():
    assert ns_coefficients("quintic", 5)[0] == (4.0848, -6.8946, 2.9270)
    assert ns_coefficients("quintic", 6)[5] == ns_coefficients("quintic", 6)[0]   # cycled
    assert ns_coefficients("simple", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    pe = ns_coefficients("polar_express", 10)
    assert pe[0] == (8.2051, -22.9019, 16.4607) and pe[7] == pe[8] == pe[9] == (1.8750, -1.2500, 0.3750)
    assert len(ns_coefficients("aol", 4)) == 4


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (40, 40)])
def test_ns_singular_values_near_one(shape):
    d = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    sv = torch.linalg.svdvals(newton_schulz(d))
    # measured: 5 quintic steps land in [0.9777, 1.0407]; 4 steps reach 1.146 and the "simple"
    # coefficients 0.68, so these bounds fail on a wrong step count or coefficient set
    assert 0.975 < sv.min() and sv.max() < 1.045
    u, _, vh = torch.linalg.svd(d, full_matrices=False)
    # the result approximates U V^T (the polar factor): measured max gap 0.0113 (4 steps: 0.043)
    assert (newton_schulz(d) - u @ vh).abs().max() < 0.015
    sv16 = torch.linalg.svdvals(newton_schulz(d, matmul_dtype=torch.bfloat16))
    assert 0.965 < sv16.min() and sv16.max() < 1.045  # measured [0.9699, 1.0400]
    for wrong in (dict(steps=4), dict(coefficient_type="simple")):
        gap = (newton_schulz(d, **wrong) - u @ vh).abs().max()
        assert gap > 0.04, (wrong, float(gap))  # the check above can fail


def test_ns_of_a_diagonal_is_the_scalar_quintic_map():
    """On diag(s) every matmul is elementwise: NS is x -> a x + b x^3 + c x^5 per step."""
    s = torch.tensor([3.0, 1.0, 0.25, 0.01])
    x = s / s.norm()
    for a, b, c in ns_coefficients("quintic", 5):
        x = a * x + b * x ** 3 + c * x ** 5
    out = newton_schulz(torch.diag(s))
    assert torch.allclose(torch.diagonal(out), x, atol=1e-6)
    assert torch.equal(out - torch.diag(torch.diagonal(out)), torch.zeros(4, 4))


def test_ns_handles_transpose():
    d = torch.randn(48, 16, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(newton_schulz(d), newton_schulz(d.T).T, atol=1e-5)


def test_scale_modes():
    assert muon_scale_factor(256, 64, "spectral") == 16.0
    assert muon_scale_factor(256, 64, "shape_scaling") == 2.0
    assert muon_scale_factor(64, 256, "shape_scaling") == 1.0
    assert muon_scale_factor(256, 64, "unit_rms_norm") == 2.0


@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_step_by_hand(nesterov):
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(8, 12, generator=gen)
    grads = [torch.randn(8, 12, generator=gen) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1,
               fp32_matmul_prec="highest", extra_scale_factor=0.5)
    w, buf = w0.clone(), torch.zeros_like(w0)
    for g in grads:
        p.grad = g
        opt.step()
        w = w * (1 - 0.05 * 0.1)
        buf = 0.9 * buf + 0.1 * g
        d = 0.1 * g + 0.9 * buf if nesterov else buf
        w = w - 0.05 * newton_schulz(d) * math.sqrt(12) * 0.5
    assert torch.allclose(p.detach(), w, atol=1e-5)


def test_muon_qkv_split_equals_separate_slabs():
    groups, q_rows, d, hidden = 2, 16, 8, 24
    shapes = [q_rows, d, d]
    w = torch.nn.Parameter(torch.zeros(groups * sum(shapes), hidden))
    w.is_qkv = True
    g = torch.randn(w.shape, generator=torch.Generator().manual_seed(5))
    opt = Muon([w], qkv_split_shapes=shapes, fp32_matmul_prec="highest")
    out = opt.orthogonalize(w, g).view(groups, sum(shapes), hidden)
    gv = g.view(groups, sum(shapes), hidden)
    start = 0
    for rows in shapes:
        slab = gv[:, start:start + rows].reshape(-1, hidden)
        want = newton_schulz(slab) * math.sqrt(max(slab.shape))
        assert torch.allclose(out[:, start:start + rows].reshape(-1, hidden), want, atol=1e-5)
        start += rows
    unsplit = Muon([w], split_qkv=False, fp32_matmul_prec="highest").orthogonalize(w, g)
    assert not torch.allclose(unsplit, out.view_as(unsplit), atol=1e-2)


def test_build_muon_adamw_routes_params():
    model = torch.nn.ModuleDict({"embedding": torch.nn.Embedding(10, 4), "fc": torch.nn.Linear(4, 4),
                                 "norm": torch.nn.LayerNorm(4)})
    chain = build_muon_adamw(model.named_parameters(), lr=0.01)
    muon, adamw = chain.chained_optimizers
    muon_names = [n for g in muon.param_groups for n in g["param_names"]]
    adam_names = sorted(n for g in adamw.param_groups for n in g["param_names"])
    assert muon_names == ["fc.weight"]
    assert adam_names == ["embedding.weight", "fc.bias", "norm.bias", "norm.weight"]
    assert len(chain.param_groups) == len(muon.param_groups) + len(adamw.param_groups)


# ---------------------------------------------------------------- QK-clip
def _logits(x, w, groups, heads, d):
    """Per-head max causal logit q·k/sqrt(d), computed here by a loop (not by the code under test)."""
    b, s = x.shape[:2]
    y = (x @ w.T).view(b, s, groups, -1, d)
    per_group = heads // groups
    out = torch.full((heads,), -math.inf)
    for h in range(heads):
        g = h // per_group
        q, k = y[:, :, g, h % per_group], y[:, :, g, per_group]  # [b, s, d] each
        for i in range(s):
            for j in range(i + 1):  # causal: key j <= query i
                out[h] = max(out[h], float((q[:, i] * k[:, j]).sum(-1).max()) / math.sqrt(d))
    return out


def test_attention_max_logits_equals_the_loop():
    heads, groups, d, hidden = 4, 2, 8, 16
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, hidden, generator=gen)
    w = torch.randn(groups * (heads // groups + 2) * d, hidden, generator=gen)
    y = (x @ w.T).view(2, 6, groups, -1, d)
    q = y[:, :, :, : heads // groups].reshape(2, 6, heads, d)
    got = attention_max_logits(q, y[:, :, :, heads // groups], d ** -0.5)
    assert torch.allclose(got, _logits(x, w, groups, heads, d), rtol=1e-5)
    non_causal = attention_max_logits(q, y[:, :, :, heads // groups], d ** -0.5, causal=False)
    assert (non_causal >= got).all() and (non_causal > got).any()


def test_qk_clip():
    heads, groups, d, hidden = 4, 2, 8, 16
    rows = (heads // groups + 2) * d
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 8, hidden, generator=gen)
    w = torch.randn(groups * rows, hidden, generator=gen)
    w.view(groups, rows, hidden)[0] *= 3
    w.view(groups, rows, hidden)[1] *= 0.2
    before = _logits(x, w, groups, heads, d)
    tau = float(before[:2].max()) / 4
    assert before[2:].max() < tau
    w0, master = w.clone(), w.clone().double()
    eta = qk_clip_([w, master], before, groups, d, threshold=tau, alpha=0.25)
    after = _logits(x, w, groups, heads, d)
    assert after.max() <= tau * (1 + 1e-4) and after[:2].max() == pytest.approx(tau, rel=1e-4)
    v0, v1 = w0.view(groups, rows, hidden), w.view(groups, rows, hidden)
    q_rows = heads // groups * d
    assert torch.allclose(v1[0, :q_rows], v0[0, :q_rows] * eta[0] ** 0.25)
    assert torch.allclose(v1[0, q_rows:q_rows + d], v0[0, q_rows:q_rows + d] * eta[0] ** 0.75)
    assert torch.equal(v1[:, q_rows + d:], v0[:, q_rows + d:])   # V rows untouched
    assert torch.equal(v1[1], v0[1])                               # group below threshold untouched
    assert torch.allclose(master.float(), w)
    with pytest.raises(ValueError, match="alpha"):
        qk_clip_([w], before, groups, d, alpha=1.0)


# ---------------------------------------------------------------- groups
def test_param_groups_megatron_rules():
    m = torch.nn.ModuleDict({"lin": torch.nn.Linear(4, 3), "q_layernorm": torch.nn.LayerNorm(3),
                             "emb": torch.nn.Embedding(5, 4)})
    m.emb.weight.is_embedding_or_output_parameter = True
    groups = build_param_groups(m.named_parameters(), lr=1e-3, weight_decay=0.1, min_lr=1e-5,
                                decoupled_lr=5e-3, decoupled_min_lr=1e-4)
    by_name = {n: g for g in groups for n in g["param_names"]}
    assert by_name["lin.weight"]["wd_mult"] == 1.0 and by_name["lin.bias"]["wd_mult"] == 0.0
    assert by_name["q_layernorm.weight"]["weight_decay"] == 0.0
    assert by_name["emb.weight"]["max_lr"] == 5e-3 and by_name["emb.weight"]["min_lr"] == 1e-4
    assert by_name["emb.weight"]["is_decoupled_lr"] and by_name["lin.weight"]["max_lr"] == 1e-3
    g2 = build_param_groups(m.named_parameters(), lr=1e-3, apply_wd_to_qk_layernorm=True)
    assert {n: g["wd_mult"] for g in g2 for n in g["param_names"]}["q_layernorm.weight"] == 1.0
    g3 = build_param_groups(m.named_parameters(), lr=1e-3,
                            overrides=[(lambda n, p: n.startswith("lin"), {"lr_mult": 0.5})])
    assert {n: g["lr"] for g in g3 for n in g["param_names"]}["lin.weight"] == 5e-4


# ---------------------------------------------------------------- scheduler
class _Opt:
    def __init__(self, groups):
        self.param_groups = groups


def _expected_lr(n, style, wsd_style=None, init=0.0, mx=1.0, mn=0.1, warm=10, decay=100, wsd=30):
    """The facts brief's formulas, written independently of the class."""
    if warm > 0 and n <= warm:
        return init + (mx - init) * n / warm
    if style == "constant":
        return mx
    if n > decay:
        return mn
    if style == "inverse-square-root":
        return max(mn, mx * math.sqrt(max(warm, 1)) / math.sqrt(max(n, 1)))
    r = (n - warm) / (decay - warm)
    if style == "linear":
        c = 1 - r
    elif style == "cosine":
        c = 0.5 * (math.cos(math.pi * r) + 1)
    else:
        start = decay - wsd
        rr = max(0.0, (n - start) / wsd)
        c = 1.0 if n <= start else {"linear": 1 - rr, "cosine": 0.5 * (math.cos(math.pi * rr) + 1),
                                    "exponential": 2 * 0.5 ** rr - 1, "minus_sqrt": 1 - math.sqrt(rr)}[wsd_style]
    return mn + c * (mx - mn)


@pytest.mark.parametrize("style,wsd_style", [("constant", None), ("linear", None), ("cosine", None),
                                             ("inverse-square-root", None), ("WSD", "linear"),
                                             ("WSD", "cosine"), ("WSD", "exponential"),
                                             ("WSD", "minus_sqrt")])
def test_scheduler_matches_formulas_every_step(style, wsd_style):
    groups = [{}, {"wd_mult": 0.0}, {"params": []}]
    extra = dict(wsd_decay_steps=30, lr_wsd_decay_style=wsd_style) if style == "WSD" else {}
    s = OptimizerParamScheduler(_Opt(groups), 0.0, 1.0, 0.1, 10, 100, style, 0.1, 0.1, 100,
                                "constant", **extra)
    for n in range(0, 121):
        want = _expected_lr(n, style, wsd_style)
        assert groups[0]["lr"] == pytest.approx(want, abs=1e-12), (n, style)
        assert groups[2]["lr"] == groups[0]["lr"]   # empty groups are set too
        assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
        s.step(1)


@pytest.mark.parametrize("wd_style", ["linear", "cosine"])
def test_scheduler_weight_decay_increment(wd_style):
    g = [{}]
    s = OptimizerParamScheduler(_Opt(g), 0.0, 1.0, 0.0, 0, 50, "linear", 0.0, 0.2, 40, wd_style)
    for n in range(0, 50):
        r = min(n, 40) / 40
        c = r if wd_style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
        assert g[0]["weight_decay"] == pytest.approx(0.2 * c, abs=1e-12)
        s.step(1)


def test_scheduler_state_dict_and_reload_policy():
    def make(**kw):
        args = dict(init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=10, lr_decay_steps=100,
                    lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=100,
                    wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False)
        args.update(kw)
        return OptimizerParamScheduler(_Opt([{}]), **args)

    a = make()
    a.step(37)
    sd = a.state_dict()
    assert set(sd) == {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
                       "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"}
    b = make()
    b.load_state_dict(sd)
    assert b.num_steps == 37 and b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="max_lr"):
        make(max_lr=2.0).load_state_dict(sd)
    c = make(max_lr=2.0, override_opt_param_scheduler=True)
    c.load_state_dict(sd)
    assert c.max_lr == 2.0
    d = make(max_lr=2.0, use_checkpoint_opt_param_scheduler=True)
    d.load_state_dict(sd)
    assert d.max_lr == 1.0
    legacy = {"start_lr": 1.0, "min_lr": 0.1, "warmup_iter": 10, "end_iter": 100,
              "decay_style": "cosine", "num_iters": 37}
    e = make()
    e.load_state_dict(legacy)
    assert e.num_steps == 37


def test_scheduler_validation():
    with pytest.raises(ValueError, match="lr_decay_style"):
        OptimizerParamScheduler(_Opt([{}]), 0, 1, 0, 0, 10, "step", 0, 0, 10, "constant")
    with pytest.raises(ValueError, match="wsd_decay_steps"):
        OptimizerParamScheduler(_Opt([{}]), 0, 1, 0, 0, 10, "WSD", 0, 0, 10, "constant")
    with pytest.raises(ValueError, match="start_wd == end_wd"):
        OptimizerParamScheduler(_Opt([{}]), 0, 1, 0, 0, 10, "linear", 0, 0.1, 10, "constant")
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        OptimizerParamScheduler(_Opt([{}]), 0, 1, 0, 10, 10, "linear", 0, 0, 10, "constant")


# ---------------------------------------------------------------- scaler
def test_dynamic_scaler_state_machine():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    trace = []
    for inf in [True, True, True, False, False, False, True, False, True, True, True, True]:
        s.update(inf)
        trace.append((s.scale, s.state_dict()["hysteresis_tracker"]))
    assert [t[0] for t in trace] == [8, 4, 2, 2, 2, 4, 4, 4, 2, 1, 1, 1]   # floor at min_scale
    assert trace[5][1] == 2 and trace[6][1] == 1   # growth restores hysteresis; next inf uses it
    t = DynamicGradScaler(initial_scale=4.0)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    c = ConstantGradScaler(128.0)
    c.update(True)
    assert c.scale == 128.0 and c.inv_scale == 1 / 128
    with pytest.raises(ValueError, match="backoff"):
        DynamicGradScaler(backoff_factor=1.5)


def test_skip_exactly_on_overflow_and_scheduler_not_stepped():
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    scaler = DynamicGradScaler(initial_scale=2.0 ** 8, growth_interval=2, hysteresis=1)
    opt = MixedPrecisionOptimizer(AdamW(model.parameters(), lr=0.01), grad_scaler=scaler)
    sched = OptimizerParamScheduler(opt, 0.0, 0.01, 0.0, 0, 40, "linear", 0.0, 0.0, 40, "constant")
    x = torch.randn(8, 4).bfloat16()
    results, scales = [], []
    for step in range(8):
        before = [p.detach().clone() for p in model.parameters()]
        loss = model(x).float().pow(2).mean()
        if step in (2, 5):
            loss = loss * float("inf")
        scales.append(scaler.scale)
        opt.scale_loss(loss).backward()
        ok, norm, _ = opt.step()
        opt.zero_grad()
        if ok:
            sched.step(1)
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        results.append((ok, changed))
    assert [r[0] for r in results] == [True, True, False, True, True, False, True, True]
    assert all(ok == changed for ok, changed in results)
    assert sched.num_steps == 6
    assert scales == [256, 256, 512, 256, 256, 512, 256, 256]


def test_master_weights_and_grads():
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(AdamW(model.parameters(), lr=1e-3), clip_grad=0.0)
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape)
    opt.copy_model_grads_to_main_grads()
    for p in model.parameters():
        assert p.main_param.dtype == torch.float32 and torch.equal(p.main_param.grad, p.main_grad)
    opt.step_with_ready_grads()
    for p in model.parameters():
        assert torch.equal(p.data, p.main_param.data.bfloat16())
        assert opt.optimizer.state[p.main_param]["exp_avg"].dtype == torch.float32
    sd = opt.state_dict()
    other = MixedPrecisionOptimizer(AdamW(torch.nn.Linear(4, 3).bfloat16().parameters(), lr=1e-3))
    other.load_state_dict(sd)
    assert all(torch.equal(a.main_param, b.main_param)
               for a, b in zip(model.parameters(), [m for m, _ in other.pairs]))


def test_clip_counts_duplicates_once():
    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    a.tensor_model_parallel = True
    c.shared = True
    for p, v in zip((a, b, c), (1.0, 2.0, 3.0)):
        p.grad = torch.full((3,), v)
    assert len(grads_for_norm([a, b, c], tp_rank=0)) == 2
    assert len(grads_for_norm([a, b, c], tp_rank=1)) == 1   # b is a TP duplicate on rank 1
    norm = get_grad_norm_fp32(grads_for_norm([a, b, c]), reduce=False)
    assert norm == pytest.approx(math.sqrt(3 * 1 + 3 * 4))
    assert get_grad_norm_fp32(grads_for_norm([a, b]), math.inf, reduce=False) == 2.0
    grads = [a.grad, b.grad]
    assert clip_grad_by_total_norm_fp32(grads, 10.0, norm) == 1.0 and a.grad[0] == 1.0
    coef = clip_grad_by_total_norm_fp32(grads, norm / 2, norm)
    assert coef == pytest.approx(0.5, rel=1e-5) and a.grad[0] == pytest.approx(0.5, rel=1e-5)


# ---------------------------------------------------------------- offload, layer-wise
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_hybrid_offload_equals_adamw(fraction):
    a, b = _twin_run(lambda p: HybridDeviceOptimizer(p, fraction, lr=0.01, weight_decay=0.1),
                     lambda p: AdamW(p, lr=0.01, weight_decay=0.1), steps=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_hybrid_state_lives_in_host_copies_and_reloads():
    ps = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = HybridDeviceOptimizer(ps, 1.0, lr=0.01, overlap_d2h_h2d=False)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(opt.cpu_optimizers) == 1 and opt.device_optimizer is None
    host = opt.host_of[ps[0]]
    assert opt.state[ps[0]] is opt._owner(host).state[host]
    assert split_by_fraction([600, 300, 100], 0.5) == [True, False, False]   # crossing param taken
    assert split_by_fraction([600, 300, 100], 0.7) == [True, True, False]
    assert split_by_fraction([600, 300, 100], 0.0) == [False] * 3
    with pytest.raises(ValueError, match="fraction"):
        split_by_fraction([1], 1.5)


def test_ping_pong_owners():
    assert ping_pong_owners([100 - i for i in range(10)], 4) == [0, 1, 2, 3, 3, 2, 1, 0, 0, 1]
    assert ping_pong_owners([5, 50, 7], 2) == [1, 0, 1]   # 50 -> 0, 7 -> 1, 5 -> 1 (pong)


def test_chained_optimizer_state_dict_roundtrip():
    ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    chain = ChainedOptimizer([AdamW([ps[0]], lr=0.1), Lion([ps[1]], lr=0.1)])
    for p in ps:
        p.grad = torch.ones(3)
    chain.step()
    sd = chain.state_dict()
    with pytest.raises(ValueError, match="state dicts"):
        chain.load_state_dict(sd[:1])
    # fresh chains over copies of the params, one loaded from (a copy of) the state dict and one
    # not; all three step on with the same grads. torch's state_dict() returns the live tensors,
    # so the copy stands for the round trip through a file.
    import copy

    def twin():
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        return qs, ChainedOptimizer([AdamW([qs[0]], lr=0.1), Lion([qs[1]], lr=0.1)])

    (qs, loaded), (us, blank) = twin(), twin()
    loaded.load_state_dict(copy.deepcopy(sd))
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        grads = [torch.randn(3, generator=gen) for _ in ps]
        for params in (ps, qs, us):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        chain.step(), loaded.step(), blank.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    lion_m = [o.chained_optimizers[1].state[q[1]]["exp_avg"] for o, q in
              ((chain, ps), (loaded, qs), (blank, us))]
    assert torch.equal(lion_m[0], lion_m[1])
    # the state really mattered: Adam's step and Lion's momentum differ without it (Lion's
    # sign update alone can coincide, so its momentum is compared)
    assert not torch.equal(ps[0], us[0]) and not torch.equal(lion_m[0], lion_m[2])


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_hybrid_offload_on_gpu_matches_gpu_adamw():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dev)) for s in [(256, 128), (128,), (64, 64)]]
    b = [torch.nn.Parameter(t.detach().clone()) for t in a]
    oa = HybridDeviceOptimizer(a, 0.6, lr=0.01, weight_decay=0.1)
    ob = AdamW(b, lr=0.01, weight_decay=0.1)
    for _ in range(3):
        for x, y in zip(a, b):
            g = torch.randn(x.shape, generator=gen).to(dev)
            x.grad, y.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert oa.host_of and all(h.device.type == "cpu" and h.is_pinned() for h in oa.host_of.values())
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_muon_bf16_newton_schulz_on_gpu():
    d = torch.randn(256, 512, device="cuda")
    sv = torch.linalg.svdvals(newton_schulz(d, matmul_dtype=torch.bfloat16).float())
    assert 0.6 < sv.min() and sv.max() < 1.3


def test_distopt_on_one_rank_with_offloaded_inner_equals_plain():
    import copy

    import torch.nn.functional as F

    from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
    from tinytron.optimizer._workers import batch, small_mlp
    from tinytron.optimizer.distributed import DistributedOptimizer
    from tinytron.parallel import ParallelGrid

    model = small_mlp()
    ref = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, ParallelGrid.single(), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = DistributedOptimizer(HybridDeviceOptimizer(model.parameters(), 0.5, lr=1e-2), ddp)
    ref_opt = MixedPrecisionOptimizer(AdamW(ref.parameters(), lr=1e-2))
    for step in range(3):
        x, y = batch(step, 8)
        ddp.zero_grad_buffer()
        F.mse_loss(ddp(x), y).backward()
        ddp.finish_grad_sync()
        opt.step()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert opt.optimizer.host_of   # part of the shard really is stepped on the host
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        plain = DistributedDataParallel(small_mlp(), ParallelGrid.single())
        DistributedOptimizer(AdamW(plain.module.parameters()), plain)


def test_grad_norm_skip_threshold_and_zero_count():
    p = torch.nn.Parameter(torch.ones(4))
    opt = MixedPrecisionOptimizer(SGD([p], lr=0.1, momentum=0.0), clip_grad=0.0,
                                  grad_norm_skip_threshold=1.0, log_num_zeros_in_grad=True)
    p.grad = torch.tensor([3.0, 0.0, 0.0, 4.0])
    ok, norm, zeros = opt.step()
    assert (ok, norm, zeros) == (False, 5.0, 2) and torch.equal(p, torch.ones(4))
    p.grad = torch.tensor([0.3, 0.0, 0.0, 0.4])
    ok, norm, _ = opt.step()
    assert ok and norm == pytest.approx(0.5) and p[0].item() == pytest.approx(0.97)


def test_factory_choices_and_scheduler_lengths():
    from tinytron.buffers import DistributedDataParallel, DistributedDataParallelConfig
    from tinytron.optimizer._workers import small_mlp
    from tinytron.optimizer.distributed import DistributedOptimizer
    from tinytron.optimizer.factory import (OptimizerConfig, SchedulerConfig, get_megatron_optimizer,
                                            get_optimizer_param_scheduler)
    from tinytron.optimizer.layer_wise import LayerWiseDistributedOptimizer
    from tinytron.parallel import ParallelGrid

    with pytest.raises(ValueError, match="lr"):
        get_megatron_optimizer(OptimizerConfig(), small_mlp())
    with pytest.raises(ValueError, match="optimizer must be"):
        OptimizerConfig(optimizer="adagrad")
    with pytest.raises(ValueError, match="optimizer_cpu_offload"):
        OptimizerConfig(optimizer="sgd", optimizer_cpu_offload=True)
    with pytest.raises(ValueError, match="ddp"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, use_distributed_optimizer=True), small_mlp())
    model = small_mlp()
    ddp = DistributedDataParallel(model, ParallelGrid.single(),
                                  DistributedDataParallelConfig(use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=True), model, ddp=ddp)
    assert isinstance(opt, DistributedOptimizer) and opt.grad_scaler is None
    muon = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-3, use_distributed_optimizer=True),
                                  small_mlp(), grid=ParallelGrid.single())
    assert isinstance(muon, LayerWiseDistributedOptimizer)
    sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, fp16=True), small_mlp())
    assert isinstance(sgd.optimizer, SGD) and isinstance(sgd.grad_scaler, DynamicGradScaler)
    s = get_optimizer_param_scheduler(SchedulerConfig(lr_decay_style="WSD", lr_warmup_iters=5,
                                                      lr_wsd_decay_iters=20, lr_decay_iters=80),
                                      sgd, OptimizerConfig(lr=0.1), train_iters=100, global_batch_size=8)
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.wsd_decay_steps, s.wd_incr_steps) == (40, 640, 160, 800)


def test_warmup_fraction_stays_a_float_sample_count():
    """Megatron keeps lr_warmup_fraction * decay as a float (training.py:1840); no truncation."""
    from tinytron.optimizer import OptimizerConfig, SchedulerConfig, get_optimizer_param_scheduler

    class _Groups:
        param_groups = [{}]

    sched = get_optimizer_param_scheduler(SchedulerConfig(lr_warmup_fraction=0.013), _Groups(),
                                          OptimizerConfig(lr=1e-3), train_iters=150,
                                          global_batch_size=8)
    assert sched.lr_warmup_steps == pytest.approx(0.013 * 1200)  # 15.6 samples, not 15
    sched.step(15)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 15 / 15.6)

"""Appendix C kernels against PyTorch eager and torch.compile, side by side in one run.

CUDA (the numbers that mean something), at the shapes of a ~1B model (Llama-3.2-1B: h 2048,
32/8 heads of 64, f 8192, V 128256; one sequence of 2048 tokens): forward and forward+backward
time of each kernel, eager and torch.compile of the same function; achieved bandwidth of the
memory-bound kernels as a fraction of the device's peak (and of a measured copy); attention TFLOP/s
against scaled_dot_product_attention's flash backend; the cross-entropy's peak memory against the
unfused loss.

CPU: the kernels run under Triton's interpreter, so the run checks correctness (relative gaps to
the references) and measures the cross-entropy's peak memory; interpreter times are reported but
are not performance.

Run: python benchmarks/bench_kernels.py [--device cpu|cuda] [--budget-s 75] [--out PATH]
Writes benchmarks/results/kernels.json (cpu) or $OUT/kernels.json, else
benchmarks/results/gpu/kernels.json (cuda).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tinytron.kernels import (INTERPRET, FlatAdamW, adamw_bytes, adamw_reference_, attention_flops,
                              attention_reference, cross_entropy, cross_entropy_bytes,
                              flash_attention, rms_norm, rms_norm_bytes, rms_norm_reference,
                              swiglu, swiglu_bytes, swiglu_reference,
                              vocab_parallel_cross_entropy_reference)
from tinytron.main_loop.memory_meter import LiveBytesMeter
from tinytron.parallel import ParallelGrid

SHAPES = {"cuda": dict(tokens=2048, hidden=2048, ffn=8192, vocab=128256, heads=32, kv_heads=8,
                       head_dim=64, adamw_numel=50_000_000, ce_tokens=2048, ce_vocab=128256),
          "cpu": dict(tokens=64, hidden=96, ffn=80, vocab=300, heads=4, kv_heads=2, head_dim=16,
                      adamw_numel=5_000, ce_tokens=256, ce_vocab=4096)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Median milliseconds of fn() after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _fwd_bwd(fn, inputs, grad_out):
    """A closure running fn forward and backward on leaves made once."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(grad_out)
    return run


def _impls(reference, kernel, compile_ok: bool) -> dict:
    """The implementations compared: eager reference, its torch.compile, the Triton kernel."""
    out = {"eager": reference, "triton": kernel}
    if compile_ok:
        out["compile"] = torch.compile(reference)
    return out


def bench_elementwise(name, reference, kernel, inputs, grad_out, bytes_fwd_bwd, device, reps,
                      compile_ok, peak_bw):
    """Times (fwd, fwd+bwd) and bandwidth fraction of each implementation, plus the kernel's gaps."""
    row = {"bytes_min": bytes_fwd_bwd}
    outs = {}
    for impl, fn in _impls(reference, kernel, compile_ok).items():
        t_fwd = timed(lambda: fn(*inputs), device, reps)
        t_all = timed(_fwd_bwd(fn, inputs, grad_out), device, reps)
        row[impl] = {"fwd_ms": t_fwd, "fwd_bwd_ms": t_all}
        if device == "cuda":
            bw = {"fwd": bytes_fwd_bwd["forward"] / (t_fwd * 1e-3),
                  "fwd_bwd": (bytes_fwd_bwd["forward"] + bytes_fwd_bwd["backward"]) / (t_all * 1e-3)}
            row[impl]["GB_per_s"] = {k: v / 1e9 for k, v in bw.items()}
            if peak_bw:
                row[impl]["fraction_of_peak"] = {k: v / peak_bw for k, v in bw.items()}
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.backward(grad_out)
        outs[impl] = [y] + [t.grad for t in leaves]
    row["triton_vs_eager_rel_gap"] = [rel_gap(a, b) for a, b in zip(outs["triton"], outs["eager"])]
    print(f"{name:>14}: " + ", ".join(f"{k} {v['fwd_bwd_ms']:.3f} ms" for k, v in row.items()
                                      if isinstance(v, dict) and "fwd_bwd_ms" in v))
    return row


def bench_attention(s: dict, device: str, reps: int) -> dict:
    """Kernel vs SDPA (flash backend on CUDA) forward and forward+backward, in TFLOP/s."""
    b, h, g, n, d = 1, s["heads"], s["kv_heads"], s["tokens"], s["head_dim"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, do = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, g, n, d, device=device, dtype=dtype) for _ in range(2))
    flops = attention_flops(b, h, n, d, causal=True)
    model_flops = {"fwd": flops["forward"], "fwd_bwd": flops["forward"] * 3.5}  # fwd + 2.5x bwd
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q_, k_, v_):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
        # the flash backend takes equal head counts: K/V expanded once, outside the timing
        k_ref, v_ref = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
        backend = "flash (K/V heads expanded)"
    else:
        sdpa, k_ref, v_ref, backend = attention_reference, k, v, "default (GQA)"
    row = {"shape": [b, h, g, n, d], "dtype": str(dtype), "sdpa_backend": backend}
    for impl, fn, kk, vv in (("triton", flash_attention, k, v), ("sdpa", sdpa, k_ref, v_ref)):
        t_fwd = timed(lambda: fn(q, kk, vv), device, reps)
        t_all = timed(_fwd_bwd(fn, [q, kk, vv], do), device, reps)
        row[impl] = {"fwd_ms": t_fwd, "fwd_bwd_ms": t_all,
                     "TFLOP_per_s": {"fwd": model_flops["fwd"] / t_fwd / 1e9,
                                     "fwd_bwd": model_flops["fwd_bwd"] / t_all / 1e9}}
    row["triton_over_sdpa"] = {k_: row["triton"]["TFLOP_per_s"][k_] / row["sdpa"]["TFLOP_per_s"][k_]
                               for k_ in ("fwd", "fwd_bwd")}
    ref = attention_reference(q.float(), k.float(), v.float())
    row["triton_vs_fp32_rel_gap"] = rel_gap(flash_attention(q, k, v), ref)
    print(f"{'attention':>14}: triton {row['triton']['fwd_bwd_ms']:.3f} ms, sdpa "
          f"{row['sdpa']['fwd_bwd_ms']:.3f} ms, ratio {row['triton_over_sdpa']['fwd_bwd']:.2f}")
    return row


def bench_adamw(numel: int, device: str, reps: int) -> dict:
    """One FlatAdamW step vs the _foreach_ step plus its bf16 copy, on one flat shard."""
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(numel, device=device, generator=gen)
    param_bf16 = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    master = torch.nn.Parameter(torch.randn(numel, device=device, generator=gen))
    group = dict(params=[master], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    state: dict = {}
    flat = FlatAdamW([group], _State(state), [(master, grad, param_bf16, 0)])
    master.grad = grad
    ref = [torch.randn(numel, device=device, generator=gen) for _ in range(3)]

    def foreach_step():
        adamw_reference_([ref[0]], [grad], [ref[1]], [ref[2]], 5, 1e-4, (0.9, 0.95), 1e-8, 0.1)
        param_bf16.copy_(ref[0])
    row = {"numel": numel, "bytes_min": adamw_bytes(numel)}
    for impl, fn in (("triton", flat.step), ("eager_foreach", foreach_step)):
        t = timed(fn, device, reps)
        row[impl] = {"step_ms": t, "GB_per_s": adamw_bytes(numel) / (t * 1e-3) / 1e9}
    print(f"{'adamw':>14}: triton {row['triton']['step_ms']:.3f} ms, foreach "
          f"{row['eager_foreach']['step_ms']:.3f} ms")
    return row


class _State(dict):
    """A dict that creates missing entries, like torch.optim's state."""

    def __missing__(self, key):
        self[key] = {}
        return self[key]


def ce_peak_memory(s: dict, device: str) -> dict:
    """Peak live bytes of the loss forward + backward from bf16 logits: fused vs appendix A."""
    gen = torch.Generator(device=device).manual_seed(0)
    n, v = s["ce_tokens"], s["ce_vocab"]
    logits = torch.randn(n, v, device=device, generator=gen).bfloat16()
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    dloss = torch.rand(n, device=device, generator=gen)
    grid = ParallelGrid.single()
    fns = {"triton": cross_entropy,
           "eager": lambda z, y: vocab_parallel_cross_entropy_reference(z.float(), y, grid)}
    row = {"logits_bytes": logits.numel() * 2}
    for name, fn in fns.items():
        z = logits.clone().requires_grad_()
        with LiveBytesMeter(device) as meter:
            fn(z, labels).backward(dloss)
            row[name] = meter.peak
    row["eager_over_triton"] = row["eager"] / row["triton"]
    print(f"{'CE peak mem':>14}: triton {row['triton'] / 2**20:.1f} MiB, eager "
          f"{row['eager'] / 2**20:.1f} MiB ({row['eager_over_triton']:.1f}x)")
    return row


def peak_bandwidth(device: str) -> tuple[float | None, float | None]:
    """(datasheet HBM bytes/s for known GPUs, measured device-to-device copy bytes/s)."""
    if device != "cuda":
        return None, None
    name = torch.cuda.get_device_name()
    table = [("H200", 4.8e12), ("H100", 3.35e12 if ("HBM3" in name or "SXM" in name) else 2.0e12),
             ("A100", 2.039e12 if "80GB" in name else 1.555e12)]
    sheet = next((bw for key, bw in table if key in name), None)
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, 10)
    return sheet, 2 * src.numel() * 4 / (t * 1e-3)


def elementwise_cases(s: dict, device: str) -> dict:
    """(reference, kernel, inputs, grad_out, bytes) of the three memory-bound kernels."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=device, generator=gen)).to(dtype)
    n, h, f, v = s["tokens"], s["hidden"], s["ffn"], s["vocab"]
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    grid = ParallelGrid.single()
    return {
        "rmsnorm": (rms_norm_reference, rms_norm, [rnd(n, h), rnd(h)], rnd(n, h),
                    rms_norm_bytes(n, h, dtype)),
        "swiglu": (swiglu_reference, swiglu, [rnd(n, 2 * f, scale=2.0)], rnd(n, f),
                   swiglu_bytes(n, f, dtype)),
        "cross_entropy": (lambda z: vocab_parallel_cross_entropy_reference(z.float(), labels, grid),
                          lambda z: cross_entropy(z, labels), [rnd(n, v, scale=4.0)],
                          torch.rand(n, device=device, generator=gen),
                          cross_entropy_bytes(n, v, dtype)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--budget-s", type=float, default=75.0, help="skip torch.compile after this")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device, start = args.device, time.perf_counter()
    if device == "cuda" and INTERPRET:
        raise SystemExit("TRITON_INTERPRET=1 is set: unset it to benchmark compiled kernels")
    reps = args.reps or (20 if device == "cuda" else 1)
    s = SHAPES[device]
    sheet_bw, copy_bw = peak_bandwidth(device)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor()
           or "cpu", "interpreter": INTERPRET, "torch": torch.__version__, "shapes": s,
           "peak_bytes_per_s_datasheet": sheet_bw, "copy_bytes_per_s_measured": copy_bw,
           "note": ("compiled Triton on CUDA" if device == "cuda" else
                    "CPU: Triton interpreter; times are not performance, gaps are the result")}
    cases = elementwise_cases(s, device)
    for name, (ref, kernel, inputs, grad_out, nbytes) in cases.items():
        out[name] = bench_elementwise(name, ref, kernel, inputs, grad_out, nbytes, device, reps,
                                      False, sheet_bw)
    out["attention"] = bench_attention(s, device, reps)
    out["adamw"] = bench_adamw(s["adamw_numel"], device, reps)
    out["cross_entropy_peak_memory"] = ce_peak_memory(s, device)
    for name, (ref, kernel, inputs, grad_out, nbytes) in cases.items():
        if device != "cuda" or time.perf_counter() - start > args.budget_s:
            out[name]["compile"] = "skipped" + ("" if device == "cuda" else " on CPU")
            continue
        row = bench_elementwise(name, ref, kernel, inputs, grad_out, nbytes, device, reps, True,
                                sheet_bw)
        out[name]["compile"] = row["compile"]
    out["seconds"] = time.perf_counter() - start
    default = (Path(__file__).parent / "results" / "kernels.json" if device == "cpu" else
               Path(os.environ.get("OUT") or Path(__file__).parent / "results" / "gpu") / "kernels.json")
    path = Path(args.out or default)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    worst = max(max(out[k]["triton_vs_eager_rel_gap"]) for k in cases)
    print(f"wrote {path}; worst kernel-vs-eager relative gap {worst:.1e}; CE peak memory eager/"
          f"triton {out['cross_entropy_peak_memory']['eager_over_triton']:.2f}x")


if __name__ == "__main__":
    main()

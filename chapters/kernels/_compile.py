"""Compile appendix C's kernels ahead of time for a GPU that is not here, and report their resources.

`python chapters/kernels/_compile.py 80` (run as a script, so that it picks compiled kernels
before the package chooses the interpreter) compiles every kernel at the running example's sizes
(h = 4096, f = 14336 per the 7B example, a 128256-entry vocabulary, head size 128 with grouped
queries) for sm_80 and prints one JSON line per kernel: the shared memory a block needs
(`metadata.shared`), and the registers per thread and bytes of spill stores that ptxas reports
(`Used N registers`, `N bytes spill stores`). No GPU is needed: Triton lowers to PTX and runs the
ptxas it ships for the target named, which is how the tile and warp choices of the pages were
checked. The launch options are the ones the pages use (each module's tile and warp rules).
`python chapters/kernels/_compile.py 90 --configs` compiles at every model size that
configs/*.toml uses instead (`config_sizes`: head sizes 32, 64 and 128), as the slow test does.
"""

from __future__ import annotations

import os

if __name__ == "__main__":
    # The kernels must be @triton.jit functions, not the interpreter's: set before they import.
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default Triton 3.9 applies

import contextlib
import importlib
import io
import json
import re
import sys
import tomllib
from pathlib import Path

import torch

SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
"""Shared memory a block may opt in to: A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB."""

_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _mod(name: str):
    return importlib.import_module(f"tinytron.kernels.{name}")


def _sig(fn, types: dict, consts: dict) -> dict:
    """Triton's signature: every argument's type, in the kernel's order ('constexpr' for consts)."""
    return {a: ("constexpr" if a in consts else types[a]) for a in fn.arg_names}


def kernel_specs(dtype: torch.dtype = torch.bfloat16, hidden: int = 4096, ffn: int = 14336,
                 vocab: int = 128256, head_dim: int = 128) -> list[tuple]:
    """(name, jit function, signature, constexprs, launch options) for every kernel of appendix C."""
    from tinytron.kernels._triton import dot_flags, row_warps

    t, specs = _TY[dtype], []
    rms, swi, ce = _mod("rmsnorm"), _mod("swiglu"), _mod("cross_entropy")
    fa, adam = _mod("flash_attention"), _mod("fused_adamw")
    ptr = lambda *names, ty=t: {n: f"*{ty}" for n in names}  # noqa: E731
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    rows, block = rms.row_tiles(hidden)
    c = dict(ROWS=rows, BLOCK_H=block)
    specs.append(("rmsnorm_fwd", rms._rmsnorm_fwd_kernel,
                  {**ptr("x_ptr", "w_ptr", "y_ptr"), "rstd_ptr": "*fp32", **ints("n_rows", "n_cols"),
                   "eps": "fp32"}, c, {"num_warps": row_warps(rows * block)}))
    specs.append(("rmsnorm_bwd", rms._rmsnorm_bwd_kernel,
                  {**ptr("dy_ptr", "x_ptr", "w_ptr", "dx_ptr"), "rstd_ptr": "*fp32",
                   "dw_partial_ptr": "*fp32", **ints("n_rows", "n_cols")}, c,
                  {"num_warps": row_warps(rows * block)}))
    rows, block, _ = swi._tiles(1, ffn)
    c = dict(ROWS=rows, BLOCK=block)
    for name, fn in (("swiglu_fwd", swi._swiglu_fwd_kernel), ("swiglu_bwd", swi._swiglu_bwd_kernel)):
        specs.append((name, fn, {**ptr("x_ptr", "out_ptr", "dy_ptr", "dx_ptr"), **ints("n_rows", "f")},
                      c, {"num_warps": row_warps(rows * block)}))
    rows, block, _ = ce._tiles(1, vocab)
    c = dict(ROWS=rows, BLOCK_V=block)
    ce_types = {**ptr("logits_ptr", "dlogits_ptr"), "labels_ptr": "*i64",
                **ptr("max_ptr", "sumexp_ptr", "target_ptr", "lse_ptr", "dloss_ptr", ty="fp32"),
                **ints("n_rows", "n_cols", "vocab_start")}
    for name, fn in (("ce_fwd", ce._ce_fwd_kernel), ("ce_bwd", ce._ce_bwd_kernel)):
        specs.append((name, fn, ce_types, c, {"num_warps": row_warps(rows * block)}))
    upcast, precision = dot_flags(dtype)
    fa_types = {**ptr("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr"),
                **ptr("lse_ptr", "delta_ptr", ty="fp32"),
                **ints("seq_len", "num_heads", "num_kv_heads"), "scale": "fp32"}
    tiles = fa._tiles(head_dim)
    for name, fn, key in (("attn_fwd", fa._attn_fwd_kernel, "fwd"),
                          ("attn_bwd_dkdv", fa._attn_bwd_dkdv_kernel, "dkdv"),
                          ("attn_bwd_dq", fa._attn_bwd_dq_kernel, "dq")):
        bm, bn, opts = tiles[key]
        specs.append((name, fn, fa_types, dict(CAUSAL=True, HEAD_DIM=head_dim, BLOCK_M=bm,
                                                BLOCK_N=bn, UPCAST=upcast, PRECISION=precision),
                      opts))
    specs.append(("attn_bwd_delta", fa._attn_bwd_delta_kernel,
                  {**fa_types, "n_rows": "i32"}, dict(HEAD_DIM=head_dim, BLOCK_M=fa.DELTA_ROWS),
                  {"num_warps": row_warps(fa.DELTA_ROWS * head_dim)}))
    chunk = adam.DEFAULT_CHUNK
    specs.append(("adamw", adam._adamw_kernel,
                  {"chunks_ptr": "*i64", **ptr("master_ptr", "exp_avg_ptr", "exp_avg_sq_ptr",
                                               "grad_ptr", ty="fp32"), "param_ptr": "*bf16",
                   **{n: "fp32" for n in adam.HPARAM_COLUMNS}}, dict(CHUNK=chunk),
                  {"num_warps": adam.adamw_warps(chunk)}))
    return specs


def config_sizes(folder: Path | None = None) -> list[dict]:
    """The distinct (hidden, ffn, vocab, head_dim) of the model sections of configs/*.toml."""
    folder = folder or Path(__file__).resolve().parents[2] / "configs"
    sizes = []
    for path in sorted(folder.glob("*.toml")):
        m = tomllib.loads(path.read_text()).get("model", {})
        if "hidden_size" not in m:
            continue
        size = dict(hidden=m["hidden_size"], ffn=m["ffn_hidden_size"], vocab=m["vocab_size"],
                    head_dim=m.get("kv_channels") or m["hidden_size"] // m["num_attention_heads"])
        if size not in sizes:
            sizes.append(size)
    return sizes


_REPORTS: dict[tuple, dict] = {}  # one compile per distinct (kernel, types, constexprs, options)


def compile_for(arch: int, names: list[str] | None = None, **sizes) -> list[dict]:
    """Compile the kernels for sm_<arch> at `sizes` (kernel_specs' keywords; default the
    running example's): per kernel its shared bytes, registers and spill bytes. A kernel whose
    signature, constexprs and launch options equal one already compiled for this arch (AdamW at
    every size, attention at a repeated head size) reports that compile's resources."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    knobs.nvidia.dump_ptxas_log = True         # ptxas -v's report, printed by Triton
    knobs.compilation.always_compile = True    # a cached kernel would print no report
    out = []
    for name, fn, types, consts, opts in kernel_specs(**sizes):
        if names and name not in names:
            continue
        key = (arch, name, repr(sorted(types.items())), repr(sorted(consts.items())),
               repr(sorted(opts.items())))
        if key in _REPORTS:
            out.append(dict(_REPORTS[key], sizes=sizes))
            continue
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn, _sig(fn, types, consts), consts),
                               target=GPUTarget("cuda", arch, 32), options=opts)
        text = log.getvalue()
        regs = [int(n) for n in re.findall(r"Used (\d+) registers", text)]
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", text)]
        out.append({"kernel": name, "arch": arch, "triton": triton.__version__,
                    "sizes": sizes, "shared": k.metadata.shared,
                    "num_warps": k.metadata.num_warps, "registers": max(regs, default=None),
                    "spill_bytes": max(spills, default=None), "consts": consts})
        _REPORTS[key] = out[-1]
    return out


if __name__ == "__main__":
    # python _compile.py ARCH [--configs] [KERNEL ...]: --configs compiles at every model size
    # of configs/*.toml instead of the running example's
    args = sys.argv[2:]
    every = "--configs" in args
    names = [a for a in args if a != "--configs"] or None
    for sizes in (config_sizes() if every else [{}]):
        for row in compile_for(int(sys.argv[1]), names, **sizes):
            print(json.dumps(row), flush=True)

"""Triton set-up shared by the kernel pages: interpreter on CPU, input checks, the torch/triton switch."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # @triton.jit decides compiled vs interpreted when the decorator runs (module import), so the
    # interpreter must be chosen before any kernel module loads. Without CUDA it is the only way
    # the kernels can run; an explicit TRITON_INTERPRET=0 from the user is left alone.
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the `kernels` extra is not installed: the torch references still work
    HAS_TRITON = False

    class _Unavailable:
        """Stands in for a kernel when triton is missing; launching it says what to install."""

        def __init__(self, fn):
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            require_triton()

        def __call__(self, *args, **kwargs):
            require_triton()

    class _MissingTriton:
        """Just enough of `triton` / `triton.language` for the kernel modules to import."""

        constexpr = float32 = bfloat16 = float16 = int64 = None

        @staticmethod
        def jit(fn=None, **_):
            return _Unavailable(fn) if fn is not None else _Unavailable

    triton = tl = _MissingTriton()

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
"""True when the kernels run under Triton's interpreter (numpy on the host) instead of compiled."""

# triton.language's own helpers (tl.sum, tl.sigmoid) are interpreted only if the variable was
# set before triton was first imported; an earlier `import triton` leaves them compiled-only.
_STALE_TRITON = HAS_TRITON and INTERPRET and type(tl.sum).__name__ != "InterpretedFunction"

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KERNEL_CHOICES = ("torch", "triton", "auto")

__all__ = ["triton", "tl", "HAS_TRITON", "INTERPRET", "SUPPORTED_DTYPES", "KERNEL_CHOICES",
           "require_triton", "check_tensor", "resolve_kernels", "use_triton", "dot_flags", "num_row_programs",
           "rows_per_program", "row_warps", "MAX_ROW_LANES",
           "mma", "round_to"]


def require_triton() -> None:
    """Raise a clear error when the `kernels` extra (triton) is not installed."""
    if not HAS_TRITON:
        raise RuntimeError("kernels='triton' needs the triton package: "
                           "pip install 'tinytron[kernels]' (or pip install triton)")


def check_tensor(name: str, t: torch.Tensor, dtypes=SUPPORTED_DTYPES, dims: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
    """ValueError naming `name` for a dtype, rank, layout or device a kernel cannot take."""
    require_triton()
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or (dtype is not None and t.dtype != dtype):
        want = [str(dtype)] if dtype is not None else [str(d) for d in dtypes]
        raise ValueError(f"{name} has dtype {t.dtype}; the kernel takes {', '.join(want)}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got shape {tuple(t.shape)} "
                         f"with strides {t.stride()}; call .contiguous() first")
    if not t.is_cuda and not INTERPRET:
        raise ValueError(f"{name} is on {t.device}: compiled Triton kernels need CUDA tensors "
                         "(set TRITON_INTERPRET=1 before importing tinytron to run them on CPU)")
    if _STALE_TRITON:
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its "
                           "interpreter cannot run; import tinytron (or export the variable) first")


def resolve_kernels(choice: str, device: torch.device | str | None = None) -> str:
    """'torch' or 'triton' for a config value; 'auto' is triton on CUDA when triton imports."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "auto":
        on_cuda = torch.device(device).type == "cuda" if device is not None else False
        return "triton" if (HAS_TRITON and on_cuda) else "torch"
    if choice == "triton":
        require_triton()
    return choice


def use_triton(choice: str, device: torch.device | str | None) -> bool:
    """Whether a layer configured with `choice` runs the Triton kernels for tensors on `device`."""
    return resolve_kernels(choice, device) == "triton"


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, PRECISION) constexprs for `mma`: exact fp32 products, bf16 under the interpreter."""
    # The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies the bit patterns
    # (triton-lang/triton#11584): it gets fp32 operands instead. Compiled, bf16/fp16 go to the
    # tensor cores as they are; fp32 asks for IEEE products rather than TF32.
    upcast = INTERPRET and dtype == torch.bfloat16
    return upcast, ("ieee" if dtype == torch.float32 or upcast else "tf32")


def rows_per_program(block: int) -> int:
    """Rows a row-wise kernel tiles together: enough for ~4K (compiled) or ~16K (interpreted) lanes."""
    # Compiled, a 4096-wide bf16 row already fills a program; narrow rows share one, at most 4:
    # with Triton 3.6, sm_80 spills from 8 rows of 512 (cross-entropy's forward at a 512-entry
    # vocabulary, 8 B per thread) and 16 rows of 128 (RMSNorm's forward, 4 B), each row's
    # reduction keeping its own registers. Interpreted, every program costs Python overhead,
    # so the tiles are bigger.
    lanes = 16384 if INTERPRET else 4096
    return max(1, min(64 if INTERPRET else 4, lanes // block))


MAX_ROW_LANES = 8192
"""The widest row a whole-row program holds: 16 warps x 32 threads x 16 fp32 values per thread."""


def row_warps(lanes: int) -> int:
    """num_warps for a program of `lanes` elements per tensor: 16 per thread, 4 to 16 warps."""
    # Every thread keeps its share of each live fp32 tensor in registers. At 16 values a tensor,
    # four live tensors (RMSNorm's backward: x, dy, w, the dw partial) take 64 of the 128
    # registers a thread may use in a 512-thread block; 4 warps at 4096 lanes hold 32 values a
    # tensor, and RMSNorm's backward spills from 8192 lanes.
    return max(4, min(16, lanes // 512))


def num_row_programs(n_rows: int, device: torch.device, per_sm: int = 4) -> int:
    """Programs for a persistent row loop: a few per SM on CUDA, a handful on the interpreter."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, per_sm * sms))
    return max(1, min(n_rows, 8))


if HAS_TRITON:
    # The interpreter casts fp32 to bf16 by truncation; compiled kernels round to nearest even.
    # round_to rounds explicitly when interpreting, so CPU tests see the GPU's numbers.
    _EMULATE_RTNE = tl.constexpr(INTERPRET)

    @triton.jit
    def mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ b with fp32 accumulation (operands upcast when UPCAST)."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """fp32 x rounded to nearest even in `dtype`."""
        if _EMULATE_RTNE and dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + ((bits >> 16) & 1) + 0x7FFF) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dtype)
else:
    mma = round_to = None

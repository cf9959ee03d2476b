"""Which kernel `scaled_dot_product_attention` runs for the attention call the ledger describes.

Torch answers for a device it has: `torch._fused_sdp_choice` is the dispatcher's own choice for
the given tensors (it honors `torch.nn.attention.sdpa_kernel` and, on CUDA, the device's
architecture and the cuDNN preference of newer builds). A CUDA ledger computed where no GPU is
(the book's pages, the calculator on a laptop) cannot ask, so `rule_choice` writes torch's
dispatch out as a table, read from torch's source for torch 2.5 to 2.13 on sm_80 to sm_90:

- CPU (`aten/src/ATen/native/transformers/sdp_utils_cpp.cpp`, `use_flash_attention_cpp`): the
  CPU flash kernel takes every dtype, grouped queries and a mask; only attention dropout
  (`check_for_dropout`) sends the call to the math kernel.
- CUDA (`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`, `select_sdp_backend`, default
  order flash, mem-efficient, math):
  flash (`can_use_flash_attention`) needs fp16/bf16 (`check_dtypes_flash_attention`), no mask
  (`check_for_attn_mask`), head size <= 256, and takes grouped queries and dropout;
  mem-efficient (`can_use_mem_efficient_attention`) takes fp32 too and a mask, needs the head
  size a multiple of 4 (fp32) or 8 (fp16/bf16), and refuses grouped queries (its head-count
  check is instantiated without GQA support in these releases, so `enable_gqa` with fewer
  key/value heads fails it); everything else runs the math kernel.
  Newer builds may put cuDNN first on sm_90 (`check_prefer_cudnn_attention`); cuDNN takes
  fp16/bf16 only and keeps what flash keeps (q, k, v, the output and fp32 row statistics), so
  the ledger's layout is the same either way: asked on the GPU, torch names it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

SDPA_KERNELS = ("flash", "efficient", "cudnn", "math")
"""The kernels' names in the ledger: every one but math keeps O(s) per head, math the scores."""

_BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}  # torch's SDPBackend values


@dataclass(frozen=True)
class SdpaCall:
    """One attention call as appendix B's CoreAttention makes it, per rank."""

    device: str
    dtype: torch.dtype
    batch: int
    heads: int
    groups: int
    q_len: int
    kv_len: int
    head_dim: int
    dropout: float
    masked: bool
    """An explicit mask (context parallelism's reordered causal mask), else is_causal."""


def rule_choice(call: SdpaCall) -> tuple[str, str]:
    """(kernel, the rule that picked it) from the table above, without asking torch."""
    if call.device == "cpu":
        return ("math", "CPU with attention dropout") if call.dropout > 0 else \
            ("flash", "CPU flash takes every dtype, GQA and masks")
    half = call.dtype in (torch.float16, torch.bfloat16)
    if not half:
        why = "fp32 on CUDA: flash takes fp16/bf16 only"
    elif call.masked:
        why = "an explicit mask on CUDA: flash takes none"
    elif call.head_dim > 256:
        why = "head size > 256: flash takes at most 256"
    else:
        return "flash", "bf16/fp16 on CUDA, no mask, head size <= 256"
    if call.heads != call.groups:
        return "math", why + "; mem-efficient refuses grouped queries"
    if call.head_dim % (8 if half else 4):
        return "math", why + "; mem-efficient needs the head size aligned"
    return "efficient", why + "; mem-efficient takes it"


@functools.lru_cache(maxsize=256)
def torch_choice(call: SdpaCall) -> str | None:
    """torch's own choice for tensors of this call's shapes, or None where it cannot tell.

    Cached per call: torch's global switches (`torch.backends.cuda.enable_*_sdp`) are read the
    first time a shape is asked about, which is when a ledger is computed.
    """
    if call.device == "cuda" and not torch.cuda.is_available():
        return None
    device = torch.device(call.device)

    def operand(heads: int, seq: int) -> torch.Tensor:
        # [b, heads, seq, d] views of one row: the dispatcher reads shapes, dtypes, the last
        # stride and the alignment, never the values, so no activation-sized allocation
        row = torch.zeros(call.head_dim, dtype=call.dtype, device=device, requires_grad=True)
        return row.as_strided((call.batch, heads, seq, call.head_dim), (0, 0, 0, 1))
    q, k = operand(call.heads, call.q_len), operand(call.groups, call.kv_len)
    mask = (torch.ones(1, dtype=torch.bool, device=device).expand(call.q_len, call.kv_len)
            if call.masked else None)
    choice = torch._fused_sdp_choice(q, k, operand(call.groups, call.kv_len), attn_mask=mask,
                                     dropout_p=call.dropout, is_causal=not call.masked,
                                     enable_gqa=True)
    return _BACKENDS[int(choice)]


def sdpa_choice(call: SdpaCall) -> tuple[str, str]:
    """(kernel, why): torch's answer on a device it has, else the rule table's."""
    asked = torch_choice(call)
    if asked is not None:
        return asked, f"torch {torch.__version__.split('+')[0]}'s own choice on this {call.device}"
    kernel, why = rule_choice(call)
    return kernel, f"{why}: torch's CUDA dispatch rules, no GPU here to ask"


def lse_rows(kernel: str, q_len: int) -> int:
    """Rows of the fp32 logsumexp a kernel keeps per head: mem-efficient pads them to 32."""
    # _efficient_attention_forward allocates ceil(s_q / kAlignLSE) * kAlignLSE, kAlignLSE = 32
    # (aten/src/ATen/native/transformers/cuda/attention.cu)
    return -(-q_len // 32) * 32 if kernel == "efficient" else q_len

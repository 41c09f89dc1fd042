"""The gated MLP's activation for inference as one Triton kernel: silu(gate) * up.

PyTorch takes two kernels (the SiLU, then the product) and a [.., intermediate] tensor between
them; a decode step runs it once a layer. Forward only: training keeps PyTorch's ops, or
liger-kernel's (glaswap.distill.student.fuse_layers).
"""

from __future__ import annotations

import torch

try:
    # The try block keeps transformers' remote-code import checker from requiring Triton in
    # a saved model's folder (ops falls back to PyTorch without it).
    import triton
    import triton.language as tl
except ImportError:
    raise

from .utils import cdiv, new  # new: NaN under POISON

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(a, b, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(a + i, mask=m, other=0.0).to(tl.float32)
    y = tl.load(b + i, mask=m, other=0.0)
    s = (x * tl.sigmoid(x)).to(y.dtype)           # SiLU in the input dtype, as PyTorch returns it
    tl.store(out + i, (s.to(tl.float32) * y.to(tl.float32)).to(out.dtype.element_ty), mask=m)


def fused_silu_mul(a, b):
    """silu(a) * b for a, b of one shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"fused_silu_mul wants a and b of one shape and dtype; got {tuple(a.shape)} {a.dtype}, "
                         f"{tuple(b.shape)} {b.dtype}")
    a, b = a.contiguous(), b.contiguous()
    out = new(a.shape, a.dtype, a.device)
    n = a.numel()
    _silu_mul_kernel[(cdiv(n, _BLOCK),)](a, b, out, n, BLOCK=_BLOCK, num_warps=4)
    return out

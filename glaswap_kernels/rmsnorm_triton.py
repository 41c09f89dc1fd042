"""Llama's RMSNorm for inference as one Triton kernel.

    out = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)

normalised in float32 and scaled in the output dtype (weight's and x's promoted), as
glaswap.layers.gla_attention.RMSNorm computes it. PyTorch spends up to eight kernels a call on
it (casts, square, mean, add, rsqrt, two products); a decode step calls it twice a layer,
where every launch counts. Forward only: training keeps PyTorch's ops and their autograd.
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

from .utils import cdiv, new, next_pow2  # new: NaN under POISON


@triton.jit
def _rms_norm_kernel(x, w, out, n_rows, eps, N: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BN)
    m = (rows < n_rows)[:, None] & (cols < N)[None, :]
    v = tl.load(x + rows[:, None] * N + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(v * v, axis=1) / N + eps)
    y = (v * r[:, None]).to(x.dtype.element_ty).to(tl.float32)       # the input dtype, as RMSNorm casts
    scale = tl.load(w + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out + rows[:, None] * N + cols[None, :], (y * scale[None, :]).to(out.dtype.element_ty), mask=m)


def fused_rms_norm(x, weight, eps=1e-6):
    """x [..., N] normalised over its last dimension and scaled by weight [N]; the output in
    the promotion of weight's and x's dtypes."""
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"fused_rms_norm wants x [..., N] and weight [N]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    x = x.contiguous()
    rows = x.numel() // N
    out = new(x.shape, torch.promote_types(weight.dtype, x.dtype), x.device)
    BN = next_pow2(N)
    BR = max(1, min(16, 4096 // BN))              # rows a program: a few thousand values in registers
    _rms_norm_kernel[(cdiv(rows, BR),)](x, weight.contiguous(), out, rows, float(eps), N=N, BN=BN, BR=BR,
                                        num_warps=4 if BN <= 1024 else 8)
    return out

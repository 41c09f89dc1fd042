"""The GLA normaliser's division as one Triton kernel each way.

With the normaliser, the GLA kernels return o with V + 1 columns: the numerator (V columns)
and the denominator (the last one). The layer's output is their ratio,

    out = num / (den + eps),

which PyTorch spends a slice, casts, a division forward and a division plus two slice
backwards (each a zero-fill and a copy) backward on: ~6 passes over a [B, T, H, V] tensor
per layer. Here it is one pass forward (read V + 1 columns, write V) and one backward (read
the incoming gradient and o, write the V + 1 column gradient):

    d num = d out / (den + eps)
    d den = -sum_v d out * num / (den + eps)^2
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

from .utils import cdiv, new, next_pow2, row_stride, state_stride  # new: NaN under POISON

_ROWS = 64


@triton.jit
def _load_num_den(o, rows, cols, n_rows, V: tl.constexpr, RS: tl.constexpr):
    """num [rows, BV] and den [rows] (float32) of rows of o: n_rows rows of V + 1 values,
    RS apart."""
    m = (rows < n_rows)[:, None] & (cols < V)[None, :]
    num = tl.load(o + rows[:, None] * RS + cols[None, :], mask=m, other=0.0).to(tl.float32)
    den = tl.load(o + rows * RS + V, mask=rows < n_rows, other=1.0).to(tl.float32)
    return num, den, m


@triton.jit
def _normalize_fwd_kernel(o, out, n_rows, eps, V: tl.constexpr, RS: tl.constexpr, BV: tl.constexpr,
                          BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BV)
    num, den, m = _load_num_den(o, rows, cols, n_rows, V, RS)
    y = num / (den + eps)[:, None]
    tl.store(out + rows[:, None] * V + cols[None, :], y.to(out.dtype.element_ty), mask=m)


@triton.jit
def _normalize_bwd_kernel(o, dout, do, n_rows, eps, V: tl.constexpr, RS: tl.constexpr,
                          RD: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BV)
    num, den, m = _load_num_den(o, rows, cols, n_rows, V, RS)
    dy = tl.load(dout + rows[:, None] * V + cols[None, :], mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / (den + eps)
    dnum = dy * inv[:, None]
    dden = -tl.sum(dnum * num, axis=1) * inv
    tl.store(do + rows[:, None] * RD + cols[None, :], dnum.to(do.dtype.element_ty), mask=m)
    tl.store(do + rows * RD + V, dden.to(do.dtype.element_ty), mask=rows < n_rows)


class _Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, eps):
        V = o.shape[-1] - 1
        rs = row_stride(o)                  # fused_chunk_gla's o: rows padded to 8 values
        if rs is None:
            o, rs = o.contiguous(), V + 1
        rows = o.numel() // (V + 1)
        out = new(o.shape[:-1] + (V,), o.dtype, o.device)
        BV = max(16, next_pow2(V))
        _normalize_fwd_kernel[(cdiv(rows, _ROWS),)](o, out, rows, eps, V=V, RS=rs, BV=BV,
                                                    BR=_ROWS, num_warps=4)
        ctx.save_for_backward(o)
        ctx.eps, ctx.rs = eps, rs
        return out

    @staticmethod
    def backward(ctx, dout):
        (o,) = ctx.saved_tensors
        V = o.shape[-1] - 1
        rows = o.numel() // (V + 1)
        # the gradient in the rows fused_chunk_gla pads o to (a view of V + 1 columns): its
        # backward then reads it with vector loads instead of copying it
        rd = state_stride(V, True)
        do = new(o.shape[:-1] + (rd,), o.dtype, o.device)[..., :V + 1]
        BV = max(16, next_pow2(V))
        _normalize_bwd_kernel[(cdiv(rows, _ROWS),)](o, dout.contiguous(), do, rows, ctx.eps,
                                                    V=V, RS=ctx.rs, RD=rd, BV=BV, BR=_ROWS,
                                                    num_warps=4)
        return do, None


def fused_normalize(o, eps=1e-6):
    """o [..., V + 1] (numerator columns, then the denominator) -> o[..., :V] / (o[..., V] + eps),
    in o's dtype, computed in float32."""
    if o.shape[-1] < 2:
        raise ValueError(f"fused_normalize wants [..., V + 1] with V >= 1, got {tuple(o.shape)}")
    return _Normalize.apply(o, float(eps))
